// The combine of partial attention results: rows whose keys were split into parts (the decode
// kernel's kv splits; ring attention's blocks), each part's output normalised over its own keys
// with that part's LSE, merged into the softmax over all keys:
//   lse = log sum_p exp(lse_p),  out = sum_p exp(lse_p - lse) out_p.
// A part that saw no key (LSE -inf) weighs 0; a row whose parts all saw none gets out 0 and LSE
// -inf, never NaN. A NaN LSE (a part that flagged a bad argument) makes the row NaN.
//
// One warp per row; lanes take 4 columns at a time. FLEXC_BF16 picks the output type.
// flexc_attention_combine merges all parts of a row at once (decode: float32 parts);
// Ring attention's blocks merge themselves into float32 accumulators (the forward kernels'
// FLEXC_F32_OUT 2 build); flexc_attention_merge_store writes them out. The ring's backward adds a
// float32 gradient part into its accumulators with flexc_grad_accumulate.
#pragma once

#include "attention_params.cuh"
#include "tile_mma.cuh"

namespace flexc_combine {

constexpr int kWarps = 4;

__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

// Weights of a row's parts: w_p = exp(lse_p - max) (natural-log units), their sum and the row's
// LSE. Part p's weight is taken by each lane on its own, so parts may be any number.
struct RowWeights {
  float max = neg_inf(), sum = 0.f, lse = neg_inf();
  bool nan = false;

  __device__ __forceinline__ RowWeights(const float* lse_part, int parts) {
    const int lane = threadIdx.x & 31;
    for (int p = lane; p < parts; p += 32) {
      const float l = lse_part[p];
      nan |= l != l;
      max = fmaxf(max, l);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) max = fmaxf(max, __shfl_xor_sync(0xffffffffu, max, o));
    nan = __any_sync(0xffffffffu, nan);
    for (int p = lane; p < parts; p += 32) sum += weight(lse_part[p]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (nan) {
      lse = __int_as_float(0x7fffffff);
    } else if (max != neg_inf()) {
      lse = max + logf(sum);
    }
  }
  // Part weight, 0 for a part without keys (exp(-inf) = 0; the max is finite when any part has
  // keys, so no -inf - -inf).
  __device__ __forceinline__ float weight(float lse_p) const {
    return max == neg_inf() ? 0.f : __expf(lse_p - max);
  }
};

}  // namespace flexc_combine

extern "C" __global__ void __launch_bounds__(flexc_combine::kWarps * 32)
    flexc_attention_combine(const FlexcCombineParams p) {
  using namespace flexc_combine;
  flexc_tile::wait_primary();  // the parts' kernel may still run (launched early)
  const int row = blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (row >= p.rows) return;
  const int lane = threadIdx.x & 31;
  const float* lse_part = p.lse_part + static_cast<long long>(row) * p.parts;
  const float* o_part = p.o_part + static_cast<long long>(row) * p.parts * p.dv;
  const RowWeights w(lse_part, p.parts);
  const float inv = w.nan ? w.lse : w.sum > 0.f ? 1.f / w.sum : 0.f;  // NaN rows stay NaN
  const int b = row / (p.heads * p.q_len), h = row / p.q_len % p.heads, i = row % p.q_len;
  auto* out = static_cast<unsigned short*>(p.out) + b * p.out_stride[0] + h * p.out_stride[1] +
              i * p.out_stride[2];
  for (int c = lane * 4; c < p.dv; c += 128) {
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    // Unrolled without a branch, so that 8 parts' loads are in flight at once (one at a time,
    // 32 parts took ~10 us of L2 latency). A part of weight 0 adds exactly 0, whatever its
    // output holds.
#pragma unroll 8
    for (int part = 0; part < p.parts; ++part) {
      const float wp = w.weight(lse_part[part]);
      const float4 o = *reinterpret_cast<const float4*>(o_part + part * p.dv + c);
      acc[0] += wp == 0.f ? 0.f : wp * o.x;
      acc[1] += wp == 0.f ? 0.f : wp * o.y;
      acc[2] += wp == 0.f ? 0.f : wp * o.z;
      acc[3] += wp == 0.f ? 0.f : wp * o.w;
    }
    uint2 packed;
    packed.x = flexc_tile::pack2<FLEXC_BF16 != 0>(acc[0] * inv, acc[1] * inv);
    packed.y = flexc_tile::pack2<FLEXC_BF16 != 0>(acc[2] * inv, acc[3] * inv);
    *reinterpret_cast<uint2*>(out + c) = packed;
  }
  if (p.lse != nullptr && lane == 0) p.lse[row] = w.lse;
}

namespace flexc_combine {

// The row this warp takes (one warp per row) of [batch, heads, rows] rows, as (b, h, i).
struct WarpRow {
  long long row;
  int b, h, i;
  bool valid;
  __device__ __forceinline__ WarpRow(int batch, int heads, int rows)
      : row(static_cast<long long>(blockIdx.x) * kWarps + (threadIdx.x >> 5)) {
    valid = row < static_cast<long long>(batch) * heads * rows;
    b = int(row / (static_cast<long long>(heads) * rows)), h = int(row / rows % heads);
    i = int(row % rows);
  }
  // Its row of a [batch, heads, rows, d] tensor with strides (batch, head, row).
  template <class T>
  __device__ __forceinline__ T* of(T* base, const long long (&stride)[3]) const {
    return base + b * stride[0] + h * stride[1] + i * stride[2];
  }
};

}  // namespace flexc_combine

extern "C" __global__ void __launch_bounds__(flexc_combine::kWarps * 32)
    flexc_attention_merge_store(const FlexcMergeParams p) {
  using namespace flexc_combine;
  const WarpRow at(p.batch, p.heads, p.acc_rows);
  if (!at.valid) return;
  const int lane = threadIdx.x & 31;
  const float* acc = p.acc + at.row * p.dv;
  auto* out = at.of(static_cast<unsigned short*>(p.out), p.out_stride);
  for (int c = lane * 4; c < p.dv; c += 128) {
    const float4 x = *reinterpret_cast<const float4*>(acc + c);
    uint2 packed;
    packed.x = flexc_tile::pack2<FLEXC_BF16 != 0>(x.x, x.y);
    packed.y = flexc_tile::pack2<FLEXC_BF16 != 0>(x.z, x.w);
    *reinterpret_cast<uint2*>(out + c) = packed;
  }
  if (p.lse != nullptr && lane == 0)
    p.lse[(static_cast<long long>(at.b) * p.heads + at.h) * p.lse_rows + p.row0 + at.i] =
        p.acc_lse[at.row];
}

// acc rows += part rows: a gradient's float32 share from one block.
extern "C" __global__ void __launch_bounds__(flexc_combine::kWarps * 32)
    flexc_grad_accumulate(const FlexcMergeParams p) {
  using namespace flexc_combine;
  const WarpRow at(p.batch, p.heads, p.rows);
  if (!at.valid) return;
  const int lane = threadIdx.x & 31;
  float* acc =
      p.acc + ((static_cast<long long>(at.b) * p.heads + at.h) * p.acc_rows + p.row0 + at.i) * p.dv;
  const float* part = at.of(static_cast<const float*>(p.part), p.part_stride);
  for (int c = lane * 4; c < p.dv; c += 128) {
    float4 x = *reinterpret_cast<const float4*>(acc + c);
    const float4 y = *reinterpret_cast<const float4*>(part + c);
    x.x += y.x, x.y += y.y, x.z += y.z, x.w += y.w;
    *reinterpret_cast<float4*>(acc + c) = x;
  }
}
