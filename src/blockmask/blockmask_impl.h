// The BlockMask's internals: the resolved build problem, the interval analysis over boxes of
// tiles, and the three builders (CPU, GPU) that share them. Not installed.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "attention/attention_args.h"
#include "dsl/analysis.h"
#include "flexc/blockmask.h"
#include "flexc/tensor.h"

struct FlexcBlockMask;

namespace flexc::detail {

// Everything a builder needs, validated: sizes, param values and captures by slot.
struct MaskProblem {
  const Variant* variant = nullptr;
  const dsl::Graph* mask = nullptr;
  const dsl::Decls* decls = nullptr;
  std::string variant_name;
  int64_t B = 1, H = 1, nb = 1, nh = 1;  // nb / nh: 1 when the mask does not read b / h
  int64_t q_len = 0, kv_len = 0, q_tile = 0, kv_tile = 0, nqt = 0, nkt = 0;
  // Row r of the mask is query position pos.q_offset + r, column c key position pos.kv_offset +
  // c; mask_mod's lengths are pos.seq_q_len and pos.seq_kv_len.
  Positions pos;
  std::vector<double> params;                        // by param slot
  std::vector<dsl::HostTensor> captures;             // by capture slot (data null when not read)
  std::vector<std::vector<int64_t>> capture_shapes;  // by capture slot
  // The user's device copies of the captures the mask reads, by slot (data null where not given).
  std::vector<TensorView> device_captures;
  std::vector<uint16_t> read_captures;  // slots the mask reads

  int64_t groups() const { return nb * nh; }
  int64_t tiles() const { return groups() * nqt * nkt; }
};

// Throws flexc::Error "<what>: <name> = <value> is not in [1, INT32_MAX]" (indices, lengths and
// tile sizes are int32 in the kernels).
void check_geometry(std::string_view what,
                    std::initializer_list<std::pair<const char*, int64_t>> values);

// Throws flexc::Error "<what>: ..." unless the tile grid fits the kernels' int32 indexing: the
// lengths rounded up to whole tiles, groups * tiles per side, and the tile count (at most 2^36,
// the host grid's bytes). Sizes as check_geometry admits them; products are overflow-checked.
void check_tile_grid(std::string_view what, int64_t nb, int64_t nh, int64_t q_len, int64_t kv_len,
                     int64_t q_tile, int64_t kv_tile);

// Throws flexc::Error "<what>: ..." when the BlockMask's lists (16 bytes a tile, 8 a row and a
// column, plus the 1-byte tile grid of a build) would take more than `max_bytes` (0: the default),
// before anything is allocated. The grid must have passed check_tile_grid.
void check_mask_bytes(std::string_view what, int64_t groups, int64_t nqt, int64_t nkt,
                      uint64_t max_bytes);

MaskProblem resolve_problem(const Variant& v, int64_t B, int64_t H, int64_t q_len, int64_t kv_len,
                            const BlockMaskOptions& opts);

// The elements of tile (b, h, qt, kt) that mask_mod keeps (float32, as the kernels decide), `bm`
// being p's BlockMask: a full tile's count, a partial one's by the interpreter, an empty one's 0.
class TileKeptCounter {
 public:
  explicit TileKeptCounter(const MaskProblem& p);
  double kept(const BlockMask& bm, int64_t b, int64_t h, int64_t qt, int64_t kt);

 private:
  const MaskProblem& p_;
  dsl::EvalEnv env_;
  std::vector<dsl::Value> scratch_;
};

// A box of tiles, half-open: batches [b0, b1), heads [h0, h1) (broadcast coordinates: within
// [0, nb) x [0, nh)), q tiles [q0, q1), kv tiles [k0, k1). The GPU builder uploads these as is.
struct TileBox {
  int32_t b0, b1, h0, h1, q0, q1, k0, k1;
  int64_t area() const { return int64_t(b1 - b0) * (h1 - h0) * (q1 - q0) * (k1 - k0); }
};

// Minimum and maximum of a captured tensor over index boxes, for the interval analysis. Along
// the last dim of each row (one combination of the leading indices): minima / maxima of blocks
// of kBlock elements, and a sparse table over superblocks of kBlock blocks. A range reads at
// most 2 * kBlock elements and 2 * kBlock blocks at its ends and two sparse-table entries; a
// box over more than kMaxRows rows, or a row holding a NaN, is unknown (nullopt).
class CaptureRanges {
 public:
  explicit CaptureRanges(const dsl::HostTensor& t);  // t must outlive this
  // idx: one closed range per dim, inside the shape.
  std::optional<std::pair<double, double>> query(std::span<const dsl::IntRange> idx) const;

 private:
  static constexpr int64_t kBlock = 32, kMaxRows = 1024;
  int64_t at(int lvl, int64_t r, int64_t sb) const { return (lvl * rows_ + r) * nsuper_ + sb; }
  std::pair<double, double> scan(int64_t r, int64_t lo, int64_t hi) const;  // elements [lo, hi]
  std::pair<double, double> scan_blocks(int64_t r, int64_t b0, int64_t b1) const;  // [b0, b1)
  std::pair<double, double> row_range(int64_t r, int64_t lo, int64_t hi) const;

  const dsl::HostTensor& t_;
  std::vector<int64_t> shape_, strides_, base_;  // base_: element offset of each row
  int64_t n_ = 0, rows_ = 0, nblocks_ = 0, nsuper_ = 0;
  int levels_ = 0;
  std::vector<double> bmin_, bmax_, smin_, smax_;
  std::vector<uint8_t> nan_;
};

struct Analysis {
  std::vector<TileBox> full, undecided;  // empty boxes are implied: everything else
  int64_t decided_tiles = 0;
  int64_t boxes = 0;  // interval evaluations
};

// Subdivides the tile grid (quadtree over q x kv tiles, halving b / h ranges where the mask
// depends on them) until each box is decided or has at most `leaf_tiles` tiles, or until
// `max_boxes` interval evaluations are spent (the boxes left then stay undecided).
Analysis analyse(const MaskProblem& p, int64_t leaf_tiles, int64_t max_boxes);

inline int64_t gpu_leaf_tiles(const BlockMaskOptions& o) {
  return o.gpu_leaf_tiles > 0 ? o.gpu_leaf_tiles : BlockMaskOptions::kDefaultGpuLeafTiles;
}
// Past this many interval evaluations a GPU build hands the remaining boxes to the device.
inline int64_t gpu_box_budget(const MaskProblem& p) { return 4096 + p.tiles() / 64; }

// Every tile of the problem as one undecided box (brute force).
Analysis no_analysis(const MaskProblem& p);

// Classifies one tile by evaluating its in-range elements with the interpreter (float32, as the
// kernels compute), stopping as soon as it has seen both a true and a false element.
TileKind classify_tile_cpu(const MaskProblem& p, int64_t b, int64_t h, int64_t qt, int64_t kt,
                           std::vector<dsl::Value>& scratch);

// Tile-verdict grid (one TileKind byte per tile, row-major over (group, qt, kt)) -> the lists.
BlockMask::Host lists_from_grid(std::span<const uint8_t> grid, int64_t groups, int64_t nqt,
                                int64_t nkt);

// The GPU build, enqueued on `stream`: the device arrays, complete once the stream reaches them.
struct DeviceMask;
std::shared_ptr<DeviceMask> build_on_gpu(const MaskProblem& p, const Analysis& a,
                                         CUstream_st* stream);
// Upload / download of the lists and the view into them.
std::shared_ptr<DeviceMask> upload_mask(const BlockMask::Host& h, int64_t groups, int64_t nqt,
                                        int64_t nkt, CUstream_st* stream);
BlockMask::Host download_mask(const DeviceMask& d, int64_t groups, int64_t nqt, int64_t nkt);
// Makes `stream` wait for the writes of the build / upload when they were enqueued on another
// stream (a mask built on stream A and used by attention on stream B).
void wait_written(const DeviceMask& d, CUstream_st* stream);
// Device pointers of the eight arrays, filled into `view` (sizes and tiles are set by the caller).
void fill_view(const DeviceMask& d, FlexcBlockMask& view);

// The device arrays for the kernels; a mask built on the CPU is uploaded on first use, on
// `stream`. Valid as long as any copy of `m` lives.
const FlexcBlockMask& device_view(const BlockMask& m, CUstream_st* stream = nullptr);

// The state behind a public BlockMask, and a BlockMask around one: for flexc's own code only.
struct BlockMaskAccess {
  static BlockMask::State& state(const BlockMask& m) { return *m.s_; }
  static BlockMask make(std::shared_ptr<BlockMask::State> s) { return BlockMask(std::move(s)); }
};

}  // namespace flexc::detail

namespace flexc {

struct BlockMask::State {
  int64_t nb = 1, nh = 1, q_len = 0, kv_len = 0, q_tile = 0, kv_tile = 0, nqt = 0, nkt = 0;
  detail::Positions pos;  // resolved
  BlockMaskStats stats;
  // At least one of the two is set at construction; the other is made on demand.
  mutable std::mutex mu;
  mutable std::optional<Host> host;
  mutable std::shared_ptr<detail::DeviceMask> device;
  mutable std::unique_ptr<FlexcBlockMask> view;
};

}  // namespace flexc
