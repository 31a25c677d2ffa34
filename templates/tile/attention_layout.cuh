// Where attention tensors' elements live, for kernels with and without a variant: rows of
// [B, H, S, D] tensors, float32 outputs, the backward's dQ accumulator. No hooks: the backward's
// per-row kernels (attention_bwd_rows.cuh) compile from this alone, once for every variant.
#pragma once

#include "attention_params.cuh"

namespace flexc_attn {

// A kernel built with FLEXC_F32_OUT writes its outputs (the forward's O; the backward's dQ, dK,
// dV) in float32, unrounded: ring attention's blocks, merged or summed before one rounding; with
// FLEXC_F32_OUT 2 it adds them into what the outputs hold (the backward) or merges them into O
// and its LSE (the forward: store_rows). A build of its own, so that the 16-bit kernels'
// registers stay as they are.
#ifndef FLEXC_F32_OUT
#define FLEXC_F32_OUT 0
#endif
constexpr bool kF32Out = FLEXC_F32_OUT != 0;
constexpr bool kAddOut = FLEXC_F32_OUT == 2;
// Stores a pair of float32 outputs at `at` (8-byte aligned), or adds them (kAddOut): each output
// element has one writer per call, and calls are ordered on their stream.
__device__ __forceinline__ void put_f32x2(float* at, float x, float y) {
  float2 v = make_float2(x, y);
  if constexpr (kAddOut) {
    const float2 old = *reinterpret_cast<const float2*>(at);
    v.x += old.x, v.y += old.y;
  }
  *reinterpret_cast<float2*>(at) = v;
}

// Row `h` of batch `b` of a [B, H, S, D] tensor with strides `stride` (elements).
template <class T>
__device__ __forceinline__ const T* at(const void* base, const long long (&stride)[3], int b,
                                       int h) {
  return static_cast<const T*>(base) + b * stride[0] + h * stride[1];
}

// Row 0 of head (b, h) of an output [B, H, S, D] (strides in elements): 16-bit elements, float32
// in a FLEXC_F32_OUT build.
__device__ __forceinline__ void* head_rows(void* base, const long long (&stride)[3], long long b,
                                           long long h) {
  return static_cast<char*>(base) + (b * stride[0] + h * stride[1]) * (kF32Out ? 4 : 2);
}

// The backward's float32 dQ accumulator (FlexcAttentionBwdParams::dq_accum): per (batch, query
// head), blocks of 64 q rows (the last one padded to 64), each block in the order in which the
// Hopper kernel's two consumer warpgroups hold their halves of dQ (columns [0, D/2) and
// [D/2, D)) as m64 wgmma fragments: half, n8 column tile j, thread t of the warpgroup, then the
// fragment's 4 floats. So a warpgroup stages its half with conflict-free 16-byte stores and adds
// it with one contiguous bulk reduce; the other kernels address it element by element.
template <int D>
struct DqAccum {
  static constexpr int kRows = 64;
  static constexpr int kHalfCols = D / 2;
  static constexpr int kHalfFloats = kRows * kHalfCols;
  // Offset of the block holding q row `q` of head (b, h).
  __device__ __forceinline__ static long long block(const FlexcAttentionParams& p, int b, int h,
                                                    int q) {
    const int blocks = (p.q_len + kRows - 1) / kRows;
    return ((static_cast<long long>(b) * p.q_heads + h) * blocks + q / kRows) * (kRows * D);
  }
  // Offset of (row r, column c) inside a block; r < 64, c < D.
  __device__ __forceinline__ static int offset(int r, int c) {
    const int half = c / kHalfCols, cc = c % kHalfCols, r16 = r & 15;
    const int t = (r >> 4) * 32 + (r16 & 7) * 4 + ((cc & 7) >> 1);
    const int e = (r16 >> 3) * 2 + (cc & 1);
    return half * kHalfFloats + ((cc >> 3) * 128 + t) * 4 + e;
  }
};

}  // namespace flexc_attn
