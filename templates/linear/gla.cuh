// Gated linear attention (GLA; Yang et al. 2023, arXiv 2312.06635) in chunkwise form, and its
// recurrent step. Per head: S_t = diag(alpha_t) S_{t-1} + k_t^T v_t, o_t = scale q_t S_t, with
// g_t = log alpha_t <= 0 (per key dim, per step broadcast, or none).
//
// Chunks of 64 tokens, in three kernels (the split of flash-linear-attention's chunk_gla):
// - flexc_gla_prepare, one CTA per (chunk, head, batch): gc, the gates' cumulative sum inside the
//   chunk, G its last row; it writes gc, Khat = k * exp(G - gc) (<= 1) and the decay exp(G).
// - flexc_gla_states walks a head's chunks in order, one CTA per (64 x 32 slice of the state,
//   head, batch): S_{n+1} = diag(exp(G)) S_n + Khat^T V, products alone, several chunks in
//   flight. It stores each chunk's start state S_n in the input type for the third kernel, and
//   the final state in float32.
// - flexc_gla_output, one CTA per (chunk, head, batch), eight warps: two per 16-row block
//   (sub-block), which split A's key dims and the output's columns:
//   o = (q * exp(gc)) S_n scale + A V, A[i][j] = scale sum_d q_i k_j exp(gc_i - gc_j), j <= i.
//   A's blocks below the diagonal run on tensor cores with every exponent <= 0: q * exp(gc_i -
//   gc_e) against Khat_J = k * exp(gc_e - gc_j), e the last row of the key block J. The diagonal
//   16 x 16 blocks factor against their first row f: q * exp(gc_i - gc_f) (<= 1) and k *
//   exp(gc_f - gc_j) (>= 1), exact as long as the gates fall by less than kSteep (log2 units)
//   inside the block; key dims where they fall further ("steep": strong decay) leave the
//   tensor-core product and are added exactly, element by element (the paper's secondary
//   chunking, with its per-element path only where it is needed). With one gate per step (or
//   none) A is (Q K^T) * exp(gc_i - gc_j) and the state's part exp(gc_i) (Q S_n): see kScalar.
// - flexc_gla_step, the recurrent form (decode): the state read once and written once per call.
//
// Compile-time configuration (src/linear/gla.cpp): FLEXC_GLA_DK, FLEXC_GLA_DV (64 or 128),
// FLEXC_BF16, FLEXC_GLA_GATE (0 none, 1 float32, 2 bf16, 3 fp16), FLEXC_GLA_SCALAR (1: one gate
// per step or none, the gates' key-dim stride 0).
#include "gla_chunk.cuh"

// ---- Chunk outputs: grid (chunks, heads, batch), 256 threads: eight warps, two per 16-row block
// (sub-block) of the chunk, each writing half of its output columns; dynamic shared memory
// kOutputSmem (host: gla_output_smem).
namespace flexc_gla {

constexpr int kOutThreads = 256;
constexpr int kOutCols = kDV / 2;  // output columns per warp
// q, k, a region for the state and v, gc; with per-dim gates also the steep masks (in 128 bytes).
// One gate per step: the region holds the state, then v. Per-dim gates: the state, then in its
// place Khat and v (v is loaded once the state part is done): two CTAs per SM at DK = DV = 128.
constexpr int kRegion = kScalar ? STile::kBytes + VTile::kBytes
                        : STile::kBytes > QTile::kBytes + VTile::kBytes
                            ? STile::kBytes
                            : QTile::kBytes + VTile::kBytes;
constexpr int kOutputSmem =
    2 * QTile::kBytes + kRegion + (kScalar ? kChunk * 4 : kChunk * kGcStride * 4 + 128);
static_assert(kScalar || 4 * 32 * (kChunk / 8) * 4 * 4 <= kChunk * kGcStride * 4,
              "A's partial sums are exchanged through gc's space");

// The A fragment (rows 16 w + g, + 8; key dims kk + 2 t4 .. of a k16 step) of
// q * 2^(gc - ref[d]) (ref: a row of gc, or null for 0), zero where `zero(d)`. The softmax scale
// is applied to the products instead (one multiply per accumulator, not per operand).
template <class Zero>
__device__ __forceinline__ void q_fragment(unsigned (&a)[4], unsigned char* q_tile, const float* gc,
                                           int w, int kk, const float* ref, Zero zero) {
  const int lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
#pragma unroll
  for (int x = 0; x < 4; ++x) {
    const int i = w * 16 + g + (x & 1) * 8, d = kk + 2 * t4 + (x >> 1) * 8;
    const unsigned qq = *pair<QTile>(q_tile, i, d);
    const float2 gg = *reinterpret_cast<const float2*>(gc + i * kGcStride + d);
    const float2 rr = ref ? *reinterpret_cast<const float2*>(ref + d) : make_float2(0.f, 0.f);
    // Zeroed by a factor, not a branch (the exponents are <= 0: no inf * 0).
    const float lo = unpack_lo<kBf16>(qq) * exp2_approx(gg.x - rr.x) * (zero(d) ? 0.f : 1.f);
    const float hi = unpack_hi<kBf16>(qq) * exp2_approx(gg.y - rr.y) * (zero(d + 1) ? 0.f : 1.f);
    a[x] = pack2<kBf16>(lo, hi);
  }
}

// Gates per key dim. Warp (w, half): its rows' state part, (q * exp(gc)) S_n * scale, for its
// output columns into o; A * scale for its 16 rows (zero right of the diagonal) into att, the two
// warps of a row block each summing half of the key dims and exchanging the partial sums. The gc
// tile is in shared memory; Khat and Kcheck are made here (Khat over the state tile once the state
// part is done, Kcheck over k).
__device__ __forceinline__ void per_dim_scores(const FlexcGlaParams& p, unsigned char* q_tile,
                                               unsigned char* k_tile, unsigned char* kh_tile,
                                               unsigned char* s_tile, unsigned char* v_tile,
                                               float* gc, unsigned* steep, const HeadRows& rows,
                                               int t0, float (&o)[1][kOutCols / 8][4],
                                               float (&att)[1][kChunk / 8][4]) {
  const int tid = threadIdx.x, warp = tid / 32, w = warp % 4, half = warp / 4;
  const int lane = tid % 32, g = lane / 4, t4 = lane % 4;
  const float scale = p.scale;
  const unsigned kt = smem_addr(k_tile), kht = smem_addr(kh_tile), stt = smem_addr(s_tile);
  const FragAddr<QTile> frag_nk = FragAddr<QTile>::b_nk();
  const FragAddr<STile> frag_s = FragAddr<STile>::b_kn();
  auto none = [](int) { return false; };
  const int col0 = half * kOutCols;

  // The state part first: Khat is then made in the state tile's place.
#pragma unroll
  for (int kk = 0; kk < kDK; kk += 16) {
    unsigned a[1][4];
    q_fragment(a[0], q_tile, gc, w, kk, nullptr, none);
    mma_rows<kBf16>(o, a, [&](unsigned(&bf)[4], int nn) {
      ldmatrix_x4_trans(bf, frag_s(stt, kk, (col0 + nn) / 8));
    });
  }
#pragma unroll
  for (int j = 0; j < kOutCols / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[0][j][e] *= scale;

  // The steep dims of each diagonal block, one key dim per thread.
  if (tid < kDK) {
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const float fall =
          gc[s * kSub * kGcStride + tid] - gc[(s * kSub + kSub - 1) * kGcStride + tid];
      const unsigned m = __ballot_sync(0xffffffffu, fall > kSteep);
      if (lane == 0) steep[s * kMaskWords + warp] = m;
    }
  }
  cp_async_wait<0>();  // k (flexc_gla_output's second group)
  __syncthreads();
  // The state is read: v into its place, beside Khat (waited for before A V).
  TileCopy<VTile, kOutThreads>()(smem_addr(v_tile), rows.v, p.v_stride[2], t0, p.seq_len);
  cp_async_commit();

  // Khat and Kcheck, two adjacent key dims at a time.
  for (int e = tid; e < kChunk * kDK / 2; e += kOutThreads) {
    const int r = e / (kDK / 2), d = e % (kDK / 2) * 2, s = r / kSub;
    unsigned* kk = pair<QTile>(k_tile, r, d);
    const float k0 = unpack_lo<kBf16>(*kk), k1 = unpack_hi<kBf16>(*kk);
    const float2 gr = *reinterpret_cast<const float2*>(gc + r * kGcStride + d);
    const float2 ge = *reinterpret_cast<const float2*>(gc + (s * kSub + kSub - 1) * kGcStride + d);
    const float2 gf = *reinterpret_cast<const float2*>(gc + s * kSub * kGcStride + d);
    const unsigned m = steep[s * kMaskWords + d / 32] >> (d % 32);
    *pair<QTile>(kh_tile, r, d) =
        pack2<kBf16>(k0 * exp2_approx(ge.x - gr.x), k1 * exp2_approx(ge.y - gr.y));
    *kk = pack2<kBf16>(m & 1 ? 0.f : k0 * exp2_approx(gf.x - gr.x),
                       m & 2 ? 0.f : k1 * exp2_approx(gf.y - gr.y));
  }
  __syncthreads();

  // Key block J, this warp's half of the key dims: q against Khat_J (exponents against J's last
  // row) or, on the diagonal, against Kcheck (exponents against the block's first row).
  constexpr int kHalfDK = kDK / 2;
  auto block = [&](int J, unsigned key_tile, int ref_row, auto zero) {
#pragma unroll
    for (int kk = 0; kk < kHalfDK; kk += 16) {
      const int k0 = half * kHalfDK + kk;
      unsigned a[4];
      q_fragment(a, q_tile, gc, w, k0, gc + ref_row * kGcStride, zero);
      unsigned bf[4];
      ldmatrix_x4(bf, frag_nk(key_tile, J * kSub, k0 / 8));
      mma_16816<kBf16>(att[0][2 * J], a, bf[0], bf[1]);
      mma_16816<kBf16>(att[0][2 * J + 1], a, bf[2], bf[3]);
    }
  };
#pragma unroll
  for (int J = 0; J < 3; ++J)
    if (J < w) block(J, kht, J * kSub + kSub - 1, none);
  // The diagonal block: steep dims zeroed in the product and added here exactly, by the warp whose
  // half holds them (k from global memory: the tile holds Kcheck).
  unsigned mask[kMaskWords];
#pragma unroll
  for (int i = 0; i < kMaskWords; ++i) mask[i] = steep[w * kMaskWords + i];
#pragma unroll
  for (int J = 0; J < 4; ++J) {
    if (J != w) continue;
    // (The word by selects: d depends on the warp's half, and an indexed array would go to
    // local memory.)
    block(J, kt, J * kSub, [&](int d) {
      unsigned m = mask[0];
#pragma unroll
      for (int i = 1; i < kMaskWords; ++i) m = d >= 32 * i ? mask[i] : m;
      return (m >> (d % 32) & 1) != 0;
    });
#pragma unroll
    for (int word = 0; word < kMaskWords; ++word) {
      if (word * 32 / kHalfDK != half) continue;
      for (unsigned bits = mask[word]; bits; bits &= bits - 1) {
        const int d = word * 32 + __ffs(bits) - 1;
#pragma unroll
        for (int x = 0; x < 8; ++x) {
          const int i = J * kSub + g + (x >> 2) * 8;
          const int j = J * kSub + (x & 3) / 2 * 8 + 2 * t4 + (x & 1);
          if (j > i || t0 + j >= p.seq_len) continue;
          const float kj = unpack_lo<kBf16>(__ldg(rows.k + (t0 + j) * p.k_stride[2] + d));
          const float qi = unpack_lo<kBf16>(*elem<QTile>(q_tile, i, d));
          att[0][2 * J + (x & 3) / 2][(x >> 2) * 2 + (x & 1)] +=
              qi * kj * exp2_approx(gc[i * kGcStride + d] - gc[j * kGcStride + d]);
        }
      }
    }
    // Causal inside the block: key j after row i contributes nothing.
#pragma unroll
    for (int x = 0; x < 8; ++x) {
      const int i = g + (x >> 2) * 8, j = (x & 3) / 2 * 8 + 2 * t4 + (x & 1);
      if (j > i) att[0][2 * J + (x & 3) / 2][(x >> 2) * 2 + (x & 1)] = 0.f;
    }
  }

  // The two halves' partial sums, through gc's space (gc is no longer read): the second half
  // writes, the first adds and writes the sum back, the second reads it.
  __syncthreads();
  float* xchg = gc + (w * 32 + lane) * (kChunk / 8) * 4;
  auto put = [&] {
#pragma unroll
    for (int c = 0; c < kChunk / 8; ++c)
      *reinterpret_cast<float4*>(xchg + c * 4) =
          make_float4(att[0][c][0], att[0][c][1], att[0][c][2], att[0][c][3]);
  };
  if (half == 1) put();
  __syncthreads();
  if (half == 0) {
#pragma unroll
    for (int c = 0; c < kChunk / 8; ++c) {
      const float4 v = *reinterpret_cast<const float4*>(xchg + c * 4);
      att[0][c][0] += v.x, att[0][c][1] += v.y, att[0][c][2] += v.z, att[0][c][3] += v.w;
    }
    put();
  }
  __syncthreads();
  if (half == 1) {
#pragma unroll
    for (int c = 0; c < kChunk / 8; ++c) {
      const float4 v = *reinterpret_cast<const float4*>(xchg + c * 4);
      att[0][c][0] = v.x, att[0][c][1] = v.y, att[0][c][2] = v.z, att[0][c][3] = v.w;
    }
  }
#pragma unroll
  for (int c = 0; c < kChunk / 8; ++c)
#pragma unroll
    for (int e = 0; e < 4; ++e) att[0][c][e] *= scale;
}

// One gate per step: gc is a row vector (log2 units). Q's fragments serve Q S_n and every
// Q K_J^T; the gates enter as factors of rows (the state's part) and of (i, j) (A). Both warps
// of a row block compute its A (16 x 64 x DK: cheap), each its half of the output columns.
__device__ __forceinline__ void scalar_scores(const FlexcGlaParams& p, unsigned char* q_tile,
                                              unsigned char* k_tile, unsigned char* s_tile,
                                              const float* gc, float (&o)[1][kOutCols / 8][4],
                                              float (&att)[1][kChunk / 8][4]) {
  const int warp = threadIdx.x / 32, w = warp % 4, col0 = warp / 4 * kOutCols;
  const int lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
  const unsigned qt = smem_addr(q_tile), kt = smem_addr(k_tile), stt = smem_addr(s_tile);
  const FragAddr<QTile> frag_a = FragAddr<QTile>::a(), frag_nk = FragAddr<QTile>::b_nk();
  const FragAddr<STile> frag_s = FragAddr<STile>::b_kn();
#pragma unroll
  for (int kk = 0; kk < kDK; kk += 16) {
    unsigned a[1][4];
    ldmatrix_x4(a[0], frag_a(qt, w * 16, kk / 8));
    mma_rows<kBf16>(o, a, [&](unsigned(&bf)[4], int nn) {
      ldmatrix_x4_trans(bf, frag_s(stt, kk, (col0 + nn) / 8));
    });
#pragma unroll
    for (int J = 0; J < 4; ++J) {
      if (J > w) continue;
      unsigned bf[4];
      ldmatrix_x4(bf, frag_nk(kt, J * kSub, kk / 8));
      mma_16816<kBf16>(att[0][2 * J], a[0], bf[0], bf[1]);
      mma_16816<kBf16>(att[0][2 * J + 1], a[0], bf[2], bf[3]);
    }
  }
  const float scale = p.scale;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = w * 16 + g + r * 8;
    const float row = exp2_approx(gc[i]) * scale;
#pragma unroll
    for (int j = 0; j < kOutCols / 8; ++j) o[0][j][2 * r] *= row, o[0][j][2 * r + 1] *= row;
#pragma unroll
    for (int c = 0; c < kChunk / 8; ++c)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int j = c * 8 + 2 * t4 + e;
        // j > i: after the row (and the blocks right of the diagonal, never computed).
        att[0][c][2 * r + e] *= j > i ? 0.f : exp2_approx(gc[i] - gc[j]) * scale;
      }
  }
}

}  // namespace flexc_gla

extern "C" __global__ void __launch_bounds__(flexc_gla::kOutThreads, 2)
    flexc_gla_output(const FlexcGlaParams p) {
  using namespace flexc_gla;
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* q_tile = smem;
  unsigned char* k_tile = q_tile + QTile::kBytes;  // k (per-dim gates: then Kcheck, in place)
  unsigned char* s_tile = k_tile + QTile::kBytes;
  // Per-dim gates: Khat = k * exp(gc_e - gc) over the state, v after it.
  unsigned char* kh_tile = s_tile;
  unsigned char* v_tile = s_tile + (kScalar ? STile::kBytes : QTile::kBytes);
  float* gc = reinterpret_cast<float*>(s_tile + kRegion);  // log2 units
  // Per-dim gates: gc [64][kGcStride], the steep masks [4][kMaskWords] (in 128 bytes).
  unsigned* steep = reinterpret_cast<unsigned*>(gc + kChunk * kGcStride);

  const int n = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int t0 = n * kChunk;
  const int tid = threadIdx.x, warp = tid / 32, w = warp % 4, col0 = warp / 4 * kOutCols;
  const int lane = tid % 32, g = lane / 4, t4 = lane % 4;
  const HeadRows x = head_rows(p, b, h);
  const unsigned short* sp = static_cast<const unsigned short*>(p.states) +
                             state_offset(p, b, h) * p.chunks +
                             static_cast<long long>(n) * kDK * kDV;
  // What the state part reads (q, the state, gc), then k (and, one gate per step, v): per-dim
  // gates need k only after the state part (per_dim_scores waits for it, then loads v).
  TileCopy<QTile, kOutThreads>()(smem_addr(q_tile), x.q, p.q_stride[2], t0, p.seq_len);
  TileCopy<STile, kOutThreads>()(smem_addr(s_tile), sp, kDV, 0, kDK);
  copy_gc<kOutThreads>(gc, p, b, h, n);
  cp_async_commit();
  TileCopy<QTile, kOutThreads>()(smem_addr(k_tile), x.k, p.k_stride[2], t0, p.seq_len);
  if constexpr (kScalar)
    TileCopy<VTile, kOutThreads>()(smem_addr(v_tile), x.v, p.v_stride[2], t0, p.seq_len);
  cp_async_commit();
  cp_async_wait<kScalar ? 0 : 1>();
  __syncthreads();

  float o[1][kOutCols / 8][4], att[1][kChunk / 8][4];
  zero_fragments(o);
  zero_fragments(att);
  if constexpr (kScalar) {
    scalar_scores(p, q_tile, k_tile, s_tile, gc, o, att);
  } else {
    per_dim_scores(p, q_tile, k_tile, kh_tile, s_tile, v_tile, gc, steep, x, t0, o, att);
    cp_async_wait<0>();  // v
    __syncthreads();
  }

  // o += A V over the key blocks up to the diagonal, this warp's output columns.
  const unsigned vt = smem_addr(v_tile);
  const FragAddr<VTile> frag_v = FragAddr<VTile>::b_kn();
#pragma unroll
  for (int J = 0; J < 4; ++J) {
    if (J > w) continue;
    unsigned a[1][4];
    c_to_a<kBf16>(att[0], J, a[0]);
    mma_rows<kBf16>(o, a, [&](unsigned(&bf)[4], int nn) {
      ldmatrix_x4_trans(bf, frag_v(vt, J * kSub, (col0 + nn) / 8));
    });
  }

  unsigned short* op =
      static_cast<unsigned short*>(p.o) + b * p.o_stride[0] + h * p.o_stride[1] + col0;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int t = t0 + w * 16 + g + r * 8;
    if (t >= p.seq_len) continue;
#pragma unroll
    for (int j = 0; j < kOutCols / 8; ++j)
      *reinterpret_cast<unsigned*>(op + t * p.o_stride[2] + j * 8 + 2 * t4) =
          pack2<kBf16>(o[0][j][2 * r], o[0][j][2 * r + 1]);
  }
}

// ---- The recurrent step: grid (kDV / 64, heads, batch), 256 threads; the state (h0 == ht) is
// updated in place over the call's seq_len tokens, one after the other. Each thread holds four
// adjacent value dims of kDK / 16 adjacent key dims, so a warp reads and writes the state in
// 16-byte pieces of two 256-byte rows; the token's q, k and decays pass through shared memory
// (one exponential per key dim and CTA, not per thread), and o's sum over the key dims runs in
// the thread, across the warp's two row groups by a shuffle, then across warps.
extern "C" __global__ void __launch_bounds__(256) flexc_gla_step(const FlexcGlaParams p) {
  using namespace flexc_gla;
  constexpr int kRows = kDK / 16, kWarps = 8;
  __shared__ __align__(16) float qkd[3][kDK];  // q, k, decay of the token
  __shared__ __align__(16) float part[kWarps][64];
  const int h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x, lane = tid % 32;
  const int quad = tid % 16, dk0 = tid / 16 * kRows, col = quad * 4;
  float* state = p.ht + state_offset(p, b, h) + dk0 * kDV + blockIdx.x * 64 + col;
  float s[kRows][4];
#pragma unroll
  for (int m = 0; m < kRows; ++m) {
    const float4 f = *reinterpret_cast<const float4*>(state + m * kDV);
    s[m][0] = f.x, s[m][1] = f.y, s[m][2] = f.z, s[m][3] = f.w;
  }
  const HeadRows x = head_rows(p, b, h);
  unsigned short* op =
      static_cast<unsigned short*>(p.o) + b * p.o_stride[0] + h * p.o_stride[1] + blockIdx.x * 64;
  for (int t = 0; t < p.seq_len; ++t) {
    if (tid < kDK) {
      qkd[0][tid] = unpack_lo<kBf16>(__ldg(x.q + t * p.q_stride[2] + tid));
      qkd[1][tid] = unpack_lo<kBf16>(__ldg(x.k + t * p.k_stride[2] + tid));
      qkd[2][tid] = kGate ? exp2_approx(gate_at(p, b, h, t, tid) * kLog2e) : 1.f;
    }
    const uint2 vv =
        __ldg(reinterpret_cast<const uint2*>(x.v + t * p.v_stride[2] + blockIdx.x * 64 + col));
    const float v[4] = {unpack_lo<kBf16>(vv.x), unpack_hi<kBf16>(vv.x), unpack_lo<kBf16>(vv.y),
                        unpack_hi<kBf16>(vv.y)};
    __syncthreads();
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int m4 = 0; m4 < kRows; m4 += 4) {
      const float4 q4 = *reinterpret_cast<const float4*>(&qkd[0][dk0 + m4]);
      const float4 k4 = *reinterpret_cast<const float4*>(&qkd[1][dk0 + m4]);
      const float4 d4 = *reinterpret_cast<const float4*>(&qkd[2][dk0 + m4]);
      const float qs[4] = {q4.x, q4.y, q4.z, q4.w}, ks[4] = {k4.x, k4.y, k4.z, k4.w},
                  ds[4] = {d4.x, d4.y, d4.z, d4.w};
#pragma unroll
      for (int r = 0; r < 4; ++r) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          s[m4 + r][c] = fmaf(s[m4 + r][c], ds[r], ks[r] * v[c]);
          acc[c] = fmaf(qs[r], s[m4 + r][c], acc[c]);
        }
      }
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[c] += __shfl_xor_sync(0xffffffffu, acc[c], 16);
    if (lane < 16)
      *reinterpret_cast<float4*>(&part[tid / 32][col]) =
          make_float4(acc[0], acc[1], acc[2], acc[3]);
    // Also orders this token's reads of qkd before the next token's writes.
    __syncthreads();
    if (tid < 64) {
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) sum += part[w][tid];
      op[t * p.o_stride[2] + tid] =
          static_cast<unsigned short>(pack2<kBf16>(sum * p.scale, 0.f) & 0xffffu);
    }
  }
#pragma unroll
  for (int m = 0; m < kRows; ++m)
    *reinterpret_cast<float4*>(state + m * kDV) = make_float4(s[m][0], s[m][1], s[m][2], s[m][3]);
}
