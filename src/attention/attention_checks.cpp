#include "attention/attention_checks.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "flexc/error.h"
#include "jit/driver_api.h"

namespace flexc::detail {

DeviceLimits device_limits() {
  const jit::DriverApi& d = jit::driver("querying the GPU for flexc::attention");
  jit::current_context();
  CUdevice dev = 0;
  jit::check(d.cuCtxGetDevice(&dev), "querying the current context's device");
  static std::mutex mu;
  static std::unordered_map<int, DeviceLimits> known;
  std::lock_guard lk(mu);
  auto it = known.find(static_cast<int>(dev));
  if (it != known.end()) return it->second;
  DeviceLimits l;
  int smem = 0;
  jit::check(d.cuDeviceGetAttribute(&l.major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev),
             "querying the GPU's compute capability");
  jit::check(d.cuDeviceGetAttribute(&l.minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev),
             "querying the GPU's compute capability");
  jit::check(
      d.cuDeviceGetAttribute(&smem, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev),
      "querying the GPU's shared memory per block");
  l.max_smem = static_cast<size_t>(smem);
  jit::check(d.cuDeviceGetAttribute(&l.sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev),
             "querying the GPU's multiprocessor count");
  return known.emplace(static_cast<int>(dev), l).first->second;
}

namespace {

// flexc's own stream-ordered pool on the current device: it keeps freed workspace for reuse
// (release threshold: never), where the default pool may hand memory back to the driver at each
// synchronization and map it again on the next call (tens of microseconds, which a decode step
// cannot afford). The memory stays with flexc until the process ends.
CUmemoryPool workspace_pool(const jit::DriverApi& d) {
  CUdevice dev = 0;
  jit::check(d.cuCtxGetDevice(&dev), "querying the current context's device");
  static std::mutex mu;
  static std::unordered_map<int, CUmemoryPool> pools;
  std::lock_guard lk(mu);
  CUmemoryPool& pool = pools[static_cast<int>(dev)];
  if (pool == nullptr) {
    CUmemPoolProps props{};
    props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    props.location.id = static_cast<int>(dev);
    jit::check(d.cuMemPoolCreate(&pool, &props), "creating flexc's workspace pool");
    cuuint64_t keep = ~cuuint64_t{0};
    jit::check(d.cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &keep),
               "setting flexc's workspace pool to keep its memory");
  }
  return pool;
}

}  // namespace

StreamBuffer::StreamBuffer(size_t bytes, CUstream stream, const WorkspaceAllocator& alloc,
                           std::string_view what)
    : stream_(stream), owned_(!alloc) {
  if (alloc) {
    void* p = alloc(bytes);
    if (p == nullptr || reinterpret_cast<uintptr_t>(p) % 256 != 0)
      throw Error(
          fmt::format("{}: the workspace allocator returned {} for {} bytes; flexc needs "
                      "device memory aligned to 256 bytes",
                      what, p, bytes));
    ptr_ = reinterpret_cast<uintptr_t>(p);
    return;
  }
  const jit::DriverApi& d = jit::driver(fmt::format("allocating {}'s workspace", what));
  jit::current_context();
  CUdeviceptr ptr = 0;
  jit::check(d.cuMemAllocFromPoolAsync(&ptr, bytes ? bytes : 1, workspace_pool(d), stream),
             fmt::format("allocating {} bytes of workspace for {}", bytes, what));
  ptr_ = ptr;
}

void prepare_workspace(const WorkspaceAllocator& alloc) {
  if (alloc) return;
  const jit::DriverApi& d = jit::driver("preparing flexc's workspace pool");
  jit::current_context();
  workspace_pool(d);
}

StreamBuffer::~StreamBuffer() {
  if (owned_) jit::driver("freeing workspace").cuMemFreeAsync(ptr_, stream_);
}

bool use_hopper(FwdKernel choice, const DeviceLimits& dev, std::string_view misfit,
                std::string_view what) {
  const bool sm90 = dev.major == 9 && dev.minor == 0;
  if (choice == FwdKernel::Hopper && !sm90)
    throw Error(fmt::format(
        "{}: the Hopper kernel needs a GPU of compute capability 9.0; this one is {}.{}", what,
        dev.major, dev.minor));
  return choice == FwdKernel::Hopper || (choice == FwdKernel::Auto && sm90 && misfit.empty());
}

namespace {

// [first, last] byte range a view spans.
std::pair<uintptr_t, uintptr_t> span_of(const TensorView& t) {
  uintptr_t lo = reinterpret_cast<uintptr_t>(t.data), hi = lo;
  for (size_t i = 0; i < t.rank(); ++i) hi += (t.shape[i] - 1) * t.stride(i) * dtype_size(t.dtype);
  return {lo, hi + dtype_size(t.dtype) - 1};
}

}  // namespace

void check_qkv(std::string_view what, const char* name, const TensorView& t, DType dtype,
               bool or_f32) {
  const auto fail = [&](const std::string& msg) { throw Error(fmt::format("{}: {}", what, msg)); };
  if (t.rank() != 4)
    fail(fmt::format("{} must be [B, H, SEQ, D]; got rank {} ({})", name, t.rank(), t.describe()));
  const bool f32 = or_f32 && t.dtype == DType::F32;
  if (t.dtype != DType::BF16 && t.dtype != DType::F16 && !f32)
    fail(fmt::format("{} is {}; bf16 or fp16{} expected", name, dtype_name(t.dtype),
                     or_f32 ? " (q's dtype) or float32" : ""));
  if (t.dtype != dtype && !f32)
    fail(fmt::format("{} is {} but q is {}; {}", name, dtype_name(t.dtype), dtype_name(dtype),
                     or_f32 ? "q's dtype or float32 expected" : "all four must have one dtype"));
  if (t.data == nullptr) fail(fmt::format("{} has no data", name));
  if (!t.strides.empty() && t.strides.size() != 4)
    fail(fmt::format("{}: {} strides for rank 4", name, t.strides.size()));
  for (size_t i = 0; i < 4; ++i)
    if (t.shape[i] < 0 || t.stride(i) < 0)
      fail(fmt::format("{}: negative size or stride ({})", name, t.describe()));
  if (t.stride(3) != 1)
    fail(fmt::format("{}: the head dim must be contiguous (stride 1); {}", name, t.describe()));
  for (size_t i = 0; i < 3; ++i)
    if (t.stride(i) % 8 != 0)
      fail(fmt::format("{}: strides must be multiples of 8 elements (16-byte aligned rows); {}",
                       name, t.describe()));
  if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0)
    fail(fmt::format("{}: data must be 16-byte aligned", name));
}

void check_sizes(std::string_view what, int64_t B, int64_t Hq, int64_t Hkv, int64_t q_len,
                 int64_t kv_len) {
  if (B < 1 || Hq < 1 || Hkv < 1 || Hq % Hkv != 0)
    throw Error(fmt::format("{}: need B, Hq, Hkv >= 1 and Hq % Hkv == 0; got B {}, Hq {}, Hkv {}",
                            what, B, Hq, Hkv));
  if (B > 65535 || Hq > 65535)
    throw Error(fmt::format("{}: B = {} and Hq = {} must be at most 65535", what, B, Hq));
  constexpr int64_t kMaxLen = std::numeric_limits<int32_t>::max() - 256;
  if (q_len > kMaxLen || kv_len > kMaxLen)
    throw Error(fmt::format("{}: q_len {} / kv_len {} exceed the int32 indices of the kernel", what,
                            q_len, kv_len));
}

void check_rows(std::string_view what, const char* name, const TensorView& t, int64_t B, int64_t Hq,
                int64_t q_len) {
  if (t.dtype != DType::F32 || t.shape != std::vector<int64_t>{B, Hq, q_len} ||
      (!t.strides.empty() && t.strides != std::vector<int64_t>{Hq * q_len, q_len, 1}) ||
      t.data == nullptr || reinterpret_cast<uintptr_t>(t.data) % 4 != 0)
    throw Error(
        fmt::format("{}: {} must be contiguous float32 [B, Hq, Q_LEN] = [{}, {}, {}]; got {}", what,
                    name, B, Hq, q_len, t.describe()));
}

void check_int_vector(std::string_view what, const char* name, const TensorView& t, int64_t n,
                      std::string_view dims) {
  if (t.dtype != DType::I32 || t.shape != std::vector<int64_t>{n} ||
      (!t.strides.empty() && t.strides[0] != 1 && n > 1) || t.data == nullptr ||
      reinterpret_cast<uintptr_t>(t.data) % 4 != 0)
    throw Error(fmt::format("{}: {} must be contiguous int32 [{}] = [{}] on the device; got {}",
                            what, name, dims, n, t.describe()));
}

std::vector<int32_t> int32_to_host(std::string_view what, const TensorView& t, int64_t elements,
                                   CUstream_st* stream) {
  std::vector<int32_t> out(static_cast<size_t>(elements));
  const jit::DriverApi& d = jit::driver(fmt::format("reading {}'s device arguments", what));
  jit::check(d.cuMemcpyDtoHAsync(out.data(), reinterpret_cast<CUdeviceptr>(t.data),
                                 out.size() * sizeof(int32_t), stream),
             fmt::format("copying {} to the host", t.describe()));
  jit::check(d.cuStreamSynchronize(stream), fmt::format("waiting for {}'s device arguments", what));
  return out;
}

bool is_empty(const TensorView& t) {
  return std::find(t.shape.begin(), t.shape.end(), 0) != t.shape.end();
}

bool overlap(const TensorView& a, const TensorView& b) {
  if (is_empty(a) || is_empty(b)) return false;
  const auto [alo, ahi] = span_of(a);
  const auto [blo, bhi] = span_of(b);
  return alo <= bhi && blo <= ahi;
}

bool self_overlaps(const TensorView& t) {
  if (is_empty(t)) return false;
  std::vector<std::pair<int64_t, int64_t>> dims;  // stride, size
  for (size_t i = 0; i < t.rank(); ++i)
    if (t.shape[i] > 1) dims.emplace_back(t.stride(i), t.shape[i]);
  std::sort(dims.begin(), dims.end());
  int64_t reach = 0;  // elements spanned by the dims so far, minus one
  for (auto [stride, size] : dims) {
    if (stride <= reach) return true;
    reach += (size - 1) * stride;
  }
  return false;
}

bool tiles_fit(const BlockMask& bm, int block_m, int block_n) {
  return bm.q_tile() % block_m == 0 && bm.kv_tile() % block_n == 0;
}

void check_block_mask(std::string_view what, const BlockMask& bm, int64_t B, int64_t Hq,
                      int64_t q_len, int64_t kv_len, const Positions& pos, int block_m,
                      int block_n) {
  const auto fail = [&](const std::string& msg) { throw Error(fmt::format("{}: {}", what, msg)); };
  if (bm.q_len() != q_len || bm.kv_len() != kv_len)
    fail(fmt::format("block_mask was built for q_len {}, kv_len {}; the call has {}, {}",
                     bm.q_len(), bm.kv_len(), q_len, kv_len));
  const std::pair<const char*, std::pair<int64_t, int64_t>> fields[] = {
      {"q_offset", {bm.q_offset(), pos.q_offset}},
      {"kv_offset", {bm.kv_offset(), pos.kv_offset}},
      {"seq_q_len", {bm.seq_q_len(), pos.seq_q_len}},
      {"seq_kv_len", {bm.seq_kv_len(), pos.seq_kv_len}}};
  for (const auto& [name, v] : fields)
    if (v.first != v.second)
      fail(
          fmt::format("block_mask was built with {} {}; the call has {}", name, v.first, v.second));
  if (bm.nb() != 1 && bm.nb() != B)
    fail(fmt::format("block_mask has {} batches; the call has B = {} (1 broadcasts)", bm.nb(), B));
  if (bm.nh() != 1 && bm.nh() != Hq)
    fail(fmt::format("block_mask has {} heads; the call has {} query heads (1 broadcasts)", bm.nh(),
                     Hq));
  if (!tiles_fit(bm, block_m, block_n))
    fail(fmt::format("block_mask tiles {} x {} must be multiples of the kernel's {} x {}",
                     bm.q_tile(), bm.kv_tile(), block_m, block_n));
}

}  // namespace flexc::detail
