// Argument checks and device facts shared by the attention entry points (forward in
// src/attention/attention.cpp, backward in src/attention/attention_backward.cpp). Each check throws
// flexc::Error
// "<what>: <message>", `what` naming the call ("flexc::attention").
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "attention/attention_args.h"
#include "flexc/attention.h"
#include "flexc/blockmask.h"
#include "flexc/tensor.h"

namespace flexc::detail {

// The current context's device, queried once per device.
struct DeviceLimits {
  int major = 0, minor = 0;
  size_t max_smem = 0;  // opt-in maximum per block
  int sms = 0;          // streaming multiprocessors
};
DeviceLimits device_limits();

// Whether a call runs its Hopper kernel: forced (an error, prefixed `what`, on a GPU other than
// compute capability 9.0), or by Auto on such a GPU when `misfit` (why the Hopper kernel cannot
// take the call) is empty.
bool use_hopper(FwdKernel choice, const DeviceLimits& dev, std::string_view misfit,
                std::string_view what);

// q / k / v / out and their gradients: rank 4, bf16 or fp16 equal to `dtype` (q's), or float32
// with `or_f32`; data set, contiguous head dim, 16-byte aligned rows.
void check_qkv(std::string_view what, const char* name, const TensorView& t, DType dtype,
               bool or_f32 = false);

// The sizes every attention kernel's grid and int32 indices allow: B, Hq, Hkv >= 1, Hq a multiple
// of Hkv, B and Hq at most 65535 (grid dims), Q_LEN and KV_LEN below 2^31 - 256.
void check_sizes(std::string_view what, int64_t B, int64_t Hq, int64_t Hkv, int64_t q_len,
                 int64_t kv_len);

// A float32 [B, Hq, Q_LEN] contiguous row vector (lse, dlse), 4-byte aligned.
void check_rows(std::string_view what, const char* name, const TensorView& t, int64_t B, int64_t Hq,
                int64_t q_len);

// A contiguous int32 device vector of `n` elements (`dims` names n in the message: "B").
void check_int_vector(std::string_view what, const char* name, const TensorView& t, int64_t n,
                      std::string_view dims = "B");
// The first `elements` int32 values at t.data, copied to the host on `stream` (synchronized):
// the options that check device arguments.
std::vector<int32_t> int32_to_host(std::string_view what, const TensorView& t, int64_t elements,
                                   CUstream_st* stream);

// No elements (tested per dim: numel() can overflow on shapes not yet bounded).
bool is_empty(const TensorView& t);
// Whether the byte ranges of two views intersect.
bool overlap(const TensorView& a, const TensorView& b);
// Whether two elements of `t` share memory: with the dims of size > 1 ordered by stride, each
// stride must step past everything the smaller ones span (a sufficient test; it admits every
// permutation of a packed layout and rejects stride 0 broadcasts).
bool self_overlaps(const TensorView& t);

// Stream-ordered device memory (workspace): from the caller's allocator when given, else from
// flexc's pool and freed on the same stream after the kernels that use it (allowed inside CUDA
// graph capture). `what` names the call in errors.
class StreamBuffer {
 public:
  StreamBuffer(size_t bytes, CUstream_st* stream, const WorkspaceAllocator& alloc,
               std::string_view what);
  ~StreamBuffer();
  StreamBuffer(const StreamBuffer&) = delete;
  StreamBuffer& operator=(const StreamBuffer&) = delete;
  void* get() const { return reinterpret_cast<void*>(ptr_); }

 private:
  unsigned long long ptr_ = 0;
  CUstream_st* stream_;
  bool owned_ = true;
};

// What a StreamBuffer without `alloc` takes its memory from (flexc's pool), made ahead: the
// prepare_* calls do it, so that a call captured into a CUDA graph creates no pool.
void prepare_workspace(const WorkspaceAllocator& alloc);

// Whether the BlockMask's tiles split into a kernel's block_m x block_n tiles.
bool tiles_fit(const BlockMask& bm, int block_m, int block_n);
// The BlockMask matches the call (lengths, positions; nb / nh 1 or B / Hq) and its tiles split
// into the kernel's.
void check_block_mask(std::string_view what, const BlockMask& bm, int64_t B, int64_t Hq,
                      int64_t q_len, int64_t kv_len, const Positions& pos, int block_m,
                      int block_n);

}  // namespace flexc::detail
