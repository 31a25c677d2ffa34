// Gated linear attention's chunkwise backward (templates/linear/gla.cuh has the forward and the
// notation; gc in log2 units, G its chunk's last row). With the chunk start states S_n
// (flexc_gla_states) and the state gradients D_n = dL / dS_{n+1} (flexc_gla_dstates) in the
// workspace, every chunk's gradients are local:
//   dA_ij = scale dO_i . v_j (j <= i),  A_ij = scale sum_d q_i k_j 2^(gc_i - gc_j) (the forward's)
//   dq_i = scale 2^gc_i (dO_i S_n^T) + sum_{j<=i} dA_ij k_j 2^(gc_i - gc_j)
//   dk_j = 2^(G - gc_j) (v_j D_n^T) + sum_{i>=j} dA_ij q_i 2^(gc_i - gc_j)
//   dv_j = Kend_j D_n + sum_{i>=j} A_ij dO_i    (Kend = k 2^(G - gc): flexc_gla_prepare's Khat)
//   db_i = q_i dq_i - k_i dk_i                  (dL / d of the gates' running sum, per key dim)
// and dg_t = sum_{u>=t} db_u over the whole sequence, plus sum_e S_T dS_T per key dim when the
// final state has a gradient (flexc_gla_dg_scan, flexc_gla_dg).
//
// 2^(gc_i - gc_j) never meets the tensor cores whole. With f and e the first and last rows of a
// 16-row block, every factor is <= 1 except the diagonal blocks' checked operands (>= 1, at
// most 2^kSteep; zero on steep key dims, whose terms are added exactly as in the forward):
//   Qhat = q 2^(gc - gc_f), Khat = k 2^(gc_e - gc)          (<= 1)
//   Qcheck = q 2^(gc - gc_e), Kcheck = k 2^(gc_f - gc)      (>= 1)
//   cf[I][J] = 2^(gc_{f_I} - gc_{e_J}) per key dim, I > J   (<= 1)
//   A_IJ = (Qhat_I cf[I][J]) Khat_J^T (I > J), A_II = Qhat_I Kcheck_I^T
//   dq_I = 2^(gc_I - gc_{f_I}) [dA_II Kcheck_I + sum_{J<I} cf[I][J] (dA_IJ Khat_J)
//                               + scale 2^gc_{f_I} (dO_I S_n^T)]
//   dk_J = 2^(gc_{e_J} - gc_J) [dA_JJ^T Qcheck_J + sum_{I>J} cf[I][J] (dA_IJ^T Qhat_I)
//                               + 2^(G - gc_{e_J}) (v_J D_n^T)]
// so the column factors (cf and the state parts') scale whole products, and each row factor
// one accumulator. One gate per step runs the same code with gc broadcast over the key dims.
#include "gla_chunk.cuh"

namespace flexc_gla {

// 16 warps: four per 16-row block w, each a quarter of the columns of dq, dk and dv (the
// kernel is latency-bound: one CTA per SM fits its shared memory, so it brings its own warps).
constexpr int kBwdThreads = 512;
using ATile = SmemTile<kChunk, kChunk>;  // A and dA, rows i, columns j
// Column factor rows: cf for the 6 block pairs I > J, then 2^gc_f per block (dq's state part),
// then 2^(G - gc_e) per block (dk's).
constexpr int kFactorRows = 6 + 4 + 4;
__device__ __forceinline__ int pair_row(int I, int J) { return I * (I - 1) / 2 + J; }
constexpr int kBwdSmem = 4 * QTile::kBytes + 2 * VTile::kBytes + 2 * STile::kBytes +
                         2 * ATile::kBytes + (kScalar ? kChunk : kChunk * kGcStride) * 4 +
                         kFactorRows * kDK * 4 + 128 + kDK * 4;

// gc at (row r, key dims d, d + 1), and at (r, d): one gate per step broadcasts.
__device__ __forceinline__ float2 gc2(const float* gc, int r, int d) {
  if constexpr (kScalar) {
    return make_float2(gc[r], gc[r]);
  } else {
    return *reinterpret_cast<const float2*>(gc + r * kGcStride + d);
  }
}
__device__ __forceinline__ float gc1(const float* gc, int r, int d) {
  return kScalar ? gc[r] : gc[r * kGcStride + d];
}

__device__ __forceinline__ void store16(void* base, long long at, float v) {
  static_cast<unsigned short*>(base)[at] =
      static_cast<unsigned short>(pack2<kBf16>(v, 0.f) & 0xffffu);
}

// acc += s * cf[column] * part, over a warp's C fragments of columns [0, 8 NT) of a row of
// column factors cf.
template <int NT>
__device__ __forceinline__ void add_scaled(float (&acc)[1][NT][4], const float (&part)[1][NT][4],
                                           const float* cf, float s) {
  const int t4 = threadIdx.x % 4;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const float2 c = *reinterpret_cast<const float2*>(cf + j * 8 + 2 * t4);
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[0][j][e] += s * (e & 1 ? c.y : c.x) * part[0][j][e];
  }
}

// acc += a B over columns [col0, col0 + 8 NT), B rows [row0, row0 + 16) of a [k][n] tile of
// key dims; with cf (a block off the diagonal) the product is scaled per column by cf first.
template <int NT>
__device__ __forceinline__ void add_block(float (&acc)[1][NT][4], const unsigned (&a)[1][4],
                                          unsigned tile, int row0, int col0, const float* cf) {
  const FragAddr<QTile> frag = FragAddr<QTile>::b_kn();
  const auto load_b = [&](unsigned(&bf)[4], int nn) {
    ldmatrix_x4_trans(bf, frag(tile, row0, (col0 + nn) / 8));
  };
  if (!cf) {
    mma_rows<kBf16>(acc, a, load_b);
    return;
  }
  float part[1][NT][4];
  zero_fragments(part);
  mma_rows<kBf16>(part, a, load_b);
  add_scaled(acc, part, cf + col0, 1.f);
}

// The state's part of dq (x = dO, the chunk start state) or dk (x = v, the state gradient):
// acc += s * cf[column] * (x_w state^T) over columns [col0, col0 + 8 NT).
template <int NT>
__device__ __forceinline__ void add_state_part(float (&acc)[1][NT][4], unsigned x_tile, int w,
                                               unsigned state_tile, int col0, const float* cf,
                                               float s) {
  const FragAddr<VTile> frag_a = FragAddr<VTile>::a();
  const FragAddr<STile> frag_b = FragAddr<STile>::b_nk();
  float part[1][NT][4];
  zero_fragments(part);
#pragma unroll
  for (int kk = 0; kk < kDV; kk += 16) {
    unsigned a[1][4];
    ldmatrix_x4(a[0], frag_a(x_tile, w * kSub, kk / 8));
    mma_rows<kBf16>(part, a, [&](unsigned(&bf)[4], int nn) {
      ldmatrix_x4(bf, frag_b(state_tile, col0 + nn, kk / 8));
    });
  }
  add_scaled(acc, part, cf + col0, s);
}

// Each row of the warp's C fragments times 2^(sign (gc_i - gc_ref)) at its column (the row
// factor that ends dq, sign 1, and dk, sign -1).
template <int NT>
__device__ __forceinline__ void scale_rows(float (&acc)[1][NT][4], const float* gc, int w, int col0,
                                           int ref, float sign) {
  const int lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int i = w * kSub + g + 8 * r, d = col0 + j * 8 + 2 * t4;
      const float2 gi = gc2(gc, i, d), gr = gc2(gc, ref, d);
      acc[0][j][2 * r] *= exp2_approx(sign * (gi.x - gr.x));
      acc[0][j][2 * r + 1] *= exp2_approx(sign * (gi.y - gr.y));
    }
}

// v into the C fragment element of column `col` (0 .. 8 NT) of row half r, for lanes holding
// that column: selects over the unrolled fragment, no indexed (local-memory) array.
template <int NT>
__device__ __forceinline__ void add_at_column(float (&acc)[1][NT][4], int col, int r, float v) {
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e)
      if (j * 8 + 2 * (threadIdx.x % 4) + e == col) acc[0][j][2 * r + e] += v;
}

// The steep key dims of block w in this warp's columns [col0, col0 + 8 NT): their exact terms,
// sums over the block's rows u of dA x(u, d) 2^(gc_i - gc_j) for this lane's rows: dq (x = k,
// u = j <= i) or dk (x = q, u = i >= j).
template <bool kRowsAreQ, int NT>
__device__ __forceinline__ void add_steep(float (&acc)[1][NT][4], const FlexcGlaParams& p,
                                          const unsigned* steep, unsigned char* da_tile,
                                          const float* gc, const unsigned short* xp,
                                          long long x_stride, int w, int col0, int t0) {
  const int lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
#pragma unroll
  for (int word = 0; word < kMaskWords; ++word) {
    const int lo = max(col0 - word * 32, 0), hi = min(col0 + NT * 8 - word * 32, 32);
    if (lo >= hi) continue;
    const unsigned range = (hi == 32 ? ~0u : (1u << hi) - 1) & ~((1u << lo) - 1);
    for (unsigned bits = steep[w * kMaskWords + word] & range; bits; bits &= bits - 1) {
      const int d = word * 32 + __ffs(bits) - 1, col = d - col0;
      if (t4 != col % 8 / 2) continue;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = w * kSub + g + 8 * r;  // dq: row i; dk: row j
        float s = 0.f;
        for (int u = w * kSub; u < w * kSub + kSub; ++u) {
          const int i = kRowsAreQ ? row : u, j = kRowsAreQ ? u : row;
          if (j > i || t0 + u >= p.seq_len) continue;
          const float dA = unpack_lo<kBf16>(*elem<ATile>(da_tile, i, j));
          const float x = unpack_lo<kBf16>(__ldg(xp + (t0 + u) * x_stride + d));
          s += dA * x * exp2_approx(gc1(gc, i, d) - gc1(gc, j, d));
        }
        add_at_column(acc, col, r, s);
      }
    }
  }
}

// A warp's rows (16 w ...) x columns [col0, col0 + 8 NT) of a gradient: in the input type at
// `base` (row stride `stride`), or float32 rows of `width` at `base32` (k and v heads shared:
// summed by flexc_gla_reduce).
template <int NT>
__device__ __forceinline__ void store_rows(const float (&acc)[1][NT][4], int t0, int w, int col0,
                                           int seq_len, unsigned short* base, long long stride,
                                           float* base32, int width) {
  const int lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int t = t0 + w * kSub + g + 8 * r;
    if (t >= seq_len) continue;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int c = col0 + j * 8 + 2 * t4;
      if (base32) {
        *reinterpret_cast<float2*>(base32 + static_cast<long long>(t) * width + c) =
            make_float2(acc[0][j][2 * r], acc[0][j][2 * r + 1]);
      } else {
        *reinterpret_cast<unsigned*>(base + t * stride + c) =
            pack2<kBf16>(acc[0][j][2 * r], acc[0][j][2 * r + 1]);
      }
    }
  }
}

}  // namespace flexc_gla

// ---- Per chunk: grid (chunks, heads, batch), 512 threads: sixteen warps, four per 16-row block
// w. Quarters 0 and 1 compute dA's blocks (w, J) for J in {0, 1} and {2, 3} (J <= w), quarters 2
// and 3 A's, into shared memory; then each quarter takes a quarter of the columns of dq, dk and
// dv for rows w. Dynamic shared memory kBwdSmem (host: gla_backward_smem).
extern "C" __global__ void __launch_bounds__(flexc_gla::kBwdThreads, 1)
    flexc_gla_backward(const FlexcGlaBwdParams bp) {
  using namespace flexc_gla;
  const FlexcGlaParams& p = bp.f;
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* qc_tile = smem;                     // q, then Qcheck in place
  unsigned char* kc_tile = qc_tile + QTile::kBytes;  // k, then Kcheck in place
  unsigned char* qh_tile = kc_tile + QTile::kBytes;
  unsigned char* kh_tile = qh_tile + QTile::kBytes;
  unsigned char* v_tile = kh_tile + QTile::kBytes;
  unsigned char* do_tile = v_tile + VTile::kBytes;
  unsigned char* s_tile = do_tile + VTile::kBytes;  // S_n
  unsigned char* d_tile = s_tile + STile::kBytes;   // D_n
  unsigned char* a_tile = d_tile + STile::kBytes;
  unsigned char* da_tile = a_tile + ATile::kBytes;
  float* gc = reinterpret_cast<float*>(da_tile + ATile::kBytes);
  float* fac = gc + (kScalar ? kChunk : kChunk * kGcStride);
  unsigned* steep = reinterpret_cast<unsigned*>(fac + kFactorRows * kDK);
  float* db_sum = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(steep) + 128);

  const int n = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int t0 = n * kChunk;
  const int tid = threadIdx.x, warp = tid / 32, w = warp % 4, quarter = warp / 4;
  const int lane = tid % 32, g = lane / 4, t4 = lane % 4;
  const long long bh = static_cast<long long>(b) * p.heads + h;
  const HeadRows x = head_rows(p, b, h);
  const unsigned short* dop =
      static_cast<const unsigned short*>(bp.dout) + b * bp.dout_stride[0] + h * bp.dout_stride[1];
  const long long chunk_state = (bh * p.chunks + n) * kDK * kDV;
  TileCopy<QTile, kBwdThreads>()(smem_addr(qc_tile), x.q, p.q_stride[2], t0, p.seq_len);
  TileCopy<QTile, kBwdThreads>()(smem_addr(kc_tile), x.k, p.k_stride[2], t0, p.seq_len);
  TileCopy<VTile, kBwdThreads>()(smem_addr(v_tile), x.v, p.v_stride[2], t0, p.seq_len);
  TileCopy<VTile, kBwdThreads>()(smem_addr(do_tile), dop, bp.dout_stride[2], t0, p.seq_len);
  TileCopy<STile, kBwdThreads>()(
      smem_addr(s_tile), static_cast<const unsigned short*>(p.states) + chunk_state, kDV, 0, kDK);
  TileCopy<STile, kBwdThreads>()(
      smem_addr(d_tile), static_cast<const unsigned short*>(bp.dstates) + chunk_state, kDV, 0, kDK);
  copy_gc<kBwdThreads>(gc, p, b, h, n);
  cp_async_commit();
  if (tid < kDK) db_sum[tid] = 0.f;
  cp_async_wait<0>();
  __syncthreads();

  // The steep dims of each block (one key dim per thread) and the column factors.
  if (tid < kDK) {
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const float fall = gc1(gc, s * kSub, tid) - gc1(gc, s * kSub + kSub - 1, tid);
      const unsigned m = __ballot_sync(0xffffffffu, fall > kSteep);
      if (lane == 0) steep[s * kMaskWords + warp] = m;
    }
  }
  for (int e = tid; e < kFactorRows * kDK; e += kBwdThreads) {
    const int row = e / kDK, d = e % kDK;
    float y;
    if (row < 6) {  // pair_row(I, J) = row
      const int I = row < 1 ? 1 : row < 3 ? 2 : 3, J = row - pair_row(I, 0);
      y = gc1(gc, I * kSub, d) - gc1(gc, J * kSub + kSub - 1, d);
    } else if (row < 10) {
      y = gc1(gc, (row - 6) * kSub, d);
    } else {
      y = gc1(gc, kChunk - 1, d) - gc1(gc, (row - 10) * kSub + kSub - 1, d);
    }
    fac[e] = exp2_approx(y);
  }
  __syncthreads();

  // Qhat, Khat, and Qcheck, Kcheck in place of q and k, two adjacent key dims at a time.
  for (int e = tid; e < kChunk * kDK / 2; e += kBwdThreads) {
    const int r = e / (kDK / 2), d = e % (kDK / 2) * 2, s = r / kSub;
    unsigned* qq = pair<QTile>(qc_tile, r, d);
    unsigned* kk = pair<QTile>(kc_tile, r, d);
    const float q0 = unpack_lo<kBf16>(*qq), q1 = unpack_hi<kBf16>(*qq);
    const float k0 = unpack_lo<kBf16>(*kk), k1 = unpack_hi<kBf16>(*kk);
    const float2 gr = gc2(gc, r, d), gf = gc2(gc, s * kSub, d),
                 ge = gc2(gc, s * kSub + kSub - 1, d);
    const unsigned m = steep[s * kMaskWords + d / 32] >> (d % 32);
    *pair<QTile>(qh_tile, r, d) =
        pack2<kBf16>(q0 * exp2_approx(gr.x - gf.x), q1 * exp2_approx(gr.y - gf.y));
    *pair<QTile>(kh_tile, r, d) =
        pack2<kBf16>(k0 * exp2_approx(ge.x - gr.x), k1 * exp2_approx(ge.y - gr.y));
    *qq = pack2<kBf16>(m & 1 ? 0.f : q0 * exp2_approx(gr.x - ge.x),
                       m & 2 ? 0.f : q1 * exp2_approx(gr.y - ge.y));
    *kk = pack2<kBf16>(m & 1 ? 0.f : k0 * exp2_approx(gf.x - gr.x),
                       m & 2 ? 0.f : k1 * exp2_approx(gf.y - gr.y));
  }
  __syncthreads();

  const unsigned qct = smem_addr(qc_tile), kct = smem_addr(kc_tile), qht = smem_addr(qh_tile),
                 kht = smem_addr(kh_tile), vt = smem_addr(v_tile), dot = smem_addr(do_tile),
                 stt = smem_addr(s_tile), dtt = smem_addr(d_tile), att = smem_addr(a_tile),
                 dat = smem_addr(da_tile);
  const FragAddr<QTile> q_a = FragAddr<QTile>::a(), q_nk = FragAddr<QTile>::b_nk();
  const FragAddr<VTile> v_a = FragAddr<VTile>::a(), v_nk = FragAddr<VTile>::b_nk(),
                        v_kn = FragAddr<VTile>::b_kn();
  const FragAddr<STile> s_kn = FragAddr<STile>::b_kn();
  const FragAddr<ATile> a_a = FragAddr<ATile>::a(), a_km = FragAddr<ATile>::a_km();
  const float scale = p.scale;

  // ---- dA (quarters 0, 1) or A (quarters 2, 3): blocks (w, J), J in {J0, J0 + 1}, J <= w.
  {
    const bool is_a = quarter >= 2;
    const int J0 = quarter % 2 * 2;
    float c[1][4][4];
    zero_fragments(c);
    if (!is_a) {
#pragma unroll
      for (int kk = 0; kk < kDV; kk += 16) {
        unsigned a[4];
        ldmatrix_x4(a, v_a(dot, w * kSub, kk / 8));
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
          const int J = J0 + jj;
          if (J > w) continue;
          unsigned bf[4];
          ldmatrix_x4(bf, v_nk(vt, J * kSub, kk / 8));
          mma_16816<kBf16>(c[0][2 * jj], a, bf[0], bf[1]);
          mma_16816<kBf16>(c[0][2 * jj + 1], a, bf[2], bf[3]);
        }
      }
    } else {
#pragma unroll
      for (int kk = 0; kk < kDK; kk += 16) {
        unsigned a[4];
        ldmatrix_x4(a, q_a(qht, w * kSub, kk / 8));
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
          const int J = J0 + jj;
          if (J > w) continue;
          unsigned bf[4];
          if (J == w) {
            ldmatrix_x4(bf, q_nk(kct, J * kSub, kk / 8));
            mma_16816<kBf16>(c[0][2 * jj], a, bf[0], bf[1]);
            mma_16816<kBf16>(c[0][2 * jj + 1], a, bf[2], bf[3]);
          } else {
            // Qhat_w cf[w][J]: the factor is per key dim, so it scales the operand.
            const float* cf = fac + pair_row(w, J) * kDK + kk + 2 * t4;
            unsigned as[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float2 f = *reinterpret_cast<const float2*>(cf + (e >> 1) * 8);
              as[e] = pack2<kBf16>(unpack_lo<kBf16>(a[e]) * f.x, unpack_hi<kBf16>(a[e]) * f.y);
            }
            ldmatrix_x4(bf, q_nk(kht, J * kSub, kk / 8));
            mma_16816<kBf16>(c[0][2 * jj], as, bf[0], bf[1]);
            mma_16816<kBf16>(c[0][2 * jj + 1], as, bf[2], bf[3]);
          }
        }
      }
      // A's diagonal block: the steep dims exactly (q and k from global memory: the tiles hold
      // the checked operands).
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {
        if (J0 + jj != w) continue;
#pragma unroll
        for (int word = 0; word < kMaskWords; ++word) {
          for (unsigned bits = steep[w * kMaskWords + word]; bits; bits &= bits - 1) {
            const int d = word * 32 + __ffs(bits) - 1;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
              const int i = w * kSub + g + (e >> 2) * 8;
              const int j = w * kSub + (e & 3) / 2 * 8 + 2 * t4 + (e & 1);
              if (j > i || t0 + i >= p.seq_len) continue;
              const float qi = unpack_lo<kBf16>(__ldg(x.q + (t0 + i) * p.q_stride[2] + d));
              const float kj = unpack_lo<kBf16>(__ldg(x.k + (t0 + j) * p.k_stride[2] + d));
              c[0][2 * jj + (e & 3) / 2][(e >> 2) * 2 + (e & 1)] +=
                  qi * kj * exp2_approx(gc1(gc, i, d) - gc1(gc, j, d));
            }
          }
        }
      }
    }
    // Scaled, causal inside the diagonal block, into A's or dA's tile (blocks right of the
    // diagonal are never read).
    unsigned char* tile = is_a ? a_tile : da_tile;
#pragma unroll
    for (int jj = 0; jj < 2; ++jj) {
      if (J0 + jj > w) continue;
#pragma unroll
      for (int h8 = 0; h8 < 2; ++h8)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int i = w * kSub + g + 8 * r, j = (J0 + jj) * kSub + h8 * 8 + 2 * t4;
          const float* v = c[0][2 * jj + h8] + 2 * r;
          *pair<ATile>(tile, i, j) =
              pack2<kBf16>(j > i ? 0.f : v[0] * scale, j + 1 > i ? 0.f : v[1] * scale);
        }
    }
  }
  __syncthreads();

  constexpr int kNK = kDK / 32;  // n8 tiles of a warp's quarter of the key dims
  const int col0 = quarter * (kDK / 4);
  float acc[1][kNK][4], db[1][kNK][4];

  // ---- dq, rows w.
  zero_fragments(acc);
#pragma unroll
  for (int J = 0; J < 4; ++J) {
    if (J > w) continue;
    unsigned a[1][4];
    ldmatrix_x4(a[0], a_a(dat, w * kSub, 2 * J));  // dA_wJ
    add_block(acc, a, J == w ? kct : kht, J * kSub, col0,
              J == w ? nullptr : fac + pair_row(w, J) * kDK);
  }
  add_state_part(acc, dot, w, stt, col0, fac + (6 + w) * kDK, scale);
  scale_rows(acc, gc, w, col0, w * kSub, 1.f);
  add_steep<true>(acc, p, steep, da_tile, gc, x.k, p.k_stride[2], w, col0, t0);
  store_rows(acc, t0, w, col0, p.seq_len,
             static_cast<unsigned short*>(bp.dq) + b * bp.dq_stride[0] + h * bp.dq_stride[1],
             bp.dq_stride[2], nullptr, kDK);
  // db = q dq - k dk, from the inputs (the tiles hold the scaled operands).
  auto db_add = [&](const unsigned short* xp, long long stride, float sign) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int t = t0 + w * kSub + g + 8 * r;
#pragma unroll
      for (int j = 0; j < kNK; ++j) {
        const unsigned v =
            t < p.seq_len
                ? __ldg(reinterpret_cast<const unsigned*>(xp + t * stride + col0 + j * 8 + 2 * t4))
                : 0u;
        db[0][j][2 * r] += sign * unpack_lo<kBf16>(v) * acc[0][j][2 * r];
        db[0][j][2 * r + 1] += sign * unpack_hi<kBf16>(v) * acc[0][j][2 * r + 1];
      }
    }
  };
  zero_fragments(db);
  if constexpr (kGate != 0) db_add(x.q, p.q_stride[2], 1.f);

  // ---- dk, rows w.
  zero_fragments(acc);
#pragma unroll
  for (int I = 0; I < 4; ++I) {
    if (I < w) continue;
    unsigned a[1][4];
    ldmatrix_x4_trans(a[0], a_km(dat, I * kSub, 2 * w));  // dA_Iw^T
    add_block(acc, a, I == w ? qct : qht, I * kSub, col0,
              I == w ? nullptr : fac + pair_row(I, w) * kDK);
  }
  add_state_part(acc, vt, w, dtt, col0, fac + (10 + w) * kDK, 1.f);
  scale_rows(acc, gc, w, col0, w * kSub + kSub - 1, -1.f);
  add_steep<false>(acc, p, steep, da_tile, gc, x.q, p.q_stride[2], w, col0, t0);
  const bool grouped = p.k_heads != p.heads;
  store_rows(acc, t0, w, col0, p.seq_len,
             static_cast<unsigned short*>(bp.dk) + b * bp.dk_stride[0] +
                 h / (p.heads / p.k_heads) * bp.dk_stride[1],
             bp.dk_stride[2], grouped ? bp.dk32 + bh * p.seq_len * kDK : nullptr, kDK);
  if constexpr (kGate != 0) db_add(x.k, p.k_stride[2], -1.f);

  // ---- dv, rows w: A^T dO over the row blocks I >= w, and Kend_w D_n (Kend from the
  // workspace, its A fragments straight from global memory).
  constexpr int kNV = kDV / 32;
  const int vcol0 = quarter * (kDV / 4);
  float dv[1][kNV][4];
  zero_fragments(dv);
#pragma unroll
  for (int I = 0; I < 4; ++I) {
    if (I < w) continue;
    unsigned a[1][4];
    ldmatrix_x4_trans(a[0], a_km(att, I * kSub, 2 * w));  // A_Iw^T
    mma_rows<kBf16>(dv, a, [&](unsigned(&bf)[4], int nn) {
      ldmatrix_x4_trans(bf, v_kn(dot, I * kSub, (vcol0 + nn) / 8));
    });
  }
  const unsigned short* kend =
      static_cast<const unsigned short*>(p.khat) + (bh * p.chunks * kChunk + t0 + w * kSub) * kDK;
#pragma unroll
  for (int kk = 0; kk < kDK; kk += 16) {
    unsigned a[1][4];
#pragma unroll
    for (int e = 0; e < 4; ++e)
      a[0][e] = __ldg(reinterpret_cast<const unsigned*>(kend + (g + (e & 1) * 8) * kDK + kk +
                                                        2 * t4 + (e >> 1) * 8));
    mma_rows<kBf16>(dv, a, [&](unsigned(&bf)[4], int nn) {
      ldmatrix_x4_trans(bf, s_kn(dtt, kk, (vcol0 + nn) / 8));
    });
  }
  store_rows(dv, t0, w, vcol0, p.seq_len,
             static_cast<unsigned short*>(bp.dv) + b * bp.dv_stride[0] +
                 h / (p.heads / p.k_heads) * bp.dv_stride[1],
             bp.dv_stride[2], grouped ? bp.dv32 + bh * p.seq_len * kDV : nullptr, kDV);

  // ---- db for the gates: per token, and summed over the chunk's rows.
  if constexpr (kGate != 0) {
    float* dbp = bp.db + (bh * p.chunks * kChunk + t0) * kDK;
#pragma unroll
    for (int j = 0; j < kNK; ++j) {
      const int c = col0 + j * 8 + 2 * t4;
#pragma unroll
      for (int r = 0; r < 2; ++r)
        *reinterpret_cast<float2*>(dbp + (w * kSub + g + 8 * r) * kDK + c) =
            make_float2(db[0][j][2 * r], db[0][j][2 * r + 1]);
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float s = db[0][j][e] + db[0][j][e + 2];
        s += __shfl_xor_sync(0xffffffffu, s, 4);
        s += __shfl_xor_sync(0xffffffffu, s, 8);
        s += __shfl_xor_sync(0xffffffffu, s, 16);
        if (g == 0) atomicAdd(db_sum + c + e, s);
      }
    }
    __syncthreads();
    if (tid < kDK) bp.db_sums[(bh * p.chunks + n) * kDK + tid] = db_sum[tid];
  }
}

// ---- db_sums[n] := the sum of db over the chunks after n, plus sum_e S_T dS_T (the final
// state's term) per key dim. Grid (heads, batch), kDK threads: a key dim each, the chunks in
// batches of loads.
extern "C" __global__ void __launch_bounds__(128) flexc_gla_dg_scan(const FlexcGlaBwdParams bp) {
  using namespace flexc_gla;
  const FlexcGlaParams& p = bp.f;
  const int h = blockIdx.x, b = blockIdx.y, d = threadIdx.x;
  const long long bh = static_cast<long long>(b) * p.heads + h;
  float run = 0.f;
  if (bp.dht) {
    const float* st = p.ht + (bh * kDK + d) * kDV;
    const float* ds = bp.dht + (bh * kDK + d) * kDV;
    for (int e = 0; e < kDV; ++e) run += st[e] * ds[e];
  }
  float* sums = bp.db_sums + bh * p.chunks * kDK + d;
  constexpr int kBatch = 8;
  for (int m0 = p.chunks - 1; m0 >= 0; m0 -= kBatch) {
    float x[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) x[i] = m0 - i >= 0 ? sums[(m0 - i) * kDK] : 0.f;
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      if (m0 - i < 0) break;
      sums[(m0 - i) * kDK] = run;
      run += x[i];
    }
  }
}

// ---- dg_t = the running sum of db from the sequence's end, in g's type and strides (0 where
// the gate was clamped at -1e4: no gradient there); g [batch, heads, seq] (dg_sum_dims) sums
// the key dims. Grid (chunks, heads, batch), kDK threads.
extern "C" __global__ void __launch_bounds__(128) flexc_gla_dg(const FlexcGlaBwdParams bp) {
  using namespace flexc_gla;
  const FlexcGlaParams& p = bp.f;
  __shared__ float row_sums[kChunk][kDK / 32];
  const int n = blockIdx.x, h = blockIdx.y, b = blockIdx.z, d = threadIdx.x, t0 = n * kChunk;
  const long long bh = static_cast<long long>(b) * p.heads + h;
  float run = bp.db_sums[(bh * p.chunks + n) * kDK + d];
  const float* dbp = bp.db + (bh * p.chunks * kChunk + t0) * kDK + d;
  auto write = [&](int t, int dim, float v) {
    const long long at =
        b * bp.dg_stride[0] + h * bp.dg_stride[1] + t * bp.dg_stride[2] + dim * bp.dg_stride[3];
    const float x = gate_raw(p, b, h, t, dim);
    v = x > -1.0e4f ? v : 0.f;
    if (bp.dg_type == 1) {
      static_cast<float*>(bp.dg)[at] = v;
    } else if (bp.dg_type == 2) {
      static_cast<unsigned short*>(bp.dg)[at] =
          static_cast<unsigned short>(pack2<true>(v, 0.f) & 0xffffu);
    } else {
      static_cast<unsigned short*>(bp.dg)[at] =
          static_cast<unsigned short>(pack2<false>(v, 0.f) & 0xffffu);
    }
  };
  const bool sum_dims = bp.dg_sum_dims != 0;
#pragma unroll 8
  for (int r = kChunk - 1; r >= 0; --r) {
    run += dbp[r * kDK];
    if (sum_dims) {
      float s = run;
#pragma unroll
      for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
      if (d % 32 == 0) row_sums[r][d / 32] = s;
    } else if (t0 + r < p.seq_len) {
      write(t0 + r, d, run);
    }
  }
  if (sum_dims) {
    __syncthreads();
    if (d < kChunk && t0 + d < p.seq_len) {
      float s = 0.f;
#pragma unroll
      for (int i = 0; i < kDK / 32; ++i) s += row_sums[d][i];
      write(t0 + d, 0, s);
    }
  }
}

// ---- k and v heads shared by several q heads (k_heads < heads): their gradients are the sums of
// the per-q-head float32 ones. Grid (seq_len, k_heads, batch), 128 threads: a column each.
extern "C" __global__ void __launch_bounds__(128) flexc_gla_reduce(const FlexcGlaBwdParams bp) {
  using namespace flexc_gla;
  const FlexcGlaParams& p = bp.f;
  const int t = blockIdx.x, hk = blockIdx.y, b = blockIdx.z, c = threadIdx.x;
  const int group = p.heads / p.k_heads;
  const long long row0 = (static_cast<long long>(b) * p.heads + hk * group) * p.seq_len + t;
  float sk = 0.f, sv = 0.f;
  for (int i = 0; i < group; ++i) {
    const long long row = row0 + static_cast<long long>(i) * p.seq_len;
    if (c < kDK) sk += bp.dk32[row * kDK + c];
    if (c < kDV) sv += bp.dv32[row * kDV + c];
  }
  if (c < kDK)
    store16(bp.dk, b * bp.dk_stride[0] + hk * bp.dk_stride[1] + t * bp.dk_stride[2] + c, sk);
  if (c < kDV)
    store16(bp.dv, b * bp.dv_stride[0] + hk * bp.dv_stride[1] + t * bp.dv_stride[2] + c, sv);
}
