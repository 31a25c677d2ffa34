// The BlockMask on the device: the GPU builder (templates/blockmask/blockmask.cuh) and the upload /
// download of the lists. One allocation holds the eight arrays of FlexcBlockMask and, for a GPU
// build, the tile-verdict grid and the uploaded work (boxes and captures).
#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "attention/attention_args.h"
#include "blockmask/blockmask_impl.h"
#include "flexc/device.h"
#include "flexc/error.h"
#include "jit/abi.h"
#include "jit/driver_api.h"
#include "jit/jit.h"

namespace flexc::detail {

// Byte offsets of the arrays in the allocation, in FlexcBlockMask's order.
struct ListLayout {
  size_t kv_num, kv_idx, full_kv_num, full_kv_idx, q_num, q_idx, full_q_num, full_q_idx, end;
};

struct DeviceMask {
  flexc::DeviceBuffer buf;
  ListLayout at{};
  CUstream_st* stream = nullptr;  // the stream that wrote it
  CUevent_st* written = nullptr;  // recorded on `stream` after the last write

  DeviceMask() = default;
  DeviceMask(const DeviceMask&) = delete;
  DeviceMask& operator=(const DeviceMask&) = delete;
  ~DeviceMask() {
    // The driver is loaded whenever an event exists; nothing useful to do with an error here.
    if (written) try {
        jit::driver("destroying a CUDA event").cuEventDestroy(written);
      } catch (...) {
      }
  }
};

namespace {

constexpr size_t kAlign = 16;
// Launch shapes; they must match the constants of templates/blockmask/blockmask.cuh.
constexpr unsigned kPaintThreads = 256, kPaintPerThread = 16, kClassifyThreads = 256,
                   kListThreads = 32 * 32;
size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

ListLayout list_layout(int64_t groups, int64_t nqt, int64_t nkt) {
  const size_t rows = groups * nqt, cols = groups * nkt, i = sizeof(int32_t);
  ListLayout l{};
  size_t o = 0;
  auto take = [&](size_t bytes) {
    const size_t at = o;
    o = align_up(o + bytes);
    return at;
  };
  l.kv_num = take(rows * i);
  l.kv_idx = take(rows * nkt * i);
  l.full_kv_num = take(rows * i);
  l.full_kv_idx = take(rows * nkt * i);
  l.q_num = take(cols * i);
  l.q_idx = take(cols * nqt * i);
  l.full_q_num = take(cols * i);
  l.full_q_idx = take(cols * nqt * i);
  l.end = o;
  return l;
}

// The kernels that do not depend on the variant are compiled once, with this one.
const Variant& generic_variant() {
  static const Variant v = Variant::from_strings("score", "true", {}, {}, "blockmask");
  return v;
}

const jit::Kernel& kernel(const Variant& v, const char* entry) {
  return jit::get_kernel(v, jit::KernelSpec{"blockmask.cuh", entry, {}, ""});
}

// Appends `bytes` to the staged upload, aligned; returns their offset in it.
size_t stage(std::vector<std::byte>& work, const void* src, size_t bytes) {
  const size_t at = align_up(work.size());
  work.resize(at + bytes);
  if (bytes) std::memcpy(work.data() + at, src, bytes);
  return at;
}

void stage_boxes(std::vector<std::byte>& work, const std::vector<TileBox>& boxes, size_t& boxes_at,
                 size_t& prefix_at) {
  std::vector<int64_t> prefix(boxes.size() + 1, 0);
  for (size_t i = 0; i < boxes.size(); ++i) prefix[i + 1] = prefix[i] + boxes[i].area();
  static_assert(sizeof(TileBox) == 8 * sizeof(int32_t));
  boxes_at = stage(work, boxes.data(), boxes.size() * sizeof(TileBox));
  prefix_at = stage(work, prefix.data(), prefix.size() * sizeof(int64_t));
}

void launch(const jit::Kernel& k, int64_t blocks, unsigned threads, CUstream_st* stream,
            std::initializer_list<void*> args) {
  std::vector<void*> a(args);
  k.launch(unsigned(blocks), 1, 1, threads, 0, stream, a.data());
}

// Blocks for a grid-stride kernel over `n` work items of `per_block` each.
int64_t stride_blocks(int64_t n, int64_t per_block) {
  return std::min((n + per_block - 1) / per_block, int64_t(1) << 20);
}

// Marks the end of the writes enqueued on m.stream, for readers on other streams.
void record_written(DeviceMask& m, std::string_view doing) {
  const jit::DriverApi& d = jit::driver(doing);
  jit::check(d.cuEventCreate(&m.written, CU_EVENT_DISABLE_TIMING), doing);
  jit::check(d.cuEventRecord(m.written, m.stream), doing);
}

}  // namespace

void wait_written(const DeviceMask& m, CUstream_st* stream) {
  if (stream == m.stream || !m.written) return;
  const std::string doing = "ordering a BlockMask's use after its build";
  jit::check(jit::driver(doing).cuStreamWaitEvent(stream, m.written, 0), doing);
}

std::shared_ptr<DeviceMask> build_on_gpu(const MaskProblem& p, const Analysis& a,
                                         CUstream_st* stream) {
  const std::string doing =
      fmt::format("building the BlockMask of '{}' on the GPU", p.variant_name);
  const jit::DriverApi& drv = jit::driver(doing);
  // Compile (or find) every kernel before enqueueing anything.
  const jit::Kernel& paint = kernel(generic_variant(), "flexc_blockmask_paint");
  const jit::Kernel& lists = kernel(generic_variant(), "flexc_blockmask_lists");
  const jit::Kernel* classify =
      a.undecided.empty() ? nullptr : &kernel(*p.variant, "flexc_blockmask_classify");

  // Staged upload: the boxes, their running tile counts, and the captures classify reads.
  std::vector<std::byte> work;
  size_t full_at = 0, full_prefix_at = 0, und_at = 0, und_prefix_at = 0;
  stage_boxes(work, a.full, full_at, full_prefix_at);
  stage_boxes(work, a.undecided, und_at, und_prefix_at);
  // The captures classify reads: the user's device copies, or the host copies staged for upload
  // (same strides; their data pointers are set once the buffer exists).
  std::vector<TensorView> staged(p.captures.size());
  std::vector<const TensorView*> device(p.captures.size(), nullptr);
  std::vector<std::pair<uint16_t, size_t>> staged_at;  // slot, offset in work
  if (classify)
    for (uint16_t slot : p.read_captures) {
      if (slot >= FLEXC_MAX_CAPTURES)
        throw Error(fmt::format("{}: capture slot {} exceeds FLEXC_MAX_CAPTURES", doing, slot));
      staged[slot] = p.device_captures[slot];
      device[slot] = &staged[slot];
      if (staged[slot].data) continue;
      const TensorView& t = staged[slot];
      int64_t extent = 1;  // elements the strided tensor spans
      for (size_t d = 0; d < t.rank(); ++d) extent += (t.shape[d] - 1) * t.stride(d);
      staged_at.emplace_back(slot,
                             stage(work, p.captures[slot].data, extent * dtype_size(t.dtype)));
    }

  auto m = std::make_shared<DeviceMask>();
  m->at = list_layout(p.groups(), p.nqt, p.nkt);
  m->stream = stream;
  const size_t grid_at = m->at.end, work_at = align_up(grid_at + p.tiles());
  m->buf = flexc::DeviceBuffer(work_at + work.size());
  const flexc::DevicePtr base = m->buf.ptr();
  for (auto [slot, off] : staged_at)
    staged[slot].data = reinterpret_cast<void*>(base + work_at + off);
  FlexcArgs args = kernel_args(impl_of(*p.variant), p.params, device);

  jit::check(drv.cuMemsetD8Async(base + grid_at, 0, p.tiles(), stream), doing);
  m->buf.upload(work.data(), work.size(), work_at, stream);

  flexc::DevicePtr grid = base + grid_at;
  flexc::DevicePtr full_boxes = base + work_at + full_at,
                   full_prefix = base + work_at + full_prefix_at;
  flexc::DevicePtr und_boxes = base + work_at + und_at, und_prefix = base + work_at + und_prefix_at;
  int nh = int(p.nh), nqt = int(p.nqt), nkt = int(p.nkt), groups = int(p.groups());
  int n_full = int(a.full.size()), n_und = int(a.undecided.size());
  int64_t full_tiles = 0, und_tiles = 0;
  for (const auto& x : a.full) full_tiles += x.area();
  for (const auto& x : a.undecided) und_tiles += x.area();
  if (full_tiles > 0)
    launch(paint, stride_blocks(full_tiles, kPaintThreads * kPaintPerThread), kPaintThreads, stream,
           {&grid, &full_boxes, &full_prefix, &n_full, &full_tiles, &nh, &nqt, &nkt});
  if (classify) {
    int q_tile = int(p.q_tile), kv_tile = int(p.kv_tile), q_len = int(p.q_len),
        kv_len = int(p.kv_len), q_offset = int(p.pos.q_offset), kv_offset = int(p.pos.kv_offset),
        seq_q_len = int(p.pos.seq_q_len), seq_kv_len = int(p.pos.seq_kv_len);
    launch(*classify, stride_blocks(und_tiles, 1), kClassifyThreads, stream,
           {&args, &grid, &und_boxes, &und_prefix, &n_und, &und_tiles, &nh, &nqt, &nkt, &q_tile,
            &kv_tile, &q_len, &kv_len, &q_offset, &kv_offset, &seq_q_len, &seq_kv_len});
  }
  int row_blocks = int((p.groups() * p.nqt + 31) / 32);
  const int64_t col_blocks = p.groups() * ((p.nkt + 31) / 32);
  flexc::DevicePtr ptrs[8];
  const size_t offs[8] = {m->at.kv_num, m->at.kv_idx, m->at.full_kv_num, m->at.full_kv_idx,
                          m->at.q_num,  m->at.q_idx,  m->at.full_q_num,  m->at.full_q_idx};
  for (int i = 0; i < 8; ++i) ptrs[i] = base + offs[i];
  launch(lists, row_blocks + col_blocks, kListThreads, stream,
         {&grid, &groups, &nqt, &nkt, &row_blocks, &ptrs[0], &ptrs[1], &ptrs[2], &ptrs[3], &ptrs[4],
          &ptrs[5], &ptrs[6], &ptrs[7]});
  record_written(*m, doing);
  return m;
}

std::shared_ptr<DeviceMask> upload_mask(const BlockMask::Host& h, int64_t groups, int64_t nqt,
                                        int64_t nkt, CUstream_st* stream) {
  auto m = std::make_shared<DeviceMask>();
  m->at = list_layout(groups, nqt, nkt);
  m->stream = stream;
  m->buf = flexc::DeviceBuffer(m->at.end);
  auto put = [&](const std::vector<int32_t>& v, size_t off) {
    m->buf.upload(v.data(), v.size() * sizeof(int32_t), off, stream);
  };
  put(h.kv_num, m->at.kv_num);
  put(h.kv_idx, m->at.kv_idx);
  put(h.full_kv_num, m->at.full_kv_num);
  put(h.full_kv_idx, m->at.full_kv_idx);
  put(h.q_num, m->at.q_num);
  put(h.q_idx, m->at.q_idx);
  put(h.full_q_num, m->at.full_q_num);
  put(h.full_q_idx, m->at.full_q_idx);
  record_written(*m, "uploading a BlockMask");
  return m;
}

BlockMask::Host download_mask(const DeviceMask& d, int64_t groups, int64_t nqt, int64_t nkt) {
  const std::string doing = "downloading a BlockMask";
  jit::check(jit::driver(doing).cuStreamSynchronize(d.stream), doing);
  BlockMask::Host h;
  // The device leaves list entries past a row's count unwritten; the host copy has zeros there.
  auto get = [&](std::vector<int32_t>& num, std::vector<int32_t>& idx, size_t num_at, size_t idx_at,
                 int64_t n, int64_t len) {
    num.resize(n);
    idx.resize(n * len);
    d.buf.download(num.data(), n * sizeof(int32_t), num_at);
    d.buf.download(idx.data(), n * len * sizeof(int32_t), idx_at);
    for (int64_t r = 0; r < n; ++r)
      std::fill(idx.begin() + r * len + num[r], idx.begin() + (r + 1) * len, 0);
  };
  get(h.kv_num, h.kv_idx, d.at.kv_num, d.at.kv_idx, groups * nqt, nkt);
  get(h.full_kv_num, h.full_kv_idx, d.at.full_kv_num, d.at.full_kv_idx, groups * nqt, nkt);
  get(h.q_num, h.q_idx, d.at.q_num, d.at.q_idx, groups * nkt, nqt);
  get(h.full_q_num, h.full_q_idx, d.at.full_q_num, d.at.full_q_idx, groups * nkt, nqt);
  return h;
}

void fill_view(const DeviceMask& d, FlexcBlockMask& v) {
  auto at = [&](size_t off) { return reinterpret_cast<const int*>(d.buf.ptr() + off); };
  v.kv_num = at(d.at.kv_num);
  v.kv_idx = at(d.at.kv_idx);
  v.full_kv_num = at(d.at.full_kv_num);
  v.full_kv_idx = at(d.at.full_kv_idx);
  v.q_num = at(d.at.q_num);
  v.q_idx = at(d.at.q_idx);
  v.full_q_num = at(d.at.full_q_num);
  v.full_q_idx = at(d.at.full_q_idx);
}

}  // namespace flexc::detail
