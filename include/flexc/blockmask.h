// flexc::BlockMask: which tiles of the score matrix an attention kernel computes, and how.
//
// The Q_LEN x KV_LEN score matrix is cut into q_tile x kv_tile tiles. Each tile is
//   full    - mask_mod is true on every element inside the lengths (the kernel skips mask_mod),
//   partial - true on some elements (the kernel applies mask_mod per element),
//   empty   - true on none (the kernel never loads it).
// Elements past q_len / kv_len never count: an edge tile is full when every in-range element is
// true, and the kernels mask the out-of-range part by length themselves.
// The lists are FlexAttention's; the kernels' device view of them is internal to flexc.
// See docs/blockmask.md.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "flexc/variant.h"

struct CUstream_st;

namespace flexc {

namespace detail {
struct BlockMaskAccess;  // flexc's own code reaches the state through it
                         // (src/blockmask/blockmask_impl.h)
}

// A captured tensor as the BlockMask builders read it, in its declared dtype (bf16 / fp16 as raw
// 16-bit words, bool as bytes) and dims (B and H resolve to the call's B and H). The host copy is
// required: the analysis takes minima / maxima of it. The device copy is optional: a GPU build
// with tiles to evaluate reads it instead of uploading the host copy.
struct CaptureData {
  const void* host = nullptr;
  const void* device = nullptr;  // same elements, same strides, on the current device
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;  // in elements; empty: contiguous
};

enum class TileKind : uint8_t { Empty = 0, Partial = 1, Full = 2 };

enum class BuildDevice { Auto, Cpu, Gpu };  // Auto: the GPU when one is present

struct BlockMaskOptions {
  int64_t q_tile = 128, kv_tile = 128;
  // Positions (AttentionOptions' fields of the same names; they must match the call's): mask_mod
  // sees q_idx = q_offset + row, kv_idx = kv_offset + column, q_len = seq_q_len and kv_len =
  // seq_kv_len (0: q_offset + Q_LEN, kv_offset + KV_LEN).
  int64_t q_offset = 0, kv_offset = 0;
  int64_t seq_q_len = 0, seq_kv_len = 0;
  // Runtime param values by name; a param left out takes its declared default.
  std::map<std::string, double, std::less<>> params;
  // The captures mask_mod reads, by name (others are ignored).
  std::map<std::string, CaptureData, std::less<>> captures;
  BuildDevice device = BuildDevice::Auto;
  // false: evaluate every element of every tile (brute force; for tests and comparisons).
  bool analytic = true;
  // GPU builds only, a tuning knob: the analysis stops subdividing boxes of at most this many
  // tiles and leaves their tiles to the device, which evaluates a tile's elements faster than
  // the host analyses many small boxes. 0: the default (kDefaultGpuLeafTiles).
  int64_t gpu_leaf_tiles = 0;
  static constexpr int64_t kDefaultGpuLeafTiles = 64;
  // The most memory the mask's lists may take (host for a CPU build, device for a GPU build:
  // 17 bytes a tile); a larger mask is refused before anything is allocated. 0: the default.
  uint64_t max_bytes = 0;
  static constexpr uint64_t kDefaultMaxBytes = uint64_t{4} << 30;
};

// How a BlockMask was built.
struct BlockMaskStats {
  std::string device = "none";  // "cpu", "gpu", or "none" (from_kv_blocks)
  bool analytic = false;
  int64_t tiles = 0;            // nb * nh * num_q_tiles * num_kv_tiles
  int64_t decided_tiles = 0;    // decided by interval analysis, no element evaluated
  int64_t boxes = 0;            // interval evaluations the analysis made
  int64_t evaluated_tiles = 0;  // tiles whose elements were evaluated
  double analysis_ms = 0;       // host time of the analysis
  double host_ms = 0;           // host time of the whole call (GPU: until the work is enqueued)
};

class BlockMask {
 public:
  // The eight lists the kernels read, on the host. Rows are (bb * nh + hh) * num_q_tiles
  // + qt, columns (bb * nh + hh) * num_kv_tiles + kt; list entries past a row's count are 0.
  struct Host {
    std::vector<int32_t> kv_num, kv_idx, full_kv_num, full_kv_idx;
    std::vector<int32_t> q_num, q_idx, full_q_num, full_q_idx;
  };

  // From FlexAttention-style kv lists (kv_idx rows of num_kv_tiles entries, each row's first
  // kv_num[row] entries used). nb / nh are 1 for a mask that broadcasts over batch / heads. The
  // full lists may be empty (no full tiles). Throws flexc::Error naming the first bad entry:
  // sizes, counts, indices out of range or not ascending, a tile both partial and full.
  static BlockMask from_kv_blocks(int64_t nb, int64_t nh, int64_t q_len, int64_t kv_len,
                                  int64_t q_tile, int64_t kv_tile, std::span<const int32_t> kv_num,
                                  std::span<const int32_t> kv_idx,
                                  std::span<const int32_t> full_kv_num = {},
                                  std::span<const int32_t> full_kv_idx = {});

  int64_t nb() const;
  int64_t nh() const;
  int64_t q_len() const;
  int64_t kv_len() const;
  // BlockMaskOptions' positions, the sequence lengths resolved (from_kv_blocks: 0, 0, Q_LEN,
  // KV_LEN).
  int64_t q_offset() const;
  int64_t kv_offset() const;
  int64_t seq_q_len() const;
  int64_t seq_kv_len() const;
  int64_t q_tile() const;
  int64_t kv_tile() const;
  int64_t num_q_tiles() const;
  int64_t num_kv_tiles() const;

  // Host copy; a mask built on the GPU is downloaded on first use (waiting for the build).
  const Host& host() const;
  // The tile at (b, h, q tile, kv tile); b and h are taken modulo nb / nh (broadcast).
  TileKind tile(int64_t b, int64_t h, int64_t qt, int64_t kt) const;
  int64_t count(TileKind k) const;
  // Percentage of tiles that are empty (FlexAttention's BlockMask.sparsity()).
  double sparsity() const;
  // A picture, one line per group of q tiles: '█' all full, '░' some work, ' ' all empty. Large
  // masks are downsampled to at most max_rows x max_cols cells; at most max_heads (b, h) shown.
  std::string to_string(int64_t max_rows = 32, int64_t max_cols = 32, int64_t max_heads = 4) const;
  const BlockMaskStats& stats() const;

  struct State;  // defined in src/blockmask/blockmask_impl.h; opaque outside flexc

 private:
  friend struct detail::BlockMaskAccess;
  explicit BlockMask(std::shared_ptr<State> s) : s_(std::move(s)) {}
  std::shared_ptr<State> s_;
};

// Builds the BlockMask of `v`'s mask_mod for B batches and H query heads. With the GPU builder
// the work is enqueued on `stream` (nullptr: the legacy default stream) and the call returns
// without waiting; kernels launched on the same stream see the finished mask.
BlockMask create_block_mask(const Variant& v, int64_t B, int64_t H, int64_t q_len, int64_t kv_len,
                            const BlockMaskOptions& opts = {}, CUstream_st* stream = nullptr);

// The fraction of the (b, h, q, kv) elements that `v`'s mask_mod keeps, as the kernels decide it
// (float32): `bm`'s full tiles count whole and its partial tiles are evaluated element by element
// on the CPU. The density that scales a masked attention's FLOPs. `bm` must be the BlockMask
// create_block_mask(v, B, H, ..., opts) built (the same params, the host copies of the captures).
double mask_density(const Variant& v, const BlockMask& bm, int64_t B, int64_t H,
                    const BlockMaskOptions& opts = {});

}  // namespace flexc
