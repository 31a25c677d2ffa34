// What the gated linear attention kernels share (templates/linear/gla.cuh: forward and step;
// templates/linear/gla_backward.cuh): the compile-time configuration, gate loads, tiles, and the
// two passes every chunkwise call makes: flexc_gla_prepare (per chunk: gc, Khat, decays, and for
// the backward q * exp(gc)) and the sequential state passes (flexc_gla_states forward over the
// chunks, flexc_gla_dstates backward over them). See gla.cuh for the algorithm.
//
// Compile-time configuration (src/linear/gla.cpp): FLEXC_GLA_DK, FLEXC_GLA_DV (64 or 128),
// FLEXC_BF16, FLEXC_GLA_GATE (0 none, 1 float32, 2 bf16, 3 fp16), FLEXC_GLA_SCALAR (1: one gate
// per step or none, the gates' key-dim stride 0).
#pragma once

#include "gla_params.cuh"
#include "tile_mma.cuh"

namespace flexc_gla {

using namespace flexc_tile;

constexpr int kDK = FLEXC_GLA_DK, kDV = FLEXC_GLA_DV;
constexpr bool kBf16 = FLEXC_BF16 != 0;
constexpr int kGate = FLEXC_GLA_GATE;
// One gate per step (or none): the decay between two tokens is the same for every key dim, so A
// is (Q K^T) * exp(gc_i - gc_j) and the state's part is exp(gc_i) (Q S): no per-dim operands.
constexpr bool kScalar = FLEXC_GLA_SCALAR != 0;
constexpr int kGcCols = kScalar ? 1 : kDK;  // gc's columns in the workspace
constexpr int kChunk = 64, kSub = 16, kThreads = 128;
constexpr float kLog2e = 1.4426950408889634f;
// How far (log2 units) the gates may fall inside a diagonal block for its factored product: k
// grows up to 2^kSteep and must stay finite in the input type (fp16 tops out at 2^16).
constexpr float kSteep = kBf16 ? 80.f : 8.f;
static_assert((kDK == 64 || kDK == 128) && (kDV == 64 || kDV == 128), "head dims 64 or 128");

// The log gate of (b, h, t, key dim d); 0 without gates. Below -1e4 (-inf included) it is -1e4:
// exp of either is 0 in float32 and float64, and the chunk's cumulative sums stay finite. A
// positive or NaN gate is NaN, so that its head's results are NaN, not silently wrong.
__device__ __forceinline__ float gate_raw(const FlexcGlaParams& p, int b, int h, int t, int d) {
  if constexpr (kGate == 0) {
    return 0.f;
  } else {
    const long long o =
        b * p.g_stride[0] + h * p.g_stride[1] + t * p.g_stride[2] + d * p.g_stride[3];
    if constexpr (kGate == 1) {
      return __ldg(static_cast<const float*>(p.g) + o);
    } else {
      return unpack_lo<kGate == 2>(__ldg(static_cast<const unsigned short*>(p.g) + o));
    }
  }
}
__device__ __forceinline__ float gate_at(const FlexcGlaParams& p, int b, int h, int t, int d) {
  const float x = gate_raw(p, b, h, t, d);
  // Selects, not branches: a branch on a loaded value stalls the warp on every load.
  const float clamped = fmaxf(x, -1.0e4f);
  return x <= 0.f ? clamped : __int_as_float(0x7fffffff);
}

// The gate of token t, 0 past the sequence (padding rows of the last chunk): the load reads a
// valid row, the select drops it, and no branch waits on it.
__device__ __forceinline__ float gate_or_0(const FlexcGlaParams& p, int b, int h, int t, int d) {
  const float x = gate_at(p, b, h, min(t, p.seq_len - 1), d);
  return t < p.seq_len ? x : 0.f;
}

// One 16-bit element of a swizzled tile, and a pair of adjacent ones (c even).
template <class Tile>
__device__ __forceinline__ unsigned short* elem(unsigned char* tile, int r, int c) {
  return reinterpret_cast<unsigned short*>(tile + Tile::offset(r, c / 8) + (c % 8) * 2);
}
template <class Tile>
__device__ __forceinline__ unsigned* pair(unsigned char* tile, int r, int c) {
  return reinterpret_cast<unsigned*>(elem<Tile>(tile, r, c));
}

__device__ __forceinline__ long long state_offset(const FlexcGlaParams& p, int b, int h) {
  return (static_cast<long long>(b) * p.heads + h) * kDK * kDV;
}

// gc's rows in shared memory, padded by 8 floats: the 4 rows a half-warp reads at one column
// pair fall in different banks.
constexpr int kGcStride = kDK + 8;

// Chunk n's gc rows into shared memory (cp.async; the caller commits): kChunk floats with one
// gate per step, else kChunk rows of kGcStride.
template <int THREADS>
__device__ __forceinline__ void copy_gc(float* gc, const FlexcGlaParams& p, int b, int h, int n) {
  const float* gp =
      p.gcum + ((static_cast<long long>(b) * p.heads + h) * p.chunks + n) * kChunk * kGcCols;
  constexpr int kPieces = kChunk * kGcCols / 4;  // 16 bytes each
#pragma unroll
  for (int i = threadIdx.x; i < kPieces; i += THREADS) {
    if constexpr (kScalar) {
      cp_async_16(smem_addr(gc + i * 4), gp + i * 4, true);
    } else {
      const int r = i / (kDK / 4), c = i % (kDK / 4) * 4;
      cp_async_16(smem_addr(gc + r * kGcStride + c), gp + r * kDK + c, true);
    }
  }
}

// A head's q, k and v at (b, h, token 0): k and v of its k head.
struct HeadRows {
  const unsigned short* q;
  const unsigned short* k;
  const unsigned short* v;
};
__device__ __forceinline__ HeadRows head_rows(const FlexcGlaParams& p, int b, int h) {
  const int hk = h / (p.heads / p.k_heads);
  return {static_cast<const unsigned short*>(p.q) + b * p.q_stride[0] + h * p.q_stride[1],
          static_cast<const unsigned short*>(p.k) + b * p.k_stride[0] + hk * p.k_stride[1],
          static_cast<const unsigned short*>(p.v) + b * p.v_stride[0] + hk * p.v_stride[1]};
}

using QTile = SmemTile<kChunk, kDK>;
using VTile = SmemTile<kChunk, kDV>;
using STile = SmemTile<kDK, kDV>;
constexpr int kMaskWords = kDK / 32;

}  // namespace flexc_gla

// ---- Per chunk, in parallel: gc (log2 units), Khat = k * exp(G - gc) and the decay exp(G)
// (G = gc's last row), so that the sequential pass is products alone and the output kernel
// loads gc like any tile; for the backward (p.qexp set) also scale * q * exp(gc), the state
// gradients' operand. Grid (chunks, heads, batch), 4 x kDK threads: a key dim and 16 rows each.
extern "C" __global__ void __launch_bounds__(4 * flexc_gla::kDK)
    flexc_gla_prepare(const FlexcGlaParams p) {
  using namespace flexc_gla;
  __shared__ float part[4][kDK];  // each row group's gate sum
  const int n = blockIdx.x, h = blockIdx.y, b = blockIdx.z, hk = h / (p.heads / p.k_heads);
  const int d = threadIdx.x % kDK, grp = threadIdx.x / kDK, r0 = n * kChunk + grp * kSub;
  float gc[kSub];
  float run = 0.f;
#pragma unroll
  for (int r = 0; r < kSub; ++r) gc[r] = run += gate_or_0(p, b, h, r0 + r, d);
  part[grp][d] = run;
  __syncthreads();
  float offset = 0.f, total = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    offset += i < grp ? part[i][d] : 0.f;
    total += part[i][d];
  }
  const long long bh = static_cast<long long>(b) * p.heads + h;
  if (grp == 0) p.decay[(bh * p.chunks + n) * kDK + d] = exp2_approx(total * kLog2e);
  const unsigned short* kp =
      static_cast<const unsigned short*>(p.k) + b * p.k_stride[0] + hk * p.k_stride[1] + d;
  const long long row = bh * p.chunks * kChunk + r0;
  unsigned short* kh = static_cast<unsigned short*>(p.khat) + row * kDK + d;
  float* gout = p.gcum + row * kGcCols + d;
#pragma unroll
  for (int r = 0; r < kSub; ++r) {
    const int t = r0 + r;
    const float kv = unpack_lo<kBf16>(__ldg(kp + min(t, p.seq_len - 1) * p.k_stride[2]));
    const float k = t < p.seq_len ? kv : 0.f;
    const float g = gc[r] + offset;
    if (!kScalar || d == 0) gout[r * kGcCols] = g * kLog2e;
    kh[r * kDK] = static_cast<unsigned short>(
        pack2<kBf16>(k * exp2_approx((total - g) * kLog2e), 0.f) & 0xffffu);
  }
  if (p.qexp) {
    const unsigned short* qp =
        static_cast<const unsigned short*>(p.q) + b * p.q_stride[0] + h * p.q_stride[1] + d;
    unsigned short* qe = static_cast<unsigned short*>(p.qexp) + row * kDK + d;
#pragma unroll
    for (int r = 0; r < kSub; ++r) {
      const int t = r0 + r;
      const float qv = unpack_lo<kBf16>(__ldg(qp + min(t, p.seq_len - 1) * p.q_stride[2]));
      qe[r * kDK] = static_cast<unsigned short>(
          pack2<kBf16>(t < p.seq_len ? p.scale * qv * exp2_approx((gc[r] + offset) * kLog2e) : 0.f,
                       0.f) &
          0xffffu);
    }
  }
}

// ---- Chunk start states, in order: S_{n+1} = diag(decay_n) S_n + Khat_n^T V_n, from Khat and
// decay of flexc_gla_prepare, kStatesStages chunks in flight. Grid (kDK / 64 x kDV /
// kStateCols, heads, batch), 128 threads; dynamic shared memory kStatesSmem. Slices of 64 x 32:
// the pass is a chain of dependent steps per slice, so more slices keep more SMs pulling.
//
// The backward's state gradients are the same pass run from the last chunk to the first:
// D_{n-1} = diag(decay_n) D_n + Qexp_n^T dO_n, D_n = dL / dS_{n+1}, started from the final
// state's gradient. The host gives flexc_gla_dstates the forward's arguments with the roles
// swapped: khat = Qexp, v = dO (its strides, k_heads = heads), h0 = dL / d final state,
// states = the per-chunk D_n, ht = dL / d initial state.
namespace flexc_gla {
constexpr int kStatesStages = kFlexcGlaStatesStages, kStateCols = kFlexcGlaStateCols;
using KhatTile = SmemTile<kChunk, 64>;            // 64 tokens x 64 key dims
using VSliceTile = SmemTile<kChunk, kStateCols>;  // 64 tokens x the slice's value dims
constexpr int kStatesStage = KhatTile::kBytes + VSliceTile::kBytes + 64 * 4;  // + the decays
constexpr int kStatesSmem = kStatesStages * kStatesStage;

template <bool kReverse>
__device__ __forceinline__ void state_pass(const FlexcGlaParams& p) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int kVSlices = kDV / kStateCols, kNT = kStateCols / 8;
  const int dk0 = blockIdx.x / kVSlices * 64, dv0 = blockIdx.x % kVSlices * kStateCols;
  const int h = blockIdx.y, b = blockIdx.z, hk = h / (p.heads / p.k_heads);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  const long long bh = static_cast<long long>(b) * p.heads + h;
  const unsigned base = smem_addr(smem);
  auto kh_tile = [&](int s) { return base + s * kStatesStage; };
  auto v_tile = [&](int s) { return base + s * kStatesStage + KhatTile::kBytes; };
  constexpr int kDecayAt = KhatTile::kBytes + VSliceTile::kBytes;
  auto decay_at = [&](int s) {
    return reinterpret_cast<const float*>(smem + s * kStatesStage + kDecayAt);
  };
  const TileCopy<KhatTile, kThreads> copy_k;
  const TileCopy<VSliceTile, kThreads> copy_v;
  const unsigned short* khp =
      static_cast<const unsigned short*>(p.khat) + bh * p.chunks * kChunk * kDK + dk0;
  const unsigned short* vp =
      static_cast<const unsigned short*>(p.v) + b * p.v_stride[0] + hk * p.v_stride[1] + dv0;
  const float* dp = p.decay + bh * p.chunks * kDK + dk0;
  // The m-th chunk of the walk into its stage; a commit group either way, so that the waits
  // count the same.
  auto load = [&](int m) {
    if (m < p.chunks) {
      const int n = kReverse ? p.chunks - 1 - m : m, s = m % kStatesStages;
      copy_k(kh_tile(s), khp, kDK, n * kChunk, p.chunks * kChunk);
      copy_v(v_tile(s), vp, p.v_stride[2], n * kChunk, p.seq_len);
      if (tid < 16)
        cp_async_16(base + s * kStatesStage + kDecayAt + tid * 16, dp + n * kDK + tid * 4, true);
    }
    cp_async_commit();
  };

  // The state slice: rows dk (16 per warp), kStateCols columns dv, as mma C fragments.
  float acc[1][kNT][4];
  const long long so = bh * kDK * kDV;
  auto state_index = [&](int j, int e) {
    const int dk = dk0 + warp * 16 + g + (e >> 1) * 8, dv = dv0 + j * 8 + 2 * t4 + (e & 1);
    return static_cast<long long>(dk) * kDV + dv;
  };
#pragma unroll
  for (int j = 0; j < kNT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[0][j][e] = p.h0 ? p.h0[so + state_index(j, e)] : 0.f;

  for (int m = 0; m < kStatesStages - 1; ++m) load(m);
  const FragAddr<KhatTile> frag_t = FragAddr<KhatTile>::b_nk();
  const FragAddr<VSliceTile> frag_v = FragAddr<VSliceTile>::b_kn();
  for (int m = 0; m < p.chunks; ++m) {
    const int n = kReverse ? p.chunks - 1 - m : m, s = m % kStatesStages;
    cp_async_wait<kStatesStages - 2>();
    __syncthreads();  // chunk n is in; every warp is done with the previous chunk's stage
    load(m + kStatesStages - 1);
    // S_n, the state at the chunk's start (reverse: D_n), for the per-chunk kernels.
    unsigned short* st = static_cast<unsigned short*>(p.states) + (bh * p.chunks + n) * kDK * kDV;
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int e = 0; e < 4; e += 2)
        *reinterpret_cast<unsigned*>(st + state_index(j, e)) =
            pack2<kBf16>(acc[0][j][e], acc[0][j][e + 1]);
    // S = diag(decay) S + Khat^T V: A = Khat^T read transposed, rows dk of this warp.
    const float* decay = decay_at(s);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float f = decay[warp * 16 + g + (e >> 1) * 8];
#pragma unroll
      for (int j = 0; j < kNT; ++j) acc[0][j][e] *= f;
    }
#pragma unroll
    for (int kk = 0; kk < kChunk; kk += 16) {
      unsigned a[1][4];
      ldmatrix_x4_trans(a[0], frag_t(kh_tile(s), kk, warp * 2));
      mma_rows<kBf16>(acc, a, [&](unsigned(&bf)[4], int nn) {
        ldmatrix_x4_trans(bf, frag_v(v_tile(s), kk, nn / 8));
      });
    }
  }
  if (p.ht) {
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) p.ht[so + state_index(j, e)] = acc[0][j][e];
  }
}
}  // namespace flexc_gla

extern "C" __global__ void __launch_bounds__(128) flexc_gla_states(const FlexcGlaParams p) {
  flexc_gla::state_pass<false>(p);
}
extern "C" __global__ void __launch_bounds__(128) flexc_gla_dstates(const FlexcGlaParams p) {
  flexc_gla::state_pass<true>(p);
}
