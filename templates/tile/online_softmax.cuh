// The online softmax of FlashAttention, in registers, on mma.sync C fragments.
//
// A warp owns MT row tiles of 16 rows; each thread holds two rows per tile (g and g+8, see
// tile_mma.cuh) and NT n8 column tiles of each, split across the 4 threads of a quad. Scores come
// in any units u with log2-units = u * to_log2 (to_log2 > 0), so that an identity score_mod
// folds softmax_scale * log2(e) into the exponent's one FMA. Masked scores are -inf.
//
// Rows that have seen only -inf keep max = -inf; exponents are then taken against 0 instead, so
// every p and every rescale factor is exactly 0 and no inf - inf ever makes a NaN. Such rows end
// with sum 0: output 0 and LSE -inf.
#pragma once

#include "tile_mma.cuh"

namespace flexc_tile {

__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

// ---- P from a stored LSE (the backward's recomputation): P = exp2(s * to_log2 - lse2).

// A row's LSE in log2 units; +inf for a row with no unmasked element (LSE -inf, and rows past
// the length), so that every P of it is 2^-inf = 0 and never NaN.
__device__ __forceinline__ float lse_log2(float lse) {
  return lse == neg_inf() ? __int_as_float(0x7f800000) : lse * 1.4426950408889634f;
}
__device__ __forceinline__ float p_from_lse(float s, float to_log2, float lse2) {
  return exp2_approx(fmaf(s, to_log2, -lse2));
}
// P d score_mod / d score (GRAD: the derivative `grad`); 0 where P is 0 (masked, past a length,
// a score_mod of -inf), whatever the derivative there. A kernel may take it as soon as P has
// gone into dV's product, so that one array (not P and the derivative) stays live across dP's.
__device__ __forceinline__ float p_grad(float p, float grad) { return p == 0.f ? 0.f : p * grad; }
// dS = P d score_mod / d score (dP - delta) from pg = p_grad(P, grad) (GRAD: from P and grad);
// exactly 0 where pg is. One rounding order whichever way a kernel takes it.
template <bool GRAD>
__device__ __forceinline__ float dscore(float p, float dp, float delta, float grad) {
  const float pg = GRAD ? p_grad(p, grad) : p;
  return pg == 0.f ? 0.f : pg * (dp - delta);
}

template <int MT, int NT>
struct OnlineSoftmax {
  float max_[MT][2];  // running row max, in score units
  float sum_[MT][2];  // this thread's part of the running row sum of p

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int i = 0; i < MT; ++i) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        max_[i][r] = neg_inf();
        sum_[i][r] = 0.f;
      }
    }
  }

  // Replaces the scores `s` of one kv tile with p = 2^((s - max) * to_log2) and sets, per row,
  // the factor the output accumulated so far must be multiplied by. Returns whether any factor
  // of the warp differs from 1 (warp-uniform).
  __device__ __forceinline__ bool step(float (&s)[MT][NT][4], float to_log2,
                                       float (&alpha)[MT][2]) {
    bool rescale = false;
#pragma unroll
    for (int i = 0; i < MT; ++i) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = max_[i][r];
#pragma unroll
        for (int j = 0; j < NT; ++j) mx = fmaxf(mx, fmaxf(s[i][j][2 * r], s[i][j][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        // The base of the exponents is the rounded product max * to_log2, recomputed the same
        // way every tile (__fmul_rn is never contracted into an FMA), so a row whose max is
        // unchanged gets a factor of exactly 1 and its sum stays consistent with the output.
        const float base = mx == neg_inf() ? 0.f : __fmul_rn(mx, to_log2);
        alpha[i][r] = mx == max_[i][r] ? 1.f : exp2_approx(__fmul_rn(max_[i][r], to_log2) - base);
        rescale |= mx != max_[i][r];
        max_[i][r] = mx;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float p = exp2_approx(fmaf(s[i][j][2 * r + e], to_log2, -base));
            s[i][j][2 * r + e] = p;
            sum += p;
          }
        }
        sum_[i][r] = sum_[i][r] * alpha[i][r] + sum;
      }
    }
    return __any_sync(0xffffffffu, rescale);
  }

  // Multiplies the output accumulated so far (DT n8 column tiles per row tile) by step's factors.
  template <int DT>
  __device__ __forceinline__ static void rescale(float (&acc)[MT][DT][4],
                                                 const float (&alpha)[MT][2]) {
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int j = 0; j < DT; ++j) {
        acc[i][j][0] *= alpha[i][0];
        acc[i][j][1] *= alpha[i][0];
        acc[i][j][2] *= alpha[i][1];
        acc[i][j][3] *= alpha[i][1];
      }
  }

  // After the last tile: per row, the factor that normalises the output (0 for rows with no
  // unmasked element) and the log-sum-exp in natural log (-inf for such rows). `to_ln` converts
  // score units to natural log units. The sum was taken against the rounded base; adding back
  // that rounding error keeps LSE accurate when scores are large (alibi at long range).
  __device__ __forceinline__ void finish(float to_log2, float to_ln, float (&inv_sum)[MT][2],
                                         float (&lse)[MT][2]) {
#pragma unroll
    for (int i = 0; i < MT; ++i) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float sum = sum_[i][r];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const bool empty = sum == 0.f;
        const float m = max_[i][r];
        const float base_error = fmaf(m, to_log2, -__fmul_rn(m, to_log2));  // exact
        inv_sum[i][r] = empty ? 0.f : 1.f / sum;
        lse[i][r] =
            empty ? neg_inf() : fmaf(m, to_ln, fmaf(-base_error, 0.69314718055994531f, logf(sum)));
      }
    }
  }
};

}  // namespace flexc_tile
