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
// Compile-time configuration (KernelSpec defines): FLEXC_HEAD_DIM (q and k), FLEXC_HEAD_DIM_V (v
// and the output; FlexAttention's Ev, e.g. 128 against 192), FLEXC_BF16 (1: bf16, 0: fp16),
// FLEXC_BLOCK_M, FLEXC_BLOCK_N, FLEXC_WARPS, FLEXC_STAGES. No length is baked in: lengths,
// strides, scale and params are kernel arguments, so they change without recompiling.
#define FLEXC_ROWS_APART 2  // row terms to the LSE, units in the exponent (attention_tile.cuh)
#include "attention_tile.cuh"
#include "online_softmax.cuh"
#include "tile_mma.cuh"

namespace flexc_fwd {

using namespace flexc_tile;
using flexc_attn::at;

constexpr int kD = FLEXC_HEAD_DIM;     // q and k
constexpr int kDv = FLEXC_HEAD_DIM_V;  // v and the output
constexpr bool kBf16 = FLEXC_BF16 != 0;
constexpr int kBlockM = FLEXC_BLOCK_M;
constexpr int kBlockN = FLEXC_BLOCK_N;
constexpr int kWarps = FLEXC_WARPS;
constexpr int kStages = FLEXC_STAGES;
constexpr int kThreads = kWarps * 32;
constexpr int kWarpRows = kBlockM / kWarps;
constexpr int kMT = kWarpRows / 16;  // 16-row tiles per warp
constexpr int kNT = kBlockN / 8;     // n8 column tiles of S per warp
constexpr int kDT = kDv / 8;         // n8 column tiles of O per warp
// A warp's Q fragments stay in registers when they fit in 32 (saves their shared-memory reads
// every tile); otherwise they are re-read from the Q tile, as the accumulators need the rest.
constexpr bool kQInRegs = kMT * (kD / 16) * 4 <= 32;

static_assert(kD % 32 == 0 && kD <= 256 && kDv % 32 == 0 && kDv <= 256,
              "head dims must be multiples of 32, at most 256");
static_assert(kWarpRows % 16 == 0 && kWarpRows * kWarps == kBlockM, "rows per warp: 16k");
static_assert(kBlockN % 16 == 0, "kv tile must be a multiple of 16");
static_assert(kStages >= 2, "the pipeline keeps one tile in flight");

using QTile = SmemTile<kBlockM, kD>;
using KTile = SmemTile<kBlockN, kD>;
using VTile = SmemTile<kBlockN, kDv>;
using OTile = SmemTile<kBlockM, kDv>;  // the epilogue's staging, over Q
// score_mod's relative terms, tabulated per kv tile by the CTA: two tables, since the next
// tile's is written while the last one's may still be read. Only for score_mods without column or
// tile loads, which score_mod_cols would read too and this kernel does not load ahead: those run
// score_mod per score.
using RelTable = flexc_attn::RelTable<kBlockM, kBlockN>;
using Scores = flexc_attn::ScoreTile<kMT, kNT>;
constexpr bool kRelTables = RelTable::kTerms > 0 && Scores::kScoreCols + Scores::kScoreTiles == 0;
// Shared memory: Q (or O, the larger), then kStages x (K, V), then the relative-term tables
// (src/attention/attention.cpp adds their bytes for every score_mod with terms, by
// dsl::LaunchFacts; left unused without kRelTables). The host computes the same size.
constexpr int kQBytes = QTile::kBytes > OTile::kBytes ? QTile::kBytes : OTile::kBytes;
constexpr int kStageBytes = KTile::kBytes + VTile::kBytes;
constexpr int kRelBytes = 2 * RelTable::kWords * 4;
constexpr int kSmemBytes = kQBytes + kStages * kStageBytes + kRelBytes;

using KvSchedule = flexc_attn::KvSchedule<kBlockN>;

}  // namespace flexc_fwd

extern "C" __global__ void __launch_bounds__(flexc_fwd::kThreads)
    flexc_attention_fwd(const FlexcAttentionParams params, const FlexcArgs args,
                        const FlexcBlockMask bm) {
  using namespace flexc_fwd;
  extern __shared__ __align__(128) unsigned char smem[];
  const unsigned q_tile = smem_addr(smem);
  const unsigned kv_tiles = q_tile + kQBytes;
  auto k_tile = [&](int stage) { return kv_tiles + stage * kStageBytes; };
  auto v_tile = [&](int stage) { return k_tile(stage) + KTile::kBytes; };

  // Heaviest q tiles first: under a causal mask the last ones visit the most kv tiles.
  const int m_block = gridDim.x - 1 - blockIdx.x;
  const int h = blockIdx.y, b = blockIdx.z;
  // Packed sequences: sequence b's rows (item_params); the grid covers the longest.
  auto&& p = flexc_attn::item_params(params, b);
  if (flexc_attn::kVarlen && m_block * kBlockM >= p.q_len) return;
  const int h_kv = h / (p.q_heads / p.kv_heads);
  const int q0 = m_block * kBlockM;
  const int warp = threadIdx.x >> 5;
  const int row0 = q0 + warp * kWarpRows;  // first query row of this warp

  const auto* q = at<unsigned short>(p.q, p.q_stride, b, h);
  const auto* k = at<unsigned short>(p.k, p.k_stride, b, h_kv);
  const auto* v = at<unsigned short>(p.v, p.v_stride, b, h_kv);
  const KvSchedule sched(bm, b, h, q0, p.kv_len);
  KvSchedule::Cursor fetch, cur;  // the tile to prefetch next, the tile to compute next

  // (One set of positions when D == Dv: the two copies compute the same ones.)
  const TileCopy<KTile, kThreads> copy_k;
  const TileCopy<VTile, kThreads> copy_v;
  auto load_kv = [&](int i) {
    if (i < sched.count) {
      const int kv0 = sched.start(fetch), stage = i % kStages;
      copy_k(k_tile(stage), k, p.k_stride[2], kv0, p.kv_len);
      copy_v(v_tile(stage), v, p.v_stride[2], kv0, p.kv_len);
      sched.advance(fetch);
    }
    cp_async_commit();  // empty groups too: keeps the wait counts uniform
  };

  TileCopy<QTile, kThreads>()(q_tile, q, p.q_stride[2], q0, p.q_len);
  cp_async_commit();
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) load_kv(i);

  float acc[kMT][kDT][4];
  zero_fragments(acc);
  OnlineSoftmax<kMT, kNT> softmax;
  softmax.init();
  const auto frag_q = FragAddr<QTile>::a();
  const auto frag_k = FragAddr<KTile>::b_nk();
  const auto frag_v = FragAddr<VTile>::b_kn();
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

  // The relative terms of tile `it` go to table it % 2 before the barrier that makes the tile
  // visible; every thread read table it % 2 before the barrier of tile it + 1.
  typename Scores::Columns cols;
  auto fill_rel_table = [&](int it) {
    if constexpr (kRelTables) {
      unsigned* table = reinterpret_cast<unsigned*>(smem + kQBytes + kStages * kStageBytes) +
                        (it & 1) * RelTable::kWords;
      RelTable::fill<kThreads>(table, args, b, h, q0 + p.q_pos0,
                               sched.start(cur) + flexc_attn::kv_pos0(p), Scores::hook_q_len(p),
                               flexc_attn::hook_kv_len(p), threadIdx.x);
      cols.rel = RelTable::thread_view(table, warp * kWarpRows);
    }
  };

  for (int it = 0; it < sched.count; ++it) {
    cp_async_wait<kStages - 2>();  // groups: Q, then one per kv tile
    fill_rel_table(it);
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

    if constexpr (kRelTables) {
      Scores::apply_mods(s, p, args, b, h, row0, sched.start(cur), sched.is_partial(cur), &cols);
    } else {
      Scores::apply_mods(s, p, args, b, h, row0, sched.start(cur), sched.is_partial(cur));
    }
    sched.advance(cur);
    float alpha[kMT][2];
    // Once the row maxima settle, most tiles change none of them: skip the rescale then (the
    // factors are exactly 1, so this changes no result).
    if (softmax.step(s, flexc_attn::units_log2(p), alpha)) softmax.rescale(acc, alpha);

    mma_c_b<kBf16>(acc, s, frag_v, v_tile(stage), 0);
  }
  // Every thread's copies have landed (the Q tile too, when no kv tile was visited).
  cp_async_wait<0>();
  __syncthreads();

  // Epilogue: each warp stages its rows in its own part of the Q tile (no other warp reads them
  // any more) for coalesced stores.
  float inv_sum[kMT][2], lse[kMT][2];
  softmax.finish(flexc_attn::units_log2(p), flexc_attn::units_ln(p), inv_sum, lse);
  flexc_attn::add_row_terms(inv_sum, lse, p, args, b, h, row0);
  flexc_attn::nan_if_bad_keys(params, b, inv_sum, lse);
  flexc_attn::store_rows<OTile, kBf16>(acc, inv_sum, lse, smem, warp * kWarpRows, p, b, h, row0);
}
