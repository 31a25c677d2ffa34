// Forward attention, FlashAttention-2 structure, portable to sm_80 and newer.
//
// One CTA per (q tile, query head, batch). Each warp owns kBlockM / kWarps query rows. K and V
// tiles stream through a ring of kStages shared-memory stages filled by cp.async, one tile ahead
// per stage; S = Q.K^T and O += P.V run on mma.sync m16n8k16 with fp32 accumulators, and the
// online softmax stays in registers. O is normalised once at the end and written once.
//
// Block sparsity: the kv tiles visited are the BlockMask row's partial tiles (mask_mod applied
// per element) and then its full tiles (mask_mod skipped); empty tiles are never loaded. Without
// a BlockMask (bm.kv_num == nullptr) every kv tile is visited, partial unless the mask is the
// constant true. Elements past kv_len are always masked.
//
// Compile-time configuration (KernelSpec defines): FLEXC_HEAD_DIM, FLEXC_BF16 (1: bf16, 0: fp16),
// FLEXC_BLOCK_M, FLEXC_BLOCK_N, FLEXC_WARPS, FLEXC_STAGES. No length is baked in: lengths,
// strides, scale and params are kernel arguments, so they change without recompiling.
#include "attention_params.cuh"
#include "flexc_hooks.cuh"
#include "flexc_variant.cuh"
#include "online_softmax.cuh"
#include "tile_mma.cuh"

namespace flexc_fwd {

using namespace flexc_tile;

constexpr int kD = FLEXC_HEAD_DIM;
constexpr bool kBf16 = FLEXC_BF16 != 0;
constexpr int kBlockM = FLEXC_BLOCK_M;
constexpr int kBlockN = FLEXC_BLOCK_N;
constexpr int kWarps = FLEXC_WARPS;
constexpr int kStages = FLEXC_STAGES;
constexpr int kThreads = kWarps * 32;
constexpr int kWarpRows = kBlockM / kWarps;
constexpr int kMT = kWarpRows / 16;  // 16-row tiles per warp
constexpr int kNT = kBlockN / 8;     // n8 column tiles of S per warp
constexpr int kDT = kD / 8;          // n8 column tiles of O per warp
// A warp's Q fragments stay in registers when they fit in 32 (saves their shared-memory reads
// every tile); otherwise they are re-read from the Q tile, as the accumulators need the rest.
constexpr bool kQInRegs = kMT * (kD / 16) * 4 <= 32;

static_assert(kD % 32 == 0 && kD <= 256, "head dim must be a multiple of 32, at most 256");
static_assert(kWarpRows % 16 == 0 && kWarpRows * kWarps == kBlockM, "rows per warp: 16k");
static_assert(kBlockN % 16 == 0, "kv tile must be a multiple of 16");
static_assert(kStages >= 2, "the pipeline keeps one tile in flight");

using QTile = SmemTile<kBlockM, kD>;
using KvTile = SmemTile<kBlockN, kD>;
// Shared memory: Q, then kStages x (K, V). The host computes the same size for the launch.
constexpr int kSmemBytes = QTile::kBytes + kStages * 2 * KvTile::kBytes;

// The kv tiles one CTA visits, in order: partial ones first, then full ones. A BlockMask tile
// covers bm.kv_tile / kBlockN kernel tiles. Tiles are walked in order with cursors (one for the
// prefetch, one for the compute), so no division happens in the loop.
struct KvSchedule {
  struct Cursor {
    int blk = 0, sub = 0;  // BlockMask list position, kernel tile inside that BlockMask tile
  };
  const int* partial = nullptr;  // null: every tile, in order
  const int* full = nullptr;
  int num_partial = 0;
  int per_block = 1;
  int count = 0;  // kernel tiles to visit
  bool dense_partial = false;

  __device__ KvSchedule(const FlexcBlockMask& bm, int b, int h, int q0, int kv_len) {
    if (bm.kv_num == nullptr) {
      count = (kv_len + kBlockN - 1) / kBlockN;
      dense_partial = !FlexcVariant::kMaskAlwaysTrue;
      return;
    }
    const int bb = bm.nb == 1 ? 0 : b, hh = bm.nh == 1 ? 0 : h;
    const int row = (bb * bm.nh + hh) * bm.num_q_tiles + q0 / bm.q_tile;
    num_partial = bm.kv_num[row];
    const int num_full = bm.full_kv_num[row];
    partial = bm.kv_idx + static_cast<long long>(row) * bm.num_kv_tiles;
    full = bm.full_kv_idx + static_cast<long long>(row) * bm.num_kv_tiles;
    per_block = bm.kv_tile / kBlockN;
    count = (num_partial + num_full) * per_block;
  }
  // First kv index of the cursor's tile.
  __device__ __forceinline__ int start(const Cursor& c) const {
    if (partial == nullptr) return c.blk * kBlockN;
    const int tile = c.blk < num_partial ? partial[c.blk] : full[c.blk - num_partial];
    return (tile * per_block + c.sub) * kBlockN;
  }
  // Whether mask_mod must run on the cursor's tile.
  __device__ __forceinline__ bool is_partial(const Cursor& c) const {
    if constexpr (FlexcVariant::kMaskAlwaysTrue) return false;
    return partial == nullptr ? dense_partial : c.blk < num_partial;
  }
  __device__ __forceinline__ void advance(Cursor& c) const {
    if (++c.sub == per_block) c.sub = 0, ++c.blk;
  }
};

template <class T>
__device__ __forceinline__ const T* at(const void* base, const long long (&stride)[3], int b,
                                       int h) {
  return static_cast<const T*>(base) + b * stride[0] + h * stride[1];
}

// The hook indices of this thread's scores: query row (i, e >> 1) and kv column (j, e & 1) of
// the tile at (row0, kv0), clamped into [0, len) as the hooks' contract requires (flexc_hooks.cuh).
// Scores of rows past q_len are never written and those of columns past kv_len (`in_kv` false)
// are masked, so what the hooks return there is discarded. Computed once per row / column.
// Never built when q_len or kv_len is 0: the host launches nothing for q_len 0, and kv_len 0
// leaves no kv tile to visit (a BlockMask needs kv_len >= 1).
struct HookIdx {
  int q[kMT][2];
  int kv[kNT][2];
  bool in_kv[kNT][2];

  __device__ __forceinline__ HookIdx(int row0, int kv0, int q_len, int kv_len) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < kMT; ++i)
#pragma unroll
      for (int r = 0; r < 2; ++r) q[i][r] = min(row0 + i * 16 + (lane >> 2) + r * 8, q_len - 1);
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int col = kv0 + j * 8 + (lane & 3) * 2 + c;
        kv[j][c] = min(col, kv_len - 1);
        in_kv[j][c] = col < kv_len;
      }
  }
};

// Calls f(s[i][j][e], q_idx, kv_idx, in_kv) for every score this thread holds.
template <class F>
__device__ __forceinline__ void for_each_score(float (&s)[kMT][kNT][4], const HookIdx& idx, F f) {
#pragma unroll
  for (int i = 0; i < kMT; ++i)
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        f(s[i][j][e], idx.q[i][e >> 1], idx.kv[j][e & 1], idx.in_kv[j][e & 1]);
}

// score_mod on scale * q.k, then the mask (FlexAttention's order). Leaves scores in the units
// OnlineSoftmax expects: raw q.k for an identity score_mod (the softmax scale folds into the
// exponent), score_mod's output otherwise. The mask is evaluated without short-circuit so the
// unrolled tile is straight-line code and row- or column-only terms (capture loads, index
// wrapping) are computed once per row / column, not per element.
__device__ __forceinline__ void apply_mods(float (&s)[kMT][kNT][4], const FlexcAttentionParams& p,
                                           const FlexcArgs& args, int b, int h, int row0, int kv0,
                                           bool partial) {
  const HookIdx idx(row0, kv0, p.q_len, p.kv_len);
  if constexpr (!FlexcVariant::kIdentityScore) {
    for_each_score(s, idx, [&](float& x, int q_idx, int kv_idx, bool) {
      x = FlexcVariant::score_mod(args, x * p.scale, b, h, q_idx, kv_idx, p.q_len, p.kv_len);
    });
  }
  if constexpr (!FlexcVariant::kMaskAlwaysTrue) {
    if (partial) {
      for_each_score(s, idx, [&](float& x, int q_idx, int kv_idx, bool in_kv) {
        const bool keep =
            in_kv & FlexcVariant::mask_mod(args, b, h, q_idx, kv_idx, p.q_len, p.kv_len);
        x = keep ? x : neg_inf();
      });
      return;
    }
  }
  if (kv0 + kBlockN > p.kv_len) {
    for_each_score(s, idx, [&](float& x, int, int, bool in_kv) { x = in_kv ? x : neg_inf(); });
  }
}

// Softmax units -> log2 and -> natural log (see apply_mods).
__device__ __forceinline__ float units_log2(const FlexcAttentionParams& p) {
  return FlexcVariant::kIdentityScore ? p.scale_log2 : 1.4426950408889634f;
}
__device__ __forceinline__ float units_ln(const FlexcAttentionParams& p) {
  return FlexcVariant::kIdentityScore ? p.scale : 1.f;
}

}  // namespace flexc_fwd

extern "C" __global__ void __launch_bounds__(flexc_fwd::kThreads)
    flexc_attention_fwd(const FlexcAttentionParams p, const FlexcArgs args,
                        const FlexcBlockMask bm) {
  using namespace flexc_fwd;
  extern __shared__ __align__(128) unsigned char smem[];
  const unsigned q_tile = smem_addr(smem);
  const unsigned kv_tiles = q_tile + QTile::kBytes;
  auto k_tile = [&](int stage) { return kv_tiles + stage * 2 * KvTile::kBytes; };
  auto v_tile = [&](int stage) { return k_tile(stage) + KvTile::kBytes; };

  // Heaviest q tiles first: under a causal mask the last ones visit the most kv tiles.
  const int m_block = gridDim.x - 1 - blockIdx.x;
  const int h = blockIdx.y, b = blockIdx.z;
  const int h_kv = h / (p.q_heads / p.kv_heads);
  const int q0 = m_block * kBlockM;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row0 = q0 + warp * kWarpRows;  // first query row of this warp

  const auto* q = at<unsigned short>(p.q, p.q_stride, b, h);
  const auto* k = at<unsigned short>(p.k, p.k_stride, b, h_kv);
  const auto* v = at<unsigned short>(p.v, p.v_stride, b, h_kv);
  const KvSchedule sched(bm, b, h, q0, p.kv_len);
  KvSchedule::Cursor fetch, cur;  // the tile to prefetch next, the tile to compute next

  const TileCopy<kBlockN, kD, kThreads> copy_kv;
  auto load_kv = [&](int i) {
    if (i < sched.count) {
      const int kv0 = sched.start(fetch), stage = i % kStages;
      copy_kv(k_tile(stage), k, p.k_stride[2], kv0, p.kv_len);
      copy_kv(v_tile(stage), v, p.v_stride[2], kv0, p.kv_len);
      sched.advance(fetch);
    }
    cp_async_commit();  // empty groups too: keeps the wait counts uniform
  };

  TileCopy<kBlockM, kD, kThreads>()(q_tile, q, p.q_stride[2], q0, p.q_len);
  cp_async_commit();
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) load_kv(i);

  float acc[kMT][kDT][4];
  zero_fragments(acc);
  OnlineSoftmax<kMT, kNT> softmax;
  softmax.init();
  const auto frag_q = FragAddr<QTile>::a();
  const auto frag_k = FragAddr<KvTile>::b_nk();
  const auto frag_v = FragAddr<KvTile>::b_kn();
  unsigned q_frag[kQInRegs ? kMT : 1][kQInRegs ? kD / 16 : 1][4];
  if constexpr (kQInRegs) {
    cp_async_wait<kStages - 1>();  // the Q group
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kMT; ++i)
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk)
        ldmatrix_x4(q_frag[i][kk], frag_q(q_tile, warp * kWarpRows + i * 16, kk * 2));
  }

  for (int it = 0; it < sched.count; ++it) {
    cp_async_wait<kStages - 2>();  // groups: Q, then one per kv tile
    // Tile `it` is visible to all warps, and all are done with the stage refilled next.
    __syncthreads();
    load_kv(it + kStages - 1);
    const int stage = it % kStages;

    float s[kMT][kNT][4];
    zero_fragments(s);
#pragma unroll
    for (int kk = 0; kk < kD; kk += 16) {
      unsigned a[kMT][4];
#pragma unroll
      for (int i = 0; i < kMT; ++i) {
        if constexpr (kQInRegs) {
#pragma unroll
          for (int e = 0; e < 4; ++e) a[i][e] = q_frag[i][kk / 16][e];
        } else {
          ldmatrix_x4(a[i], frag_q(q_tile, warp * kWarpRows + i * 16, kk / 8));
        }
      }
      mma_rows<kBf16>(s, a, [&](unsigned(&bf)[4], int n) {
        ldmatrix_x4(bf, frag_k(k_tile(stage), n, kk / 8));
      });
    }

    apply_mods(s, p, args, b, h, row0, sched.start(cur), sched.is_partial(cur));
    sched.advance(cur);
    float alpha[kMT][2];
    // Once the row maxima settle, most tiles change none of them: skip the rescale then (the
    // factors are exactly 1, so this changes no result).
    if (softmax.step(s, units_log2(p), alpha)) {
#pragma unroll
      for (int i = 0; i < kMT; ++i)
#pragma unroll
        for (int j = 0; j < kDT; ++j) {
          acc[i][j][0] *= alpha[i][0];
          acc[i][j][1] *= alpha[i][0];
          acc[i][j][2] *= alpha[i][1];
          acc[i][j][3] *= alpha[i][1];
        }
    }

#pragma unroll
    for (int kk = 0; kk < kBlockN; kk += 16) {
      unsigned a[kMT][4];
#pragma unroll
      for (int i = 0; i < kMT; ++i) {
        a[i][0] = pack2<kBf16>(s[i][kk / 8][0], s[i][kk / 8][1]);
        a[i][1] = pack2<kBf16>(s[i][kk / 8][2], s[i][kk / 8][3]);
        a[i][2] = pack2<kBf16>(s[i][kk / 8 + 1][0], s[i][kk / 8 + 1][1]);
        a[i][3] = pack2<kBf16>(s[i][kk / 8 + 1][2], s[i][kk / 8 + 1][3]);
      }
      mma_rows<kBf16>(acc, a, [&](unsigned(&bf)[4], int n) {
        ldmatrix_x4_trans(bf, frag_v(v_tile(stage), kk, n / 8));
      });
    }
  }
  // Every thread's copies have landed (the Q tile too, when no kv tile was visited).
  cp_async_wait<0>();
  __syncthreads();

  // Epilogue: normalise, stage this warp's rows in its own part of the Q tile (no other warp
  // reads them any more), then 16-byte coalesced stores.
  float inv_sum[kMT][2], lse[kMT][2];
  softmax.finish(units_log2(p), units_ln(p), inv_sum, lse);
  const int g = lane >> 2, t = lane & 3;
  unsigned char* q_smem = smem;
#pragma unroll
  for (int i = 0; i < kMT; ++i)
#pragma unroll
    for (int j = 0; j < kDT; ++j)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = warp * kWarpRows + i * 16 + g + r * 8, col = j * 8 + t * 2;
        *reinterpret_cast<unsigned*>(q_smem + QTile::offset(row, col >> 3) + (col & 7) * 2) =
            pack2<kBf16>(acc[i][j][2 * r] * inv_sum[i][r], acc[i][j][2 * r + 1] * inv_sum[i][r]);
      }
  __syncwarp();
  auto* o = static_cast<unsigned short*>(p.o) + b * p.o_stride[0] + h * p.o_stride[1];
#pragma unroll
  for (int c = lane; c < kWarpRows * QTile::kChunks; c += 32) {
    const int r = c / QTile::kChunks, ch = c % QTile::kChunks;
    const int row = warp * kWarpRows + r;
    if (q0 + row < p.q_len) {
      *reinterpret_cast<uint4*>(o + (q0 + row) * p.o_stride[2] + ch * 8) =
          *reinterpret_cast<const uint4*>(q_smem + QTile::offset(row, ch));
    }
  }
  if (p.lse != nullptr && t == 0) {
    float* out = p.lse + (static_cast<long long>(b) * p.q_heads + h) * p.q_len;
#pragma unroll
    for (int i = 0; i < kMT; ++i)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row0 + i * 16 + g + r * 8;
        if (row < p.q_len) out[row] = lse[i][r];
      }
  }
}
