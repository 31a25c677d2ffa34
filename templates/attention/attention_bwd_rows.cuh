// The backward's per-row kernels, around its main kernel (attention_bwd.cuh,
// attention_bwd_sm90.cuh) on the same stream:
//
//   flexc_attention_bwd_prep  before it, per query row: delta = rowsum(dO * O) - dlse, and the
//                             row of the float32 dQ accumulator zeroed.
//   flexc_attention_bwd_dq    after it (unless deterministic): dQ = scale * accumulator, in the
//                             input dtype.
//
// They read no hook: a unit of their own, without the variant, compiles in a fraction of the
// main kernels' time and once for every variant (the Hopper backward's first call no longer
// waits for the portable main kernel's compile; docs/perf.md).
//
// Compile-time configuration (KernelSpec defines): FLEXC_HEAD_DIM, FLEXC_BF16, FLEXC_F32_OUT.
#include "attention_layout.cuh"
#include "tile_mma.cuh"

namespace flexc_bwd_rows {

using namespace flexc_tile;
using flexc_attn::at;

constexpr int kD = FLEXC_HEAD_DIM;
constexpr bool kBf16 = FLEXC_BF16 != 0;
static_assert(kD % 32 == 0 && kD <= 256, "head dim: a multiple of 32");

}  // namespace flexc_bwd_rows

// delta = rowsum(dO * O) - dlse, one warp per row; zeroes the row's dQ accumulator.
extern "C" __global__ void __launch_bounds__(256)
    flexc_attention_bwd_prep(const FlexcAttentionBwdParams p) {
  using namespace flexc_bwd_rows;
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * 8 + (threadIdx.x >> 5);
  const int h = blockIdx.y, b = blockIdx.z;
  if (row >= p.fwd.q_len) return;
  const auto* o = at<unsigned short>(p.fwd.o, p.fwd.o_stride, b, h) + row * p.fwd.o_stride[2];
  const auto* d = at<unsigned short>(p.dout, p.do_stride, b, h) + row * p.do_stride[2];
  float sum = 0.f;
  for (int c = lane * 2; c < kD; c += 64) {
    const unsigned ov = *reinterpret_cast<const unsigned*>(o + c);
    const unsigned dv = *reinterpret_cast<const unsigned*>(d + c);
    sum +=
        unpack_lo<kBf16>(ov) * unpack_lo<kBf16>(dv) + unpack_hi<kBf16>(ov) * unpack_hi<kBf16>(dv);
  }
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, m);
  const long long r = (static_cast<long long>(b) * p.fwd.q_heads + h) * p.fwd.q_len + row;
  if (lane == 0) p.delta[r] = p.dlse ? sum - p.dlse[r] : sum;
  if (p.dq_accum != nullptr) {
    float* acc = p.dq_accum + flexc_attn::DqAccum<kD>::block(p.fwd, b, h, row);
    for (int c = lane; c < kD; c += 32) acc[flexc_attn::DqAccum<kD>::offset(row % 64, c)] = 0.f;
  }
}

// dQ = scale * accumulator, in the input type (float32 in a FLEXC_F32_OUT build, added into dq
// with kAddOut): one thread per 8 elements.
extern "C" __global__ void __launch_bounds__(256)
    flexc_attention_bwd_dq(const FlexcAttentionBwdParams p) {
  using namespace flexc_bwd_rows;
  constexpr int kChunks = kD / 8;
  const long long i = static_cast<long long>(blockIdx.x) * 256 + threadIdx.x;
  const int h = blockIdx.y, b = blockIdx.z;
  const int row = static_cast<int>(i / kChunks), ch = static_cast<int>(i % kChunks);
  if (row >= p.fwd.q_len) return;
  // Each pair of columns is one float2 of the accumulator's layout (attention_layout.cuh).
  const float* acc = p.dq_accum + flexc_attn::DqAccum<kD>::block(p.fwd, b, h, row);
  float v[8];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 a = *reinterpret_cast<const float2*>(
        acc + flexc_attn::DqAccum<kD>::offset(row % 64, ch * 8 + 2 * k));
    v[2 * k] = a.x * p.fwd.scale, v[2 * k + 1] = a.y * p.fwd.scale;
  }
  void* dq = static_cast<char*>(flexc_attn::head_rows(p.dq, p.dq_stride, b, h)) +
             (row * p.dq_stride[2] + ch * 8) * (flexc_attn::kF32Out ? 4 : 2);
  if constexpr (flexc_attn::kF32Out) {
#pragma unroll
    for (int k = 0; k < 4; ++k)
      flexc_attn::put_f32x2(static_cast<float*>(dq) + 2 * k, v[2 * k], v[2 * k + 1]);
  } else {
    *static_cast<uint4*>(dq) = make_uint4(pack2<kBf16>(v[0], v[1]), pack2<kBf16>(v[2], v[3]),
                                          pack2<kBf16>(v[4], v[5]), pack2<kBf16>(v[6], v[7]));
  }
}
