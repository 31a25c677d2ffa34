// Forward attention for Hopper (sm_90a): the products on wgmma, everything else shared with the
// portable kernel (attention_tile.cuh: BlockMask schedule, hooks, epilogue; online_softmax.cuh).
//
// One CTA per (q tile, query head, batch), FlashAttention-3's layout: a producer warpgroup and
// one consumer warpgroup per 64 q rows (two for 128-row tiles; three for D 64's 192-row tiles,
// where a tile's products are half as long and a third consumer keeps the tensor cores busy):
// - warpgroup 0 produces: one thread walks the kv tiles (KvUnion: a 192-row tile spans two
//   BlockMask rows; KvStraddle: wide tiles over a BlockMask's), publishes each tile's schedule
//   word (its kv index and each consumer's tile kind) in a ring in shared memory, and loads Q once
//   and then K and V (and score_mod's [Q_LEN, KV_LEN] tile where FLEXC_TILE_TMA) tile by tile with
//   TMA into wgmma's 128-byte-swizzled layout (zeros past the lengths), two stages each, each load
//   completing on a "full" mbarrier; it waits on the stage's "empty" mbarrier before reusing it.
//   Its warps 1-3 stage the hooks' per-key loads of each tile in shared memory
//   (StagedColumns), in stages of their own, so the consumers spend no registers on them, and
//   fill each consumer's table of score_mod's relative terms there (RelTable).
//   It gives most of its registers to the consumers.
// - the consumers, 64 q rows each: per kv tile j a consumer issues S_j = Q.K_j^T and
//   O += P_{j-1}.V_{j-1} back to back, then runs the hooks and the online softmax of tile j while
//   the tensor cores finish P.V (intra-warpgroup overlap). The consumers take turns issuing
//   (round robin on named barriers; not at D 64 with two, kTurns), so one's softmax runs while
//   another's products do. P never leaves registers: wgmma takes A from registers in the layout
//   the softmax leaves it in. A tile empty for a consumer's rows (the other BlockMask row's) has
//   its scores masked whole: P = 0; past its own row's last tile a consumer only releases the
//   stages (kSkipDone).
//
// Compile-time configuration (from src/attention/attention.cpp's fwd_config_sm90, which sizes the
// launch): FLEXC_HEAD_DIM (q and k) and FLEXC_HEAD_DIM_V (v and the output), each 64, 96, 128, 192
// or 256, FLEXC_BF16, FLEXC_BLOCK_M (128: two consumers of 64 rows; 192 at D 64: three),
// FLEXC_BLOCK_N (128; 64 when a head dim is above 128: O takes 96 or 128 registers of a consumer
// thread's 240, and shared memory must hold Q and two stages of K and V; 176, 112 or 80 at D 128,
// 192 or 256: the wide tiles, kWide), FLEXC_STAGES (2), FLEXC_PERSISTENT (1: a CTA per SM looping
// over work items, Items; 0: a CTA per item), FLEXC_TILE_TMA (1: score_mod's [Q_LEN, KV_LEN] tile
// load comes by TMA with K and V, one more stage each, and the consumers read it with ldmatrix; 0:
// they load their words from global memory themselves), FLEXC_Q_REGS (how many 16-column chunks of
// its Q rows each consumer warp reads into registers once per item; Q.K^T takes A from them for
// those chunks and reads only K from shared memory: with 64-wide kv tiles Q's and K's reads
// together would take all of its bandwidth; 0: none).
#define FLEXC_ROWS_APART 2  // row terms to the LSE, units in the exponent (attention_tile.cuh)
#include "attention_tile.cuh"
#include "online_softmax.cuh"
#include "tile_wgmma.cuh"

namespace flexc_fwd90 {

using namespace flexc_tile;

constexpr int kD = FLEXC_HEAD_DIM;     // q and k
constexpr int kDv = FLEXC_HEAD_DIM_V;  // v and the output
constexpr bool kBf16 = FLEXC_BF16 != 0;
constexpr int kBlockM = FLEXC_BLOCK_M;
constexpr int kBlockN = FLEXC_BLOCK_N;
constexpr int kStages = FLEXC_STAGES;
constexpr bool kPersistent = FLEXC_PERSISTENT != 0;
constexpr bool kTileTma = FLEXC_TILE_TMA != 0;
// Wide kv tiles (80, 112, 176: FlashAttention-3's) do not divide a BlockMask's 128-key tiles:
// over a BlockMask one may straddle two (KvStraddle, ScoreTile's SPLIT). Never beside hooks that
// stage per-tile loads (src/attention/attention.cpp, detail::fwd_sm90_wide_n).
constexpr bool kWide = kBlockN != 64 && kBlockN != 128;
// Q's 16-column chunks a consumer holds in registers. Beside wide kv tiles a score_mod other than
// the identity takes at most 4: its own math needs the registers (softcap at D 192 / 256 +5-10%
// with 4 rather than 8 / 6; docs/perf.md, "Wide kv tiles").
constexpr int kQChunks =
    kWide && !flexc_attn::kIdentityScore && FLEXC_Q_REGS > 4 ? 4 : FLEXC_Q_REGS;
constexpr bool kQRegs = kQChunks > 0;
// The item's first tile (no P.V to overlap) is peeled from the mainloop, except beside a score_mod
// other than the identity in a grid of one CTA per item (long rows): there the hooks inlined twice
// cost a quarter of the compile time, and the loop's P.V of zeros per item 1-2% of the products.
// A persistent grid's short items keep the peel, and so do D 64's 192-row tiles where score_mod
// reads per-key or tile loads, whose 160 registers schedule the loop's first tile worse
// (docs/perf.md, "One mainloop ... beside any score_mod").
constexpr bool kPeelFirst =
    flexc_attn::kIdentityScore || kPersistent ||
    (kBlockM == 192 && FlexcVariant::kScoreColumnLoads + FlexcVariant::kScoreTileLoads > 0);
constexpr int kQFragments = kQRegs ? kQChunks : 1;  // (an array's size)
static_assert(kQChunks >= 0 && kQChunks <= kD / 16, "at most all of Q's chunks");
static_assert(!kTileTma || FlexcVariant::kScoreTileLoads == 1, "one tile load, by TMA");
constexpr int kConsumers = kBlockM / 64;
constexpr int kThreads = 128 * (1 + kConsumers);  // the host launches as many
constexpr int kNT = kBlockN / 8;                  // n8 column tiles of S per warp
constexpr int kDT = kDv / 8;                      // n8 column tiles of O per warp

constexpr bool head_dim_ok(int d) { return d == 64 || d == 96 || d == 128 || d == 192 || d == 256; }
static_assert(head_dim_ok(kD) && head_dim_ok(kDv), "head dims 64, 96, 128, 192 or 256");
static_assert((kBlockM == 128 || (kBlockM == 192 && kD == 64 && kDv == 64)) &&
                  (!kWide || (kBlockM == 128 && kWgmmaN<kBlockN / 8>)) && kStages >= 2,
              "the configurations built and tested");
// The schedule the producer publishes: per kv tile one word, the tile's first kv index (a multiple
// of kBlockN) with consumer c's TileKind in bits 2c, 2c + 1; kEnd after the last tile. Wide tiles
// (KvStraddle) carry two kinds per consumer, its first and its last key's BlockMask tile's, in
// bits 4c .. 4c + 3, and the tile's index from bit 8. Word j + 1 is written before K_j's load
// arrives on its "full" barrier, so a consumer that waited for K_j reads it; the ring outlasts the
// kStages tiles a consumer may lag behind the producer.
constexpr int kRing = 8;
// A consumer whose BlockMask row has no tile left (kTileDone) skips the union's last tiles, the
// other row's (its loop ends there): 192-row tiles under a mask.
constexpr bool kSkipDone = kConsumers == 3 && !FlexcVariant::kMaskAlwaysTrue;
constexpr unsigned kEnd = 0xffffffffu, kKindMask = (1u << (2 * kConsumers)) - 1;
static_assert((kWide || kBlockN >= (1 << (2 * kConsumers))) && kRing > kStages + 1,
              "kinds fit below the kv index; the ring outlasts the stages");

using QTile = Sw128Tile<kBlockM, kD>;
using KTile = Sw128Tile<kBlockN, kD>;
using VTile = Sw128Tile<kBlockN, kDv>;
using OTile = Sw128Tile<kBlockM, kDv>;  // the epilogue's staging, over Q
// score_mod's tile load (kTileTma), 16-bit; never with wide kv tiles (a placeholder then).
using BTile = Sw128Tile<kBlockM, kWide ? 64 : kBlockN>;
constexpr int kBBytes = kTileTma ? BTile::kBytes : 0;
// score_mod's relative terms, tabulated per consumer (64 rows) and kv tile by the loaders, in the
// staged loads' stages (a table per consumer).
using RelTable = flexc_attn::RelTable<64, kBlockN>;
// Shared memory: Q (or O's staging, the larger), K[kStages], V[kStages] (each 1024-byte aligned:
// the sizes are multiples of 1024; head dim 96 keeps whole 64-column panels, TMA zero-filling the
// last 32), the staged loads' stages (the column loads, then each consumer's relative-term table),
// then the mbarriers, the schedule ring, the staged loads' kv indices, heads and q rows
// (src/attention/attention.cpp adds the column loads' and the tables' bytes by dsl::LaunchFacts).
// The host adds 1024 bytes for aligning the dynamic base. q_full, k_full[], v_full[], k_empty[],
// v_empty[], then the staged loads' t_go[], t_full[], t_empty[], then q_empty, then the tile loads'
// b_full[] and b_empty[] (kTileTma).
constexpr int kBarriers = 2 + 7 * kStages + (kTileTma ? 2 * kStages : 0);
// O is staged apart from Q where both fit (head dims up to 128, no tile-load stages, no wide kv
// tiles), so that a CTA's next Q loads while it stores the last output; over Q's bytes otherwise
// (then the next Q waits for the store).
constexpr bool kSeparateO = kD <= 128 && kDv <= 128 && !kTileTma && !kWide;
constexpr int kQBytes = kSeparateO || QTile::kBytes > OTile::kBytes ? QTile::kBytes : OTile::kBytes;
constexpr int kOBytes = kSeparateO ? OTile::kBytes : 0;
// score_mod's and mask_mod's column loads and its relative-term tables, staged per kv tile in
// shared memory by the producer's warps 1-3 (the loaders), in stages beside K's and V's: the
// consumers then hold no registers for the loads across their waits (D 64's 160 registers need
// that), and no consumer waits for its warps' shares of a table (a named barrier per tile cost
// 6% at D 64; docs/perf.md).
constexpr int kLoaders = 96;
using Staged = flexc_attn::StagedColumns<kBlockN>;
constexpr int kTableBytes = RelTable::kWords * 4;  // a consumer's, in each stage
constexpr int kStageTBytes = Staged::kBytes + kConsumers * kTableBytes;
constexpr bool kStaging = kStageTBytes > 0;
static_assert(!kWide || (!kStaging && !kTileTma && RelTable::kTerms == 0),
              "wide kv tiles: no per-tile loads or tables");
constexpr int kSmemBytes = kQBytes + kOBytes +
                           kStages * (KTile::kBytes + VTile::kBytes + kBBytes + kStageTBytes) +
                           8 * kBarriers + 4 * kRing + 12 * kStages + 16;
static_assert(kSmemBytes + 1024 <= 227 * 1024, "fits Hopper's shared memory per block");
// setmaxnreg below: the launch gives each thread kLaunchRegs registers, and the consumers' increase
// must be covered by what the producer releases, or it waits forever (FlashAttention-3's split).
// With two consumers, loaders of column loads take 40 and leave their consumers 232 (the tables'
// loaders fit 24: ptxas spills nothing there, test_attention's catalogue test); with three, 32
// each is all there is.
constexpr int kLaunchRegs = (65536 / kThreads) & ~7;
constexpr int kProducerRegs = kConsumers == 2 ? (Staged::kBytes > 0 ? 40 : 24) : 32;
constexpr int kConsumerRegs = kConsumers == 2 ? (Staged::kBytes > 0 ? 232 : 240) : 160;
static_assert(128 * (kLaunchRegs - kProducerRegs) >=
                  128 * kConsumers * (kConsumerRegs - kLaunchRegs),
              "register reallocation must balance");
// Named barriers: 0 is __syncthreads; then per consumer its turns and its epilogue.
constexpr int kTurnBarrier = 1, kEpilogueBarrier = 1 + kConsumers;
static_assert(kEpilogueBarrier + kConsumers <= 16, "16 named barriers");

using Scores = flexc_attn::ScoreTile<1, kNT, flexc_attn::Rows::Q, Staged, kConsumers == 3, kWide>;

struct Smem {
  unsigned q, o, k, v, bt, t, bars, ring;  // shared-memory addresses
  __device__ __forceinline__ unsigned k_tile(int s) const { return k + s * KTile::kBytes; }
  __device__ __forceinline__ unsigned v_tile(int s) const { return v + s * VTile::kBytes; }
  __device__ __forceinline__ unsigned b_tile(int s) const { return bt + s * kBBytes; }
  __device__ __forceinline__ unsigned q_full() const { return bars; }
  __device__ __forceinline__ unsigned k_full(int s) const { return bars + 8 * (1 + s); }
  __device__ __forceinline__ unsigned v_full(int s) const { return bars + 8 * (1 + kStages + s); }
  __device__ __forceinline__ unsigned k_empty(int s) const {
    return bars + 8 * (1 + 2 * kStages + s);
  }
  __device__ __forceinline__ unsigned v_empty(int s) const {
    return bars + 8 * (1 + 3 * kStages + s);
  }
  // The staged loads: stage s's kv index published (by the producer thread, once the stage is
  // free), its loads landed (the loaders), its reads done (every consumer thread).
  __device__ __forceinline__ unsigned t_go(int s) const { return bars + 8 * (1 + 4 * kStages + s); }
  __device__ __forceinline__ unsigned t_full(int s) const {
    return bars + 8 * (1 + 5 * kStages + s);
  }
  __device__ __forceinline__ unsigned t_empty(int s) const {
    return bars + 8 * (1 + 6 * kStages + s);
  }
  __device__ __forceinline__ unsigned t_tile(int s) const { return t + s * kStageTBytes; }
  // Consumer c's relative-term table in stage s.
  __device__ __forceinline__ unsigned table(int s, int c) const {
    return t_tile(s) + Staged::kBytes + c * kTableBytes;
  }
  __device__ __forceinline__ unsigned staged_kv(int s) const { return ring + 4 * (kRing + s); }
  __device__ __forceinline__ unsigned staged_head(int s) const {
    return ring + 4 * (kRing + kStages + s);
  }
  // The current work item (its q tile, head, batch; kEnd: none is left), published with its Q.
  __device__ __forceinline__ unsigned item() const { return ring + 4 * (kRing + 2 * kStages); }
  // Q's rows no longer read (nor O's staging over them): the next work item's Q may load.
  __device__ __forceinline__ unsigned q_empty() const { return bars + 8 * (1 + 7 * kStages); }
  // The tile load of stage s landed / was read by every consumer thread.
  __device__ __forceinline__ unsigned b_full(int s) const {
    return bars + 8 * (2 + 7 * kStages + s);
  }
  __device__ __forceinline__ unsigned b_empty(int s) const {
    return bars + 8 * (2 + 8 * kStages + s);
  }
  // Stage s's first q row (query position), for the tables.
  __device__ __forceinline__ unsigned staged_q(int s) const { return item() + 16 + 4 * s; }
};

// T where B holds, F otherwise (std::conditional, which NVRTC's headers lack).
template <bool B, class T, class F>
struct Pick {
  using type = T;
};
template <class T, class F>
struct Pick<false, T, F> {
  using type = F;
};

// Work items: one per (q tile, query head, batch).
struct Item {
  int m_block, h, b;
};
// A CTA per item: heaviest q tiles first (under a causal mask the last ones visit the most kv
// tiles). With a head-shared [Q_LEN, KV_LEN] tile load the grid is (heads, q tiles) instead
// (dsl::LaunchFacts), so that the heads of one q tile, which read the same rows of it, run
// together. The values go through a shuffle, which keeps them warp-uniform in registers (read
// again from special registers they cost bias_2d 8-14% at D 128 before its row pointers were
// pinned, 1% after; docs/perf.md).
__device__ __forceinline__ Item cta_item() {
  int m_block = gridDim.x - 1 - blockIdx.x, h = blockIdx.y;
  if constexpr (FlexcVariant::kScoreTilesShareHeads) {
    m_block = __shfl_sync(0xffffffffu, int(gridDim.y - 1 - blockIdx.y), 0);
    h = __shfl_sync(0xffffffffu, int(blockIdx.x), 0);
  }
  return {m_block, h, int(blockIdx.z)};
}
// kPersistent (short sequences: the host decides): a CTA per SM loops over items, overlapping
// an item's output with the next one's loads. Items are numbered in the launch order of the
// CTA-per-item grid (a head's q tiles together: the CTAs running at once share K and V in L2);
// in round r the CTAs take items r * gridDim.x + c, c = blockIdx.x in even rounds and
// gridDim.x - 1 - blockIdx.x in odd ones, which mixes heavy and light q tiles in each CTA's share
// (with plain striding, a grid that is a multiple of the q tiles gives a CTA one q tile only).
// Its producer thread decodes them and publishes each beside its Q (Smem::item).
struct Items {
  int q_tiles, heads, total;
  __device__ __forceinline__ explicit Items(const FlexcAttentionParams& p)
      : q_tiles((p.q_len + kBlockM - 1) / kBlockM), heads(p.q_heads) {
    total = q_tiles * heads * p.batch;
  }
  // The CTA's item of round r (>= total: the CTA has no more).
  __device__ __forceinline__ int of_round(int r) const {
    return r * int(gridDim.x) + (r & 1 ? int(gridDim.x - 1 - blockIdx.x) : int(blockIdx.x));
  }
  __device__ __forceinline__ Item at(int i) const {
    if constexpr (FlexcVariant::kScoreTilesShareHeads)
      return {q_tiles - 1 - (i / heads) % q_tiles, i % heads, i / (heads * q_tiles)};
    return {q_tiles - 1 - i % q_tiles, (i / q_tiles) % heads, i / (q_tiles * heads)};
  }
};

// A tile of `Tile::kRows` rows from `row0` of head h, batch b, one TMA box per 64-column panel.
template <class Tile>
__device__ __forceinline__ void load_tile(unsigned dst, const FlexcTensorMap& map, int row0, int h,
                                          int b, unsigned bar) {
  mbar_expect_tx(bar, Tile::kBytes);
#pragma unroll
  for (int panel = 0; panel < Tile::kPanels; ++panel)
    tma_load_4d(dst + panel * Tile::kPanelBytes, map, panel * 64, row0, h, b, bar);
}

// Where score_mod's tile load of q tile q0 starts in its TMA map (the kernel's `tb`, a 2-D view of
// the capture as rows of its q dim's stride: src/attention/attention.cpp, detail::tile_map): the
// map's column and row of (q_idx, kv_idx) = (q0's, the first key's).
__device__ __forceinline__ void tile_origin(const FlexcAttentionParams& p, const FlexcArgs& args,
                                            int b, int h, int q0, int& col, int& row) {
  long long off[1];
  FlexcVariant::score_tile_offsets(args, b, h, q0 + p.q_pos0, flexc_attn::kv_pos0(p),
                                   Scores::hook_q_len(p), flexc_attn::hook_kv_len(p), off);
  const long long pitch =
      args.captures[FlexcVariant::score_tile_slot(0)].stride[FlexcVariant::score_tile_qdim(0)];
  row = int(off[0] / pitch);
  col = int(off[0] - row * pitch);
}

// S = Q.K^T for the warpgroup's 64 rows (`q_rows` is its first row in the Q tile).
__device__ __forceinline__ void issue_qk(float (&s)[kNT][4], unsigned q_tile, int q_rows,
                                         unsigned k_tile) {
  wgmma_ss<kBf16, 0>(s, QTile::k_major(q_tile, q_rows, 0), KTile::k_major(k_tile, 0, 0));
#pragma unroll
  for (int kk = 16; kk < kD; kk += 16) {
    wgmma_ss<kBf16, 1>(s, QTile::k_major(q_tile, q_rows, kk), KTile::k_major(k_tile, 0, kk));
  }
  wgmma_commit();
}

// The same with Q's first kQChunks 16-column chunks as A fragments in registers (kQRegs): for
// those only K is read from shared memory.
__device__ __forceinline__ void issue_qk(float (&s)[kNT][4], const unsigned (&qa)[kQFragments][4],
                                         unsigned q_tile, int q_rows, unsigned k_tile) {
  wgmma_rs<kBf16, 0, 0, 0, 0>(s, qa[0], KTile::k_major(k_tile, 0, 0));
#pragma unroll
  for (int kk = 1; kk < kQChunks; ++kk)
    wgmma_rs<kBf16, 0, 0, 1, 0>(s, qa[kk], KTile::k_major(k_tile, 0, kk * 16));
#pragma unroll
  for (int kk = kQChunks; kk < kD / 16; ++kk)
    wgmma_ss<kBf16, 1>(s, QTile::k_major(q_tile, q_rows, kk * 16),
                       KTile::k_major(k_tile, 0, kk * 16));
  wgmma_commit();
}

// O += P.V; P in registers as A fragments, one per 16 kv columns.
__device__ __forceinline__ void issue_pv(float (&o)[kDT][4], const unsigned (&pa)[kNT / 2][4],
                                         unsigned v_tile) {
#pragma unroll
  for (int kk = 0; kk < kNT / 2; ++kk) wgmma_rs_cols<VTile, kBf16>(o, pa[kk], v_tile, kk * 16);
  wgmma_commit();
}

// Softmax probabilities -> the A fragments of P.V (rounded to the input type).
__device__ __forceinline__ void pack_p(const float (&s)[kNT][4], unsigned (&pa)[kNT / 2][4]) {
#pragma unroll
  for (int kk = 0; kk < kNT / 2; ++kk) c_to_a<kBf16>(s, kk, pa[kk]);
}

// Consumers whose rows start inside q_len (all but in the last q tile).
__device__ __forceinline__ int active_consumers(const FlexcAttentionParams& p, int q0) {
  return min(kConsumers, (p.q_len - q0 + 63) / 64);
}

// The loaders' stage of tile j, free once the consumers read it (before they release V's): the
// tile's first kv index, its batch and head (b << 16 | h) and q tile's first row, or kEnd after
// the CTA's last tile.
__device__ __forceinline__ void hand_over(const Smem& sm, int j, unsigned kv, unsigned bh, int q0) {
  if constexpr (kStaging) {
    const int s = j % kStages;
    mbar_wait(sm.t_empty(s), ((j / kStages) & 1) ^ 1);
    st_shared(sm.staged_kv(s), kv);
    st_shared(sm.staged_head(s), bh);
    st_shared(sm.staged_q(s), unsigned(q0));
    mbar_arrive(sm.t_go(s));
  }
}

// score_mod's tile load of the kv tile from kv0 (kTileTma): a box of 64 columns by the q tile's
// rows per 64-column panel, from the item's origin (tile_origin).
__device__ __forceinline__ void load_b_tile(unsigned dst, const FlexcTensorMap& map, int col,
                                            int row, unsigned bar) {
  mbar_expect_tx(bar, BTile::kBytes);
#pragma unroll
  for (int panel = 0; panel < BTile::kPanels; ++panel)
    tma_load_2d(dst + panel * BTile::kPanelBytes, map, col + panel * 64, row, bar);
}

// Warpgroup 0's thread 0: the schedule and the TMA loads of the CTA's k-th work item. Stage s of
// round r (tile j = r * kStages + s, counted over the CTA's items) is reused once every consumer
// released round r - 1. The ring holds a word per tile and one (kEnd) per item: tile j's is word
// j + k. The item and its Q are published once the consumers are done with the last one's Q
// (q_empty). With staged loads or tables it also hands each stage's kv index, batch, head and q
// tile's first row to the loaders once the consumers released the stage.
__device__ __forceinline__ void produce(const Smem& sm, volatile unsigned* ring,
                                        const FlexcTensorMap& tq, const FlexcTensorMap& tk,
                                        const FlexcTensorMap& tv, const FlexcTensorMap& tb,
                                        const FlexcBlockMask& bm, const FlexcAttentionParams& p,
                                        const FlexcArgs& args, const Item& it, int k, int& j) {
  const int h = it.h, b = it.b, q0 = it.m_block * kBlockM, active = active_consumers(p, q0);
  const int h_kv = h / (p.q_heads / p.kv_heads);
  // Where the item's rows sit in q's, k's and v's maps: packed sequences are one batch of
  // their rows (flexc_attn::sequence_params).
  const int q_row0 = flexc_attn::kVarlen ? p.q_start : 0;
  const int kv_row0 = flexc_attn::kVarlen ? p.kv_start : 0, map_b = flexc_attn::kVarlen ? 0 : b;
  int b_col = 0, b_row = 0;
  if constexpr (kTileTma) tile_origin(p, args, b, h, q0, b_col, b_row);
  // The BlockMask rows of the first and the last active consumer (wide tiles: one row).
  using Tiles =
      typename Pick<kWide, flexc_attn::KvStraddle<kBlockN>, flexc_attn::KvUnion<kBlockN>>::type;
  Tiles tiles(bm, b, h, q0, q0 + 64 * (active - 1), p.kv_len);
  // Which of the two rows' kinds each consumer takes (bit c set: the second row's).
  unsigned second = 0;
  if (!kWide && bm.kv_num != nullptr)
    for (int c = 1; c < active; ++c)
      if ((q0 + 64 * c) / bm.q_tile != q0 / bm.q_tile) second |= 1u << c;
  auto word = [&](int kv0, unsigned kinds) {
    if (kv0 < 0) return kEnd;
    if constexpr (kWide) {
      unsigned x = unsigned(kv0 / kBlockN) << 8;
#pragma unroll
      for (int c = 0; c < kConsumers; ++c)
        if (c < active) x |= (kinds & 15u) << (4 * c);
      return x;
    }
    unsigned x = unsigned(kv0);
#pragma unroll
    for (int c = 0; c < kConsumers; ++c) {
      unsigned kind = (kinds >> ((second >> c) & 1 ? 2 : 0)) & 3u;
      if (!kSkipDone && kind == flexc_attn::kTileDone) kind = flexc_attn::kTileEmpty;
      if (c < active) x |= kind << (2 * c);
    }
    return x;
  };
  unsigned kinds = 0;
  int kv0 = tiles.next(bm, p.kv_len, kinds);
  // The item's first word and its Q (a persistent CTA's after its first K, which may load while
  // the consumers finish the last item).
  const unsigned first = word(kv0, kinds);
  auto publish = [&] {
    if (k > 0) mbar_wait(sm.q_empty(), (k - 1) & 1);
    ring[(j + k) % kRing] = first;
    if constexpr (kPersistent) {
      st_shared(sm.item(), unsigned(it.m_block));
      st_shared(sm.item() + 4, unsigned(h));
      st_shared(sm.item() + 8, unsigned(b));
    }
    load_tile<QTile>(sm.q, tq, q_row0 + q0, h, map_b, sm.q_full());
  };
  if (!kPersistent || kv0 < 0) publish();
  for (bool published = !kPersistent || kv0 < 0; kv0 >= 0; ++j) {
    const int s = j % kStages;
    const unsigned empty_parity = ((j / kStages) & 1) ^ 1;
    const int next = tiles.next(bm, p.kv_len, kinds);
    mbar_wait(sm.k_empty(s), empty_parity);
    ring[(j + 1 + k) % kRing] = word(next, kinds);
    load_tile<KTile>(sm.k_tile(s), tk, kv_row0 + kv0, h_kv, map_b, sm.k_full(s));
    if (!published) publish(), published = true;
    if constexpr (kTileTma) {
      mbar_wait(sm.b_empty(s), empty_parity);
      load_b_tile(sm.b_tile(s), tb, b_col + kv0, b_row, sm.b_full(s));
    }
    hand_over(sm, j, unsigned(kv0), unsigned(b) << 16 | unsigned(h), q0);
    mbar_wait(sm.v_empty(s), empty_parity);
    load_tile<VTile>(sm.v_tile(s), tv, kv_row0 + kv0, h_kv, map_b, sm.v_full(s));
    kv0 = next;
  }
}

// Warpgroup 0's warps 1-3 (loader `tid` of kLoaders): the column loads and the relative-term
// tables of each kv tile the producer thread hands over, until it hands over kEnd. `base`: the
// shared memory at sm.q, for the tables' generic pointers.
__device__ __forceinline__ void load_staged(const Smem& sm, unsigned char* base,
                                            const FlexcAttentionParams& params,
                                            const FlexcArgs& args, int tid) {
  for (int j = 0;; ++j) {
    const int s = j % kStages;
    mbar_wait(sm.t_go(s), (j / kStages) & 1);
    const unsigned kv0 = ld_shared_volatile(sm.staged_kv(s));
    if (kv0 == kEnd) break;
    const unsigned bh = ld_shared_volatile(sm.staged_head(s));
    const int b = int(bh >> 16), h = int(bh & 0xffffu);
    auto&& p = flexc_attn::item_params(params, b);
    if constexpr (Staged::kBytes > 0)
      Staged::load(sm.t_tile(s), p, args, b, h, int(kv0), tid, kLoaders);
    if constexpr (RelTable::kTerms > 0) {
      const int q0 = int(ld_shared_volatile(sm.staged_q(s)));
#pragma unroll
      for (int c = 0; c < kConsumers; ++c)
        RelTable::fill<kLoaders>(reinterpret_cast<unsigned*>(base + (sm.table(s, c) - sm.q)), args,
                                 b, h, q0 + 64 * c + p.q_pos0, int(kv0) + flexc_attn::kv_pos0(p),
                                 Scores::hook_q_len(p), flexc_attn::hook_kv_len(p), tid);
    }
    mbar_arrive(sm.t_full(s));
  }
}

}  // namespace flexc_fwd90

extern "C" __global__ void __launch_bounds__(flexc_fwd90::kThreads, 1)
    flexc_attention_fwd_sm90(const FlexcAttentionParams params, const FlexcArgs args,
                             const FlexcBlockMask bm, const __grid_constant__ FlexcTensorMap tq,
                             const __grid_constant__ FlexcTensorMap tk,
                             const __grid_constant__ FlexcTensorMap tv,
                             const __grid_constant__ FlexcTensorMap tb) {
  using namespace flexc_fwd90;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // The declared alignment is not promised for dynamic shared memory: align by hand.
  const unsigned raw = smem_addr(smem_raw);
  Smem sm;
  sm.q = (raw + 1023) & ~1023u;
  sm.o = sm.q + (kSeparateO ? kQBytes : 0);
  sm.k = sm.q + kQBytes + kOBytes;
  sm.v = sm.k + kStages * KTile::kBytes;
  sm.bt = sm.v + kStages * VTile::kBytes;
  sm.t = sm.bt + kStages * kBBytes;
  sm.bars = sm.t + kStages * kStageTBytes;
  sm.ring = sm.bars + 8 * kBarriers;
  unsigned char* q_smem = smem_raw + (sm.q - raw);  // the aligned base
  volatile unsigned* ring = reinterpret_cast<volatile unsigned*>(q_smem + (sm.ring - sm.q));
  // Warp-uniform to the compiler too (a shuffle from lane 0), so role branches stay uniform.
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
  // Packed sequences: each role computes on its item's sequence's view (item_params). A CTA per
  // item covers the longest sequence, and q tiles past this one's leave at once; the persistent
  // producer skips such items.
  static_assert(!(flexc_attn::kVarlen && kTileTma), "packed sequences take no tile TMA");
  if constexpr (flexc_attn::kVarlen && !kPersistent) {
    const Item it = cta_item();
    if (it.m_block * kBlockM >= flexc_attn::sequence_params(params, it.b).q_len) return;
  }

  if (threadIdx.x == 0) {
    // The host sizes shared memory by this file's rule (src/attention/attention.cpp,
    // fwd_hook_bytes): were they ever to disagree, the kernel would overwrite memory past its own;
    // it stops instead.
    unsigned given;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(given));
    if (given < sm.q - raw + kSmemBytes) __trap();
    mbar_init(sm.q_full(), 1);
    mbar_init(sm.q_empty(), 128 * kConsumers);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(sm.k_full(s), 1);
      mbar_init(sm.v_full(s), 1);
      mbar_init(sm.k_empty(s), 128 * kConsumers);  // every consumer thread releases
      mbar_init(sm.v_empty(s), 128 * kConsumers);
      if constexpr (kStaging) {
        mbar_init(sm.t_go(s), 1);
        mbar_init(sm.t_full(s), kLoaders);
        mbar_init(sm.t_empty(s), 128 * kConsumers);
      }
      if constexpr (kTileTma) {
        mbar_init(sm.b_full(s), 1);
        mbar_init(sm.b_empty(s), 128 * kConsumers);
      }
    }
    mbar_fence_init();
  }
  __syncthreads();  // the last CTA-wide barrier: the producer leaves early

  if (wg == 0) {
    regs_dec<kProducerRegs>();
    const int pw = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 32, 0);
    if (pw == 0) {
      if (threadIdx.x == 0) {
        int j = 0, k = 0;  // tiles and items so far
        if constexpr (kPersistent) {
          const Items items(params);
          for (int r = 0, i = items.of_round(0); i < items.total; i = items.of_round(++r)) {
            const Item it = items.at(i);
            if constexpr (flexc_attn::kVarlen) {
              const FlexcAttentionParams s = flexc_attn::sequence_params(params, it.b);
              if (it.m_block * kBlockM >= s.q_len) continue;
              produce(sm, ring, tq, tk, tv, tb, bm, s, args, it, k++, j);
            } else {
              produce(sm, ring, tq, tk, tv, tb, bm, params, args, it, k++, j);
            }
          }
          // No item is left: the consumers stop at it.
          if (k > 0) mbar_wait(sm.q_empty(), (k - 1) & 1);
          st_shared(sm.item(), kEnd);
          mbar_arrive(sm.q_full());
        } else {
          const Item it = cta_item();
          produce(sm, ring, tq, tk, tv, tb, bm, flexc_attn::item_params(params, it.b), args, it, k,
                  j);
        }
        hand_over(sm, j, kEnd, 0, 0);
      }
    } else if (kStaging) {
      load_staged(sm, q_smem, params, args, int(threadIdx.x) - 32);
    }
    return;
  }
  regs_inc<kConsumerRegs>();   // paid for by the producer's decrease: see kLaunchRegs
  const int cw = wg - 1;       // consumer 0, 1 (or 2)
  const int q_rows = cw * 64;  // its first row in the Q tile
  const int warp = (static_cast<int>(threadIdx.x) >> 5) - 4;  // warp among the consumers
  const float to_log2 = flexc_attn::units_log2(params);
  // Round robin: consumer c issues its products after consumer c - 1 issued its own. Per work
  // item, the last consumer lets consumer 0 go first and skips its last hand-over, so every
  // barrier phase that is started is completed before the next item (and the CTA's exit). All
  // visit the same tiles. Not at D 64 with two consumers (the 128-row tiles of a masked call at
  // short lengths): their products are short, and the turns cost more than they order there
  // (+5-6% without them at causal 1k; three consumers lost 10-20% without; docs/perf.md). The
  // stages' mbarriers keep the consumers within two tiles of each other, and a consumer whose
  // rows are all past q_len waits for each stage's last release before its own.
  constexpr bool kTurns = !(kD == 64 && kDv == 64 && kConsumers == 2);
  auto take_turn = [&] {
    if constexpr (kTurns) named_sync(kTurnBarrier + cw, 256);
  };
  auto pass_turn = [&](bool last) {
    if (kTurns && !(cw == kConsumers - 1 && last))
      named_arrive(kTurnBarrier + (cw + 1 == kConsumers ? 0 : cw + 1), 256);
  };
  // The current tile's first kv index and its kind for this consumer's rows: with three
  // consumers over two BlockMask rows a tile may be empty for some (kMayBeEmpty), which then
  // skip its loads and mask its scores whole.
  constexpr bool kMayBeEmpty = kConsumers > 2;

  // A persistent CTA stores an item's output while the next item's first Q.K^T runs (kDefer): its
  // rows wait staged in shared memory, their LSEs and the item in registers (flush stores them).
  // At D 128: +2-4% without a mask at 1k and 2k, causal within the noise; at D 64 -6% (its short
  // Q.K^T hides less than the stores delay the first tile's softmax; docs/perf.md).
  // (Not over packed sequences: the stores would need the previous item's sequence.)
  constexpr bool kDefer = kPersistent && kSeparateO && kPeelFirst && !flexc_attn::kF32Out &&
                          !flexc_attn::kVarlen && kD == 128 && kDv == 128;
  unsigned char* const o_smem = q_smem + (sm.o - sm.q);
  float done_lse[1][2];
  int done_b = -1, done_h = 0, done_row0 = 0;  // done_b < 0: nothing to store
  auto flush = [&] {
    if constexpr (kDefer) {
      if (done_b >= 0)
        flexc_attn::put_rows<OTile>(done_lse, o_smem, warp * 16, params, done_b, done_h, done_row0);
      done_b = -1;
    }
  };

  // Tiles and items so far, as the producer counts them: tile j's ring word is j + k.
  for (int j = 0, k = 0;; ++k) {
    if (!kPersistent && k > 0) break;
    mbar_wait(sm.q_full(), k & 1);
    Item it;
    if constexpr (kPersistent) {
      it.m_block = int(ld_shared_volatile(sm.item()));
      if (unsigned(it.m_block) == kEnd) {
        flush();
        break;
      }
      it.h = int(ld_shared_volatile(sm.item() + 4));
      it.b = int(ld_shared_volatile(sm.item() + 8));
    } else {
      it = cta_item();
    }
    const int h = it.h, b = it.b, q0 = it.m_block * kBlockM;
    auto&& p = flexc_attn::item_params(params, b);
    const int active = active_consumers(p, q0);
    const int row0 = q0 + warp * 16;  // this warp's first query row

    unsigned word = ring[(j + k) % kRing];  // the item's first tile's (kEnd: no tile)
    auto next_word = [&] { return ring[(j + 1 + k) % kRing]; };  // tile j + 1's
    // Whether this consumer's tiles end at `w`: the item's end, or (two BlockMask rows) its row's
    // tiles are all taken, and the union's later tiles, empty for its rows, are the other
    // row's: it leaves them to the other consumers (a causal 192-row tile's last one for one or
    // two of its three) and only releases their stages.
    auto ends = [&](unsigned w) {
      return w == kEnd || (kSkipDone && ((w >> (2 * cw)) & 3u) == flexc_attn::kTileDone);
    };
    if (kTurns && cw == kConsumers - 1 && word != kEnd) named_arrive(kTurnBarrier, 256);
    // The item's tiles from j on without computing them: the turns and the stages' releases go
    // on. The turns (or without them the waits below) order each release after the previous
    // phase's.
    auto release_rest = [&] {
      for (; word != kEnd; ++j) {
        const int st = j % kStages;
        mbar_wait(sm.k_full(st), (j / kStages) & 1);
        word = next_word();
        take_turn();
        pass_turn(word == kEnd);
        if constexpr (!kTurns) {
          // Without the turns' lockstep this consumer could release a stage again before the
          // active one released its last use (two arrivals in one phase): it waits for that
          // release first, as the producer and the loaders do. (K's is ordered by k_full.)
          const unsigned last_use = ((j / kStages) & 1) ^ 1;
          if constexpr (kStaging) mbar_wait(sm.t_empty(st), last_use);
          if constexpr (kTileTma) mbar_wait(sm.b_empty(st), last_use);
          mbar_wait(sm.v_empty(st), last_use);
        }
        mbar_arrive(sm.k_empty(st));
        if constexpr (kStaging) mbar_arrive(sm.t_empty(st));
        if constexpr (kTileTma) mbar_arrive(sm.b_empty(st));
        mbar_arrive(sm.v_empty(st));
      }
    };
    if (cw >= active) {
      // Rows past q_len (the last q tile's): nothing to compute.
      flush();
      release_rest();
      mbar_arrive(sm.q_empty());
      continue;
    }

    // kQRegs: the warp's Q rows as A fragments, read once per item.
    unsigned qa[kQFragments][4];
    if constexpr (kQRegs) {
      unsigned w[2][2 * kQFragments];
      ldmatrix_c<QTile>(w, sm.q, warp * 16);
#pragma unroll
      for (int kk = 0; kk < kQChunks; ++kk) {
        qa[kk][0] = w[0][2 * kk], qa[kk][1] = w[1][2 * kk];
        qa[kk][2] = w[0][2 * kk + 1], qa[kk][3] = w[1][2 * kk + 1];
      }
      // Q's last reader: the next item's Q may load (a persistent CTA) with O staged apart.
      if constexpr (kSeparateO && kQChunks == kD / 16) mbar_arrive(sm.q_empty());
    }
    float o[1][kDT][4];  // one row tile per warp: the shape OnlineSoftmax and store_rows take
    float s[1][kNT][4];
    unsigned pa[kNT / 2][4];
    if constexpr (!kPeelFirst)
#pragma unroll
      for (int kk = 0; kk < kNT / 2; ++kk) pa[kk][0] = pa[kk][1] = pa[kk][2] = pa[kk][3] = 0u;
    auto qk = [&](int st) {
      if constexpr (kQRegs)
        issue_qk(s[0], qa, sm.q, q_rows, sm.k_tile(st));
      else
        issue_qk(s[0], sm.q, q_rows, sm.k_tile(st));
    };
    zero_fragments(o);
    if (ends(word)) flush();  // no first tile to store under
    OnlineSoftmax<1, kNT> softmax;
    softmax.init();
    int kv0 = 0;
    unsigned kind = flexc_attn::kTileEmpty;
    typename Scores::Columns cols;
    auto read_word = [&] {
      if constexpr (kWide) {
        // Over two BlockMask tiles of different kinds: partial, each key taking its own.
        kv0 = int(word >> 8) * kBlockN;
        cols.kind_lo = (word >> (4 * cw)) & 3u, cols.kind_hi = (word >> (4 * cw + 2)) & 3u;
        const bool same = cols.kind_lo == cols.kind_hi;
        kind = same ? cols.kind_lo : flexc_attn::kTilePartial;
        cols.split = same ? 0 : (kv0 / bm.kv_tile + 1) * bm.kv_tile + flexc_attn::kv_pos0(p);
      } else {
        kv0 = int(word & ~kKindMask);
        kind = (word >> (2 * cw)) & 3u;
      }
    };
    // score_mod's tile loads (a [Q_LEN, KV_LEN] bias) of the current tile, issued before this
    // consumer waits for its turn and for S: the wait hides their latency. The rows' pointers
    // are the q tile's, pinned in registers.
    // With kTileTma they come by TMA instead, read in softmax_tile.
    typename Scores::TileRows tile_rows{};
    if constexpr (!kTileTma) tile_rows = Scores::tile_rows(p, args, b, h, row0);
    auto load_columns = [&] {
      if constexpr (!kTileTma) {
        tile_rows.pin();
        if (!(kMayBeEmpty && kind == flexc_attn::kTileEmpty))
          Scores::load_columns(cols, tile_rows, p, args, b, h, row0, kv0);
      }
    };
    // Hooks and softmax of tile jt (stage st) in s (left as probabilities); whether O must be
    // rescaled. A tile empty for these rows contributes nothing: apply_mods masks it whole in
    // its edge branch. Its staged loads are read here, and released.
    auto softmax_tile = [&](int jt, int st, float(&alpha)[1][2]) {
      if constexpr (kStaging) {
        mbar_wait(sm.t_full(st), (jt / kStages) & 1);
        cols.staged = Staged::view(q_smem + (sm.t_tile(st) - sm.q));
        if constexpr (RelTable::kTerms > 0)
          cols.rel = RelTable::thread_view(
              reinterpret_cast<const unsigned*>(q_smem + (sm.table(st, cw) - sm.q)),
              (warp & 3) * 16);
      }
      if constexpr (kTileTma) {
        mbar_wait(sm.b_full(st), (jt / kStages) & 1);
        unsigned w[2][kNT];
        ldmatrix_c<BTile>(w, sm.b_tile(st), warp * 16);
        mbar_arrive(sm.b_empty(st));
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
          for (int jj = 0; jj < kNT; ++jj) cols.tile[0][r][jj][0] = w[r][jj];
      }
      Scores::apply_mods(s, p, args, b, h, row0, kv0, kind == flexc_attn::kTilePartial, &cols,
                         kMayBeEmpty && kind == flexc_attn::kTileEmpty);
      if constexpr (kStaging) mbar_arrive(sm.t_empty(st));
      return softmax.step(s, to_log2, alpha);
    };

    // The item's first tile has no P.V to overlap: peeled (kPeelFirst), so that in the loop every
    // issue has its wait on every path (ptxas serializes wgmmas when it cannot prove that); or in
    // the loop, with a P.V of zeros.
    const int j0 = j;
    if (kPeelFirst && !ends(word)) {
      const int st = j % kStages;
      read_word();
      load_columns();
      mbar_wait(sm.k_full(st), (j / kStages) & 1);
      word = next_word();  // published before K_j arrived; read before the turn, which waits anyway
      take_turn();
      wgmma_fence();
      qk(st);
      pass_turn(word == kEnd);
      flush();
      wgmma_wait<0>();
      fence_regs(s[0]);
      mbar_arrive(sm.k_empty(st));
      float alpha[1][2];
      softmax_tile(j, st, alpha);  // O is still 0: nothing to rescale
      pack_p(s[0], pa);
      ++j;
    }
    for (; !ends(word); ++j) {
      // Without the peel, the first tile's P.V multiplies zeros (pa) by its own V tile: the same
      // wgmmas on every path (a branch around them makes ptxas serialize them, C7519).
      const bool first = !kPeelFirst && j == j0;
      const int st = j % kStages, pv = first ? st : (j + kStages - 1) % kStages;
      read_word();
      load_columns();
      mbar_wait(sm.k_full(st), (j / kStages) & 1);
      word = next_word();
      mbar_wait(sm.v_full(pv), ((first ? j : j - 1) / kStages) & 1);
      take_turn();
      fence_regs(pa);
      fence_regs(o[0]);
      wgmma_fence();
      qk(st);
      issue_pv(o[0], pa, sm.v_tile(pv));
      pass_turn(word == kEnd);
      wgmma_wait<1>();  // S_j; P_{j-1}.V_{j-1} may still run
      fence_regs(s[0]);
      mbar_arrive(sm.k_empty(st));
      float alpha[1][2];
      const bool rescale = softmax_tile(j, st, alpha);
      wgmma_wait<0>();  // P_{j-1}.V_{j-1}
      fence_regs(o[0]);
      if (!first) mbar_arrive(sm.v_empty(pv));
      if (rescale) softmax.rescale(o, alpha);
      // Packed only now: registers a running wgmma reads must not change (ptxas would serialize
      // every wgmma to protect them).
      pack_p(s[0], pa);
    }
    // Q's last reader (Q.K^T) is done: the next item's Q may load while this one finishes.
    if constexpr (kSeparateO && kQChunks < kD / 16) mbar_arrive(sm.q_empty());
    if (j > j0) {
      const int last = (j - 1) % kStages;
      mbar_wait(sm.v_full(last), ((j - 1) / kStages) & 1);
      fence_regs(pa);
      fence_regs(o[0]);
      wgmma_fence();
      issue_pv(o[0], pa, sm.v_tile(last));
      wgmma_wait<0>();
      fence_regs(o[0]);
      mbar_arrive(sm.v_empty(last));
    }
    if constexpr (kSkipDone) release_rest();  // the other BlockMask row's last tiles
    float inv_sum[1][2], lse[1][2];
    softmax.finish(to_log2, flexc_attn::units_ln(p), inv_sum, lse);
    flexc_attn::add_row_terms(inv_sum, lse, p, args, b, h, row0);
    flexc_attn::nan_if_bad_keys(params, b, inv_sum, lse);
    if constexpr (kDefer) {
      __syncwarp();  // the warp's reads of its rows of the last item's O are done
      flexc_attn::stage_rows<OTile, kBf16>(o, inv_sum, o_smem, warp * 16);
#pragma unroll
      for (int r = 0; r < 2; ++r) done_lse[0][r] = lse[0][r];
      done_b = b, done_h = h, done_row0 = row0;
    } else if constexpr (kSeparateO) {
      __syncwarp();  // the warp's reads of its rows of the last item's O are done
      flexc_attn::store_rows<OTile, kBf16>(o, inv_sum, lse, o_smem, warp * 16, p, b, h, row0);
    } else {
      // The warpgroup's wgmma reads of its Q rows are over before any of its warps overwrites
      // them; its writes reach the next Q's TMA load (the async proxy) before it is issued.
      named_sync(kEpilogueBarrier + cw, 128);
      flexc_attn::store_rows<OTile, kBf16>(o, inv_sum, lse, q_smem, warp * 16, p, b, h, row0);
      fence_proxy_async();
      mbar_arrive(sm.q_empty());
    }
  }
}
