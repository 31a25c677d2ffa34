// Forward attention for Hopper (sm_90a): the products on wgmma, everything else shared with the
// portable kernel (attention_tile.cuh: BlockMask schedule, hooks, epilogue; online_softmax.cuh).
//
// One CTA per (q tile, query head, batch), FlashAttention-3's layout: a producer warpgroup and
// one consumer warpgroup per 64 q rows (two for 128-row tiles; three for D 64's 192-row tiles,
// where a tile's products are half as long and a third consumer keeps the tensor cores busy):
// - warpgroup 0 produces: one thread walks the kv tiles (KvUnion: a 192-row tile spans two
//   BlockMask rows), publishes each tile's schedule word (its kv index and each consumer's tile
//   kind) in a ring in shared memory, and loads Q once and then K and V tile by tile with TMA
//   into wgmma's 128-byte-swizzled layout (zeros past the lengths), two stages each, each load
//   completing on a "full" mbarrier; it waits on the stage's "empty" mbarrier before reusing it.
//   Its warps 1-3 stage the hooks' per-key loads of each tile in shared memory
//   (StagedColumns), in stages of their own, so the consumers spend no registers on them.
//   It gives most of its registers to the consumers.
// - the consumers, 64 q rows each: per kv tile j a consumer issues S_j = Q.K_j^T and
//   O += P_{j-1}.V_{j-1} back to back, then runs the hooks and the online softmax of tile j while
//   the tensor cores finish P.V (intra-warpgroup overlap). The consumers take turns issuing
//   (round robin on named barriers), so one's softmax runs while another's products do. P never
//   leaves registers: wgmma takes A from registers in the layout the softmax leaves it in. A tile
//   empty for a consumer's rows (the other BlockMask row's) has its scores masked whole: P = 0.
//
// Compile-time configuration (from src/attention.cpp's fwd_config_sm90, which sizes the launch):
// FLEXC_HEAD_DIM (q and k) and FLEXC_HEAD_DIM_V (v and the output), each 64, 96, 128, 192 or 256,
// FLEXC_BF16, FLEXC_BLOCK_M (128: two consumers of 64 rows; 192 at D 64: three), FLEXC_BLOCK_N
// (128; 64 when a head dim is above 128: O takes 96 or 128 registers of a consumer thread's 240,
// and shared memory must hold Q and two stages of K and V), FLEXC_STAGES (2).
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
constexpr int kConsumers = kBlockM / 64;
constexpr int kThreads = 128 * (1 + kConsumers);  // the host launches as many
constexpr int kNT = kBlockN / 8;  // n8 column tiles of S per warp
constexpr int kDT = kDv / 8;      // n8 column tiles of O per warp

constexpr bool head_dim_ok(int d) { return d == 64 || d == 96 || d == 128 || d == 192 || d == 256; }
static_assert(head_dim_ok(kD) && head_dim_ok(kDv), "head dims 64, 96, 128, 192 or 256");
static_assert((kBlockM == 128 || (kBlockM == 192 && kD == 64 && kDv == 64)) &&
                  (kBlockN == 128 || kBlockN == 64) && kStages >= 2,
              "the configurations built and tested");
// The schedule the producer publishes: per kv tile one word, the tile's first kv index (a multiple
// of kBlockN) with consumer c's TileKind in bits 2c, 2c + 1; kEnd after the last tile. Word j + 1
// is written before K_j's load arrives on its "full" barrier, so a consumer that waited for K_j
// reads it; the ring outlasts the kStages tiles a consumer may lag behind the producer.
constexpr int kRing = 8;
constexpr unsigned kEnd = 0xffffffffu, kKindMask = (1u << (2 * kConsumers)) - 1;
static_assert(kBlockN >= (1 << (2 * kConsumers)) && kRing > kStages + 1,
              "kinds fit below the kv index; the ring outlasts the stages");

using QTile = Sw128Tile<kBlockM, kD>;
using KTile = Sw128Tile<kBlockN, kD>;
using VTile = Sw128Tile<kBlockN, kDv>;
using OTile = Sw128Tile<kBlockM, kDv>;  // the epilogue's staging, over Q
// score_mod's relative terms, tabulated per consumer (64 rows) and kv tile: two tables per
// consumer, since it fills the next tile's while the last one's may still be read.
using RelTable = flexc_attn::RelTable<64, kBlockN>;
constexpr int kRelBytes = 2 * RelTable::kWords * 4;  // a consumer's
// Shared memory: Q (or O's staging, the larger), K[kStages], V[kStages] (each 1024-byte aligned:
// the sizes are multiples of 1024; head dim 96 keeps whole 64-column panels, TMA zero-filling the
// last 32), the staged column loads' stages, then the mbarriers, the schedule ring, the staged
// loads' kv indices and the relative-term tables (src/attention.cpp adds the staged loads' and
// the tables' bytes by dsl::LaunchFacts). The host adds 1024 bytes for aligning the dynamic base.
// q_full, k_full[], v_full[], k_empty[], v_empty[], then the staged loads' t_go[], t_full[],
// t_empty[]
constexpr int kBarriers = 1 + 7 * kStages;
constexpr int kQBytes = QTile::kBytes > OTile::kBytes ? QTile::kBytes : OTile::kBytes;
// score_mod's and mask_mod's column loads, staged per kv tile in shared memory by the producer's
// warps 1-3 (the loaders), in stages beside K's and V's: the consumers then hold no registers for them across
// their waits (D 64's 160 registers need that).
constexpr int kLoaders = 96;
using Staged = flexc_attn::StagedColumns<kBlockN>;
constexpr bool kStaging = Staged::kBytes > 0;
constexpr int kSmemBytes = kQBytes + kStages * (KTile::kBytes + VTile::kBytes + Staged::kBytes) +
                           8 * kBarriers + 4 * kRing + 4 * kStages + kConsumers * kRelBytes;
static_assert(kSmemBytes + 1024 <= 227 * 1024, "fits Hopper's shared memory per block");
// setmaxnreg below: the launch gives each thread kLaunchRegs registers, and the consumers' increase
// must be covered by what the producer releases, or it waits forever (FlashAttention-3's split).
// With two consumers, loaders take 40 and leave their consumers 232; with three, 32 each is all
// there is.
constexpr int kLaunchRegs = (65536 / kThreads) & ~7;
constexpr int kProducerRegs = kConsumers == 2 ? (kStaging ? 40 : 24) : 32;
constexpr int kConsumerRegs = kConsumers == 2 ? (kStaging ? 232 : 240) : 160;
static_assert(128 * (kLaunchRegs - kProducerRegs) >=
                  128 * kConsumers * (kConsumerRegs - kLaunchRegs),
              "register reallocation must balance");
// Named barriers: 0 is __syncthreads; then per consumer its turns, its epilogue, its relative-term
// tables.
constexpr int kTurnBarrier = 1, kEpilogueBarrier = 1 + kConsumers,
              kRelBarrier = 1 + 2 * kConsumers;
static_assert(kRelBarrier + kConsumers <= 16, "16 named barriers");

using Scores = flexc_attn::ScoreTile<1, kNT, flexc_attn::Rows::Q, Staged, kConsumers == 3>;

struct Smem {
  unsigned q, k, v, t, bars, ring;  // shared-memory addresses
  __device__ __forceinline__ unsigned k_tile(int s) const { return k + s * KTile::kBytes; }
  __device__ __forceinline__ unsigned v_tile(int s) const { return v + s * VTile::kBytes; }
  __device__ __forceinline__ unsigned q_full() const { return bars; }
  __device__ __forceinline__ unsigned k_full(int s) const { return bars + 8 * (1 + s); }
  __device__ __forceinline__ unsigned v_full(int s) const { return bars + 8 * (1 + kStages + s); }
  __device__ __forceinline__ unsigned k_empty(int s) const { return bars + 8 * (1 + 2 * kStages + s); }
  __device__ __forceinline__ unsigned v_empty(int s) const { return bars + 8 * (1 + 3 * kStages + s); }
  // The staged loads: stage s's kv index published (by the producer thread, once the stage is
  // free), its loads landed (the loaders), its reads done (every consumer thread).
  __device__ __forceinline__ unsigned t_go(int s) const { return bars + 8 * (1 + 4 * kStages + s); }
  __device__ __forceinline__ unsigned t_full(int s) const { return bars + 8 * (1 + 5 * kStages + s); }
  __device__ __forceinline__ unsigned t_empty(int s) const { return bars + 8 * (1 + 6 * kStages + s); }
  __device__ __forceinline__ unsigned t_tile(int s) const { return t + s * Staged::kBytes; }
  __device__ __forceinline__ unsigned staged_kv(int s) const { return ring + 4 * (kRing + s); }
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

// Warpgroup 0's thread 0: the schedule and the TMA loads. Stage s of round r (tile j = r * kStages
// + s) is reused once every consumer released round r - 1. With staged loads it also hands each
// stage's kv index (kEnd after the last) to the loaders once the consumers released the stage.
__device__ __forceinline__ void produce(const Smem& sm, volatile unsigned* ring,
                                        const FlexcTensorMap& tq, const FlexcTensorMap& tk,
                                        const FlexcTensorMap& tv, const FlexcBlockMask& bm,
                                        const FlexcAttentionParams& p, int q0, int active, int h,
                                        int h_kv, int b) {
  // The BlockMask rows of the first and the last active consumer.
  flexc_attn::KvUnion<kBlockN> tiles(bm, b, h, q0, q0 + 64 * (active - 1), p.kv_len);
  // Which of the two rows' kinds each consumer takes (bit c set: the second row's).
  unsigned second = 0;
  if (bm.kv_num != nullptr)
    for (int c = 1; c < active; ++c)
      if ((q0 + 64 * c) / bm.q_tile != q0 / bm.q_tile) second |= 1u << c;
  auto word = [&](int kv0, unsigned kinds) {
    if (kv0 < 0) return kEnd;
    unsigned w = unsigned(kv0);
#pragma unroll
    for (int c = 0; c < kConsumers; ++c)
      if (c < active) w |= ((kinds >> ((second >> c) & 1 ? 2 : 0)) & 3u) << (2 * c);
    return w;
  };
  unsigned kinds = 0;
  int kv0 = tiles.next(bm, p.kv_len, kinds);
  ring[0] = word(kv0, kinds);
  load_tile<QTile>(sm.q, tq, q0, h, b, sm.q_full());
  // The loaders' stage s, free once the consumers read it (before they release V's).
  auto hand_over = [&](int j, unsigned kv) {
    if constexpr (kStaging) {
      const int s = j % kStages;
      mbar_wait(sm.t_empty(s), ((j / kStages) & 1) ^ 1);
      st_shared(sm.staged_kv(s), kv);
      mbar_arrive(sm.t_go(s));
    }
  };
  int j = 0;
  for (; kv0 >= 0; ++j) {
    const int s = j % kStages;
    const unsigned empty_parity = ((j / kStages) & 1) ^ 1;
    const int next = tiles.next(bm, p.kv_len, kinds);
    mbar_wait(sm.k_empty(s), empty_parity);
    ring[(j + 1) % kRing] = word(next, kinds);
    load_tile<KTile>(sm.k_tile(s), tk, kv0, h_kv, b, sm.k_full(s));
    hand_over(j, unsigned(kv0));
    mbar_wait(sm.v_empty(s), empty_parity);
    load_tile<VTile>(sm.v_tile(s), tv, kv0, h_kv, b, sm.v_full(s));
    kv0 = next;
  }
  hand_over(j, kEnd);
}

// Warpgroup 0's warps 1-3 (loader `tid` of kLoaders): the column loads of each kv tile
// the producer thread hands over, until it hands over kEnd.
__device__ __forceinline__ void load_staged(const Smem& sm, const FlexcAttentionParams& p,
                                           const FlexcArgs& args, int h, int b, int tid) {
  for (int j = 0;; ++j) {
    const int s = j % kStages;
    mbar_wait(sm.t_go(s), (j / kStages) & 1);
    const unsigned kv0 = ld_shared_volatile(sm.staged_kv(s));
    if (kv0 == kEnd) break;
    Staged::load(sm.t_tile(s), p, args, b, h, int(kv0), tid, kLoaders);
    mbar_arrive(sm.t_full(s));
  }
}

}  // namespace flexc_fwd90

extern "C" __global__ void __launch_bounds__(flexc_fwd90::kThreads, 1)
    flexc_attention_fwd_sm90(const FlexcAttentionParams p, const FlexcArgs args,
                             const FlexcBlockMask bm, const __grid_constant__ FlexcTensorMap tq,
                             const __grid_constant__ FlexcTensorMap tk,
                             const __grid_constant__ FlexcTensorMap tv) {
  using namespace flexc_fwd90;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // The declared alignment is not promised for dynamic shared memory: align by hand.
  const unsigned raw = smem_addr(smem_raw);
  Smem sm;
  sm.q = (raw + 1023) & ~1023u;
  sm.k = sm.q + kQBytes;
  sm.v = sm.k + kStages * KTile::kBytes;
  sm.t = sm.v + kStages * VTile::kBytes;
  sm.bars = sm.t + kStages * Staged::kBytes;
  sm.ring = sm.bars + 8 * kBarriers;
  unsigned char* q_smem = smem_raw + (sm.q - raw);  // the aligned base
  volatile unsigned* ring = reinterpret_cast<volatile unsigned*>(q_smem + (sm.ring - sm.q));

  // Heaviest q tiles first: under a causal mask the last ones visit the most kv tiles. With a
  // head-shared [Q_LEN, KV_LEN] tile load the grid is (heads, q tiles) instead (dsl::LaunchFacts),
  // so that the heads of one q tile, which read the same rows of it, run together; the two then
  // go through a shuffle, which keeps them in registers (read again from special registers they
  // cost bias_2d 8-14% at D 128 before its row pointers were pinned, still 1% after; docs/perf.md).
  constexpr bool kHeadsFirst = FlexcVariant::kScoreTilesShareHeads;
  int m_block = gridDim.x - 1 - blockIdx.x, h = blockIdx.y;
  if constexpr (kHeadsFirst) {
    m_block = __shfl_sync(0xffffffffu, int(gridDim.y - 1 - blockIdx.y), 0);
    h = __shfl_sync(0xffffffffu, int(blockIdx.x), 0);
  }
  const int b = blockIdx.z;
  const int h_kv = h / (p.q_heads / p.kv_heads);
  const int q0 = m_block * kBlockM;
  // Warp-uniform to the compiler too (a shuffle from lane 0), so role branches stay uniform.
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
  // Consumers whose rows start inside q_len (all but in the last q tile).
  const int active = min(kConsumers, (p.q_len - q0 + 63) / 64);

  if (threadIdx.x == 0) {
    // The host sizes shared memory by this file's rule (src/attention.cpp, fwd_hook_bytes): were
    // they ever to disagree, the kernel would overwrite memory past its own; it stops instead.
    unsigned given;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(given));
    if (given < sm.q - raw + kSmemBytes) __trap();
    mbar_init(sm.q_full(), 1);
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
    }
    mbar_fence_init();
  }
  __syncthreads();  // the last CTA-wide barrier: the producer leaves early

  if (wg == 0) {
    regs_dec<kProducerRegs>();
    const int pw = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 32, 0);
    if (pw == 0) {
      if (threadIdx.x == 0) produce(sm, ring, tq, tk, tv, bm, p, q0, active, h, h_kv, b);
    } else if (kStaging) {
      load_staged(sm, p, args, h, b, int(threadIdx.x) - 32);
    }
    return;
  }
  regs_inc<kConsumerRegs>();  // paid for by the producer's decrease: see kLaunchRegs
  const int cw = wg - 1;                                     // consumer 0, 1 (or 2)
  const int q_rows = cw * 64;                                // its first row in the Q tile
  const int warp = (static_cast<int>(threadIdx.x) >> 5) - 4;  // warp among the consumers
  const int row0 = q0 + warp * 16;                           // this warp's first query row

  float o[1][kDT][4];  // one row tile per warp: the shape OnlineSoftmax and store_rows take
  float s[1][kNT][4];
  unsigned pa[kNT / 2][4];
  zero_fragments(o);
  OnlineSoftmax<1, kNT> softmax;
  softmax.init();
  const float to_log2 = flexc_attn::units_log2(p);

  mbar_wait(sm.q_full(), 0);
  unsigned word = ring[0];  // tile 0's (kEnd: no tile)
  // Round robin: consumer c issues its products after consumer c - 1 issued its own. The last
  // consumer lets consumer 0 go first and skips its last hand-over, so every barrier phase that
  // is started is completed before the CTA exits. All visit the same tiles.
  auto take_turn = [&] { named_sync(kTurnBarrier + cw, 256); };
  auto pass_turn = [&](bool last) {
    if (!(cw == kConsumers - 1 && last))
      named_arrive(kTurnBarrier + (cw + 1 == kConsumers ? 0 : cw + 1), 256);
  };
  if (cw == kConsumers - 1 && word != kEnd) named_arrive(kTurnBarrier, 256);
  if (cw >= active) {
    // Rows past q_len (the last q tile's): nothing to compute, but the turns and the stages'
    // releases go on. The turns order each release after the previous phase's.
    for (int j = 0; word != kEnd; ++j) {
      const int st = j % kStages;
      mbar_wait(sm.k_full(st), (j / kStages) & 1);
      word = ring[(j + 1) % kRing];
      take_turn();
      pass_turn(word == kEnd);
      mbar_arrive(sm.k_empty(st));
      if constexpr (kStaging) mbar_arrive(sm.t_empty(st));
      mbar_arrive(sm.v_empty(st));
    }
    return;
  }
  // The current tile's first kv index and its kind for this consumer's rows: with three
  // consumers over two BlockMask rows a tile may be empty for some (kMayBeEmpty), which then
  // skip its loads and mask its scores whole.
  constexpr bool kMayBeEmpty = kConsumers > 2;
  int kv0 = 0;
  unsigned kind = flexc_attn::kTileEmpty;
  auto read_word = [&] {
    kv0 = int(word & ~kKindMask);
    kind = (word >> (2 * cw)) & 3u;
  };
  // score_mod's tile loads (a [Q_LEN, KV_LEN] bias) of the current tile, issued before this
  // consumer waits for its turn and for S: the wait hides their latency. The rows' pointers are
  // the q tile's, pinned in registers.
  typename Scores::Columns cols;
  typename Scores::TileRows tile_rows = Scores::tile_rows(p, args, b, h, row0);
  auto load_columns = [&] {
    tile_rows.pin();
    if (!(kMayBeEmpty && kind == flexc_attn::kTileEmpty))
      Scores::load_columns(cols, tile_rows, p, args, b, h, row0, kv0);
  };
  // Its relative terms, tabulated by the consumer's 128 threads while Q.K^T runs (ahead of the
  // wait, T5's cost 3% more, docs/perf.md), into the table of tile j's parity; the barrier orders
  // the writes before every thread's reads, and those before the writes of tile j + 2. A tile
  // empty here reads the last table (its scores are masked whatever they read).
  unsigned* const tables =
      reinterpret_cast<unsigned*>(q_smem + (sm.ring + 4 * (kRing + kStages) - sm.q));
  cols.rel = RelTable::thread_view(tables + cw * 2 * RelTable::kWords, (warp & 3) * 16);
  auto fill_rel_table = [&](int j) {
    if constexpr (RelTable::kTerms > 0) {
      if (kMayBeEmpty && kind == flexc_attn::kTileEmpty) return;
      unsigned* table = tables + (cw * 2 + (j & 1)) * RelTable::kWords;
      RelTable::fill(table, args, b, h, q0 + q_rows + p.q_pos0, kv0, Scores::hook_q_len(p),
                     p.kv_len, threadIdx.x & 127, 128);
      named_sync(kRelBarrier + cw, 128);
      cols.rel = RelTable::thread_view(table, (warp & 3) * 16);
    }
  };
  // Hooks and softmax of tile j (stage st) in s (left as probabilities); whether O must be
  // rescaled. A tile empty for these rows contributes nothing (a select, not a branch: ptxas
  // keeps two copies of s across a branch that writes it, and spills). Its staged loads are
  // read here, and released.
  auto softmax_tile = [&](int j, int st, float (&alpha)[1][2]) {
    if constexpr (kStaging) {
      mbar_wait(sm.t_full(st), (j / kStages) & 1);
      cols.staged = Staged::view(q_smem + (sm.t_tile(st) - sm.q));
    }
    Scores::apply_mods(s, p, args, b, h, row0, kv0, kind == flexc_attn::kTilePartial, &cols);
    if constexpr (kStaging) mbar_arrive(sm.t_empty(st));
    if constexpr (kMayBeEmpty) {
      const bool empty = kind == flexc_attn::kTileEmpty;
#pragma unroll
      for (int jj = 0; jj < kNT; ++jj)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[0][jj][e] = empty ? flexc_attn::neg_inf() : s[0][jj][e];
    }
    return softmax.step(s, to_log2, alpha);
  };

  // Tile 0 has no P.V to overlap: peeled, so that in the loop every issue has its wait on every
  // path (ptxas serializes wgmmas when it cannot prove that).
  int j = 0;
  if (word != kEnd) {
    read_word();
    load_columns();
    mbar_wait(sm.k_full(0), 0);
    word = ring[1];  // published before K_0 arrived; read before the turn, which waits anyway
    take_turn();
    wgmma_fence();
    issue_qk(s[0], sm.q, q_rows, sm.k_tile(0));
    pass_turn(word == kEnd);
    fill_rel_table(0);
    wgmma_wait<0>();
    fence_regs(s[0]);
    mbar_arrive(sm.k_empty(0));
    float alpha[1][2];
    softmax_tile(0, 0, alpha);  // O is still 0: nothing to rescale
    pack_p(s[0], pa);
    j = 1;
  }
  for (; word != kEnd; ++j) {
    const int st = j % kStages, prev = (j - 1) % kStages;
    read_word();
    load_columns();
    mbar_wait(sm.k_full(st), (j / kStages) & 1);
    word = ring[(j + 1) % kRing];
    mbar_wait(sm.v_full(prev), ((j - 1) / kStages) & 1);
    take_turn();
    fence_regs(pa);
    fence_regs(o[0]);
    wgmma_fence();
    issue_qk(s[0], sm.q, q_rows, sm.k_tile(st));
    issue_pv(o[0], pa, sm.v_tile(prev));
    pass_turn(word == kEnd);
    fill_rel_table(j);
    wgmma_wait<1>();  // S_j; P_{j-1}.V_{j-1} may still run
    fence_regs(s[0]);
    mbar_arrive(sm.k_empty(st));
    float alpha[1][2];
    const bool rescale = softmax_tile(j, st, alpha);
    wgmma_wait<0>();  // P_{j-1}.V_{j-1}
    fence_regs(o[0]);
    mbar_arrive(sm.v_empty(prev));
    if (rescale) softmax.rescale(o, alpha);
    // Packed only now: registers a running wgmma reads must not change (ptxas would serialize
    // every wgmma to protect them).
    pack_p(s[0], pa);
  }
  if (j > 0) {
    const int last = (j - 1) % kStages;
    mbar_wait(sm.v_full(last), ((j - 1) / kStages) & 1);
    fence_regs(pa);
    fence_regs(o[0]);
    wgmma_fence();
    issue_pv(o[0], pa, sm.v_tile(last));
    wgmma_wait<0>();
    fence_regs(o[0]);
  }
  // The warpgroup's wgmma reads of its Q rows are over before any of its warps overwrites them.
  named_sync(kEpilogueBarrier + cw, 128);

  float inv_sum[1][2], lse[1][2];
  softmax.finish(to_log2, flexc_attn::units_ln(p), inv_sum, lse);
  flexc_attn::store_rows<OTile, kBf16>(o, inv_sum, lse, q_smem, warp * 16, p, b, h, row0);
}
