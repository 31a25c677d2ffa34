// Forward attention for Hopper (sm_90a): the products on wgmma, everything else shared with the
// portable kernel (attention_tile.cuh: BlockMask schedule, hooks, epilogue; online_softmax.cuh).
//
// One CTA of two warpgroups per (128-row q tile, query head, batch); warpgroup w owns q rows
// 64 w .. 64 w + 63. Q, K and V sit in shared memory in wgmma's 128-byte-swizzled layout, filled
// by cp.async from all 256 threads (any strides, zero rows past the lengths). K and V each have
// two stages. Per kv tile j, a warpgroup issues S_j = Q.K_j^T and O += P_{j-1}.V_{j-1}
// back to back, then runs the hooks and the online softmax of S_j while the tensor cores still
// work on P_{j-1}.V_{j-1} (FlashAttention-3's intra-warpgroup overlap); P never leaves
// registers (wgmma takes A from registers in the layout the softmax leaves it in).
//
// Copies, per iteration j (one barrier): wait for K_j and V_{j-1}, then issue V_j and K_{j+1}
// into the stages S_{j-1} and P_{j-2}.V_{j-2} have finished with.
//
// Compile-time configuration: FLEXC_HEAD_DIM (64 or 128), FLEXC_BF16, FLEXC_BLOCK_N (64 or 128).
#include "attention_tile.cuh"
#include "online_softmax.cuh"
#include "tile_wgmma.cuh"

namespace flexc_fwd90 {

using namespace flexc_tile;
using flexc_attn::at;

constexpr int kD = FLEXC_HEAD_DIM;
constexpr bool kBf16 = FLEXC_BF16 != 0;
constexpr int kBlockM = 128;
constexpr int kBlockN = FLEXC_BLOCK_N;
constexpr int kThreads = 256;
constexpr int kNT = kBlockN / 8;  // n8 column tiles of S per warp
constexpr int kDT = kD / 8;       // n8 column tiles of O per warp

static_assert(kD == 64 || kD == 128, "head dim 64 or 128");
static_assert(kBlockN == 64 || kBlockN == 128, "kv tile 64 or 128");

using QTile = Sw128Tile<kBlockM, kD>;
using KvTile = Sw128Tile<kBlockN, kD>;
// Shared memory: Q, K[2], V[2], each 1024-byte aligned (sizes are multiples of 1024). The host
// adds 1024 bytes for aligning the dynamic shared-memory base.
constexpr int kSmemBytes = QTile::kBytes + 4 * KvTile::kBytes;

using KvSchedule = flexc_attn::KvSchedule<kBlockN>;
using Scores = flexc_attn::ScoreTile<1, kNT>;

// S = Q.K^T for the warpgroup's 64 rows (`q_rows` is its first row in the Q tile).
__device__ __forceinline__ void issue_qk(float (&s)[kNT][4], unsigned q_tile, int q_rows,
                                         unsigned k_tile) {
  wgmma_ss<kBf16, 0>(s, QTile::k_major(q_tile, q_rows, 0), KvTile::k_major(k_tile, 0, 0));
#pragma unroll
  for (int kk = 16; kk < kD; kk += 16) {
    wgmma_ss<kBf16, 1>(s, QTile::k_major(q_tile, q_rows, kk), KvTile::k_major(k_tile, 0, kk));
  }
  wgmma_commit();
}

// O += P.V; P in registers as A fragments, one per 16 kv columns.
__device__ __forceinline__ void issue_pv(float (&o)[kDT][4], const unsigned (&pa)[kNT / 2][4],
                                         unsigned v_tile) {
#pragma unroll
  for (int kk = 0; kk < kNT / 2; ++kk) wgmma_rs<kBf16>(o, pa[kk], KvTile::mn_major(v_tile, kk * 16));
  wgmma_commit();
}

// Softmax probabilities -> the A fragments of P.V (rounded to the input type).
__device__ __forceinline__ void pack_p(const float (&s)[kNT][4], unsigned (&pa)[kNT / 2][4]) {
#pragma unroll
  for (int kk = 0; kk < kNT / 2; ++kk) {
    pa[kk][0] = pack2<kBf16>(s[2 * kk][0], s[2 * kk][1]);
    pa[kk][1] = pack2<kBf16>(s[2 * kk][2], s[2 * kk][3]);
    pa[kk][2] = pack2<kBf16>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    pa[kk][3] = pack2<kBf16>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
  }
}

}  // namespace flexc_fwd90

extern "C" __global__ void __launch_bounds__(flexc_fwd90::kThreads, 1)
    flexc_attention_fwd_sm90(const FlexcAttentionParams p, const FlexcArgs args,
                             const FlexcBlockMask bm) {
  using namespace flexc_fwd90;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // The declared alignment is not promised for dynamic shared memory: align by hand.
  const unsigned raw = smem_addr(smem_raw);
  const unsigned q_tile = (raw + 1023) & ~1023u;
  unsigned char* smem = smem_raw + (q_tile - raw);
  auto k_tile = [&](int stage) { return q_tile + QTile::kBytes + stage * KvTile::kBytes; };
  auto v_tile = [&](int stage) { return k_tile(2) + stage * KvTile::kBytes; };

  // Heaviest q tiles first: under a causal mask the last ones visit the most kv tiles.
  const int m_block = gridDim.x - 1 - blockIdx.x;
  const int h = blockIdx.y, b = blockIdx.z;
  const int h_kv = h / (p.q_heads / p.kv_heads);
  const int q0 = m_block * kBlockM;
  const int wg = threadIdx.x >> 7, warp = threadIdx.x >> 5;
  const int q_rows = wg * 64;            // the warpgroup's first row in the Q tile
  const int row0 = q0 + warp * 16;       // this warp's first query row

  const auto* q = at<unsigned short>(p.q, p.q_stride, b, h);
  const auto* k = at<unsigned short>(p.k, p.k_stride, b, h_kv);
  const auto* v = at<unsigned short>(p.v, p.v_stride, b, h_kv);
  const KvSchedule sched(bm, b, h, q0, p.kv_len);
  const int count = sched.count;
  KvSchedule::Cursor fetch_k, fetch_v, cur;  // next K to load, next V to load, next S to compute

  const TileCopy<KvTile, kThreads> copy_kv;
  auto load_k = [&](int j) {
    if (j < count) {
      copy_kv(k_tile(j & 1), k, p.k_stride[2], sched.start(fetch_k), p.kv_len);
      sched.advance(fetch_k);
    }
  };
  auto load_v = [&](int j) {
    if (j < count) {
      copy_kv(v_tile(j & 1), v, p.v_stride[2], sched.start(fetch_v), p.kv_len);
      sched.advance(fetch_v);
    }
  };
  // Copies by all threads land for all: each waits for its own, then fences them for the async
  // proxy (wgmma) and meets the others.
  auto copies_landed = [] {
    cp_async_wait<0>();
    fence_async_shared();
    __syncthreads();
  };

  float o[1][kDT][4];  // one row tile per warp: the shape OnlineSoftmax and store_rows take
  float s[1][kNT][4];
  unsigned pa[kNT / 2][4];
  zero_fragments(o);
  OnlineSoftmax<1, kNT> softmax;
  softmax.init();
  const float to_log2 = flexc_attn::units_log2(p);

  // Hooks and softmax of tile `cur` (in s, left as probabilities); returns whether O must be
  // rescaled by alpha. P is packed for wgmma only once the previous P.V is done: registers a
  // running wgmma reads must not change (ptxas would serialize every wgmma to protect them).
  auto softmax_step = [&](float (&alpha)[1][2]) {
    Scores::apply_mods(s, p, args, b, h, row0, sched.start(cur), sched.is_partial(cur));
    sched.advance(cur);
    return softmax.step(s, to_log2, alpha);
  };

  TileCopy<QTile, kThreads>()(q_tile, q, p.q_stride[2], q0, p.q_len);
  load_k(0);
  cp_async_commit();
  load_v(0);
  load_k(1);
  cp_async_commit();
  if (count > 0) {
    cp_async_wait<1>();  // Q and K_0
    fence_async_shared();
    __syncthreads();
    wgmma_fence();
    issue_qk(s[0], q_tile, q_rows, k_tile(0));
    wgmma_wait<0>();
    fence_regs(s[0]);
    float alpha[1][2];
    softmax_step(alpha);  // O is still 0: nothing to rescale
    pack_p(s[0], pa);
  }
  for (int j = 1; j < count; ++j) {
    copies_landed();  // K_j, V_{j-1}; every warpgroup is done with K_{j-1} and V_{j-2}
    load_v(j);
    load_k(j + 1);
    cp_async_commit();
    fence_regs(pa);
    fence_regs(o[0]);
    wgmma_fence();
    issue_qk(s[0], q_tile, q_rows, k_tile(j & 1));
    issue_pv(o[0], pa, v_tile((j - 1) & 1));
    wgmma_wait<1>();  // S_j
    fence_regs(s[0]);
    float alpha[1][2];
    const bool rescale = softmax_step(alpha);
    wgmma_wait<0>();  // P_{j-1}.V_{j-1}
    fence_regs(o[0]);
    if (rescale) {
#pragma unroll
      for (int d = 0; d < kDT; ++d) {
        o[0][d][0] *= alpha[0][0];
        o[0][d][1] *= alpha[0][0];
        o[0][d][2] *= alpha[0][1];
        o[0][d][3] *= alpha[0][1];
      }
    }
    pack_p(s[0], pa);
  }
  copies_landed();  // V of the last tile (and Q, when no tile was visited)
  if (count > 0) {
    wgmma_fence();
    issue_pv(o[0], pa, v_tile((count - 1) & 1));
    wgmma_wait<0>();
    fence_regs(o[0]);
  }
  // The warpgroup's wgmma reads of its Q rows are over before any warp overwrites them.
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");

  float inv_sum[1][2], lse[1][2];
  softmax.finish(to_log2, flexc_attn::units_ln(p), inv_sum, lse);
  flexc_attn::store_rows<QTile, kBf16>(o, inv_sum, lse, smem, warp * 16, p, b, h, row0);
}
