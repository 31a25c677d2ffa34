// Forward attention for Hopper (sm_90a): the products on wgmma, everything else shared with the
// portable kernel (attention_tile.cuh: BlockMask schedule, hooks, epilogue; online_softmax.cuh).
//
// One CTA of three warpgroups per (128-row q tile, query head, batch), FlashAttention-3's layout:
// - warpgroup 0 produces: one thread loads Q once and then K and V tile by tile with TMA into
//   wgmma's 128-byte-swizzled layout (zeros past the lengths), two stages each, each load
//   completing on a "full" mbarrier; it waits on the stage's "empty" mbarrier before reusing it.
//   It gives most of its registers to the consumers.
// - warpgroups 1 and 2 consume, 64 q rows each. Per kv tile j a consumer issues S_j = Q.K_j^T and
//   O += P_{j-1}.V_{j-1} back to back, then runs the hooks and the online softmax of tile j while
//   the tensor cores finish P.V (intra-warpgroup overlap). The two consumers take turns issuing
//   (ping-pong on named barriers), so one's softmax runs while the other's products do. P never
//   leaves registers: wgmma takes A from registers in the layout the softmax leaves it in.
//
// Compile-time configuration (from src/attention.cpp's fwd_config_sm90, which sizes the launch):
// FLEXC_HEAD_DIM (q and k) and FLEXC_HEAD_DIM_V (v and the output), each 64, 96, 128, 192 or 256,
// FLEXC_BF16, FLEXC_BLOCK_M (128: two consumers of 64 rows), FLEXC_BLOCK_N (128; 64 when a head
// dim is above 128: O takes 96 or 128 registers of a consumer thread's 240, and shared memory
// must hold Q and two stages of K and V), FLEXC_STAGES (2).
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
constexpr int kThreads = 384;  // producer + two consumers; the host launches 128 * (1 + kBlockM / 64)
constexpr int kNT = kBlockN / 8;  // n8 column tiles of S per warp
constexpr int kDT = kDv / 8;      // n8 column tiles of O per warp

constexpr bool head_dim_ok(int d) { return d == 64 || d == 96 || d == 128 || d == 192 || d == 256; }
static_assert(head_dim_ok(kD) && head_dim_ok(kDv), "head dims 64, 96, 128, 192 or 256");
static_assert(kBlockM == 128 && (kBlockN == 128 || kBlockN == 64) && kStages >= 2,
              "the configurations built and tested");
// setmaxnreg below: the launch gives each thread kLaunchRegs registers, and the consumers' increase
// must be covered by what the producer releases, or it waits forever.
constexpr int kLaunchRegs = (65536 / kThreads) & ~7;
constexpr int kProducerRegs = 24, kConsumerRegs = 240;
static_assert(128 * (kLaunchRegs - kProducerRegs) >= 256 * (kConsumerRegs - kLaunchRegs),
              "register reallocation must balance");

using QTile = Sw128Tile<kBlockM, kD>;
using KTile = Sw128Tile<kBlockN, kD>;
using VTile = Sw128Tile<kBlockN, kDv>;
using OTile = Sw128Tile<kBlockM, kDv>;  // the epilogue's staging, over Q
// score_mod's relative terms, tabulated per consumer (64 rows) and kv tile: two tables per
// consumer, since it fills the next tile's while the last one's may still be read.
using RelTable = flexc_attn::RelTable<64, kBlockN>;
constexpr int kRelBytes = 2 * 2 * RelTable::kWords * 4;
// Shared memory: Q (or O's staging, the larger), K[kStages], V[kStages] (each 1024-byte aligned:
// the sizes are multiples of 1024; head dim 96 keeps whole 64-column panels, TMA zero-filling the
// last 32), then the mbarriers and the relative-term tables (src/attention.cpp adds their bytes
// by dsl::LaunchFacts). The host adds 1024 bytes for aligning the dynamic base.
constexpr int kBarriers = 1 + 4 * kStages;  // q_full, k_full[], v_full[], k_empty[], v_empty[]
constexpr int kQBytes = QTile::kBytes > OTile::kBytes ? QTile::kBytes : OTile::kBytes;
constexpr int kSmemBytes =
    kQBytes + kStages * (KTile::kBytes + VTile::kBytes) + 8 * kBarriers + kRelBytes;
static_assert(kSmemBytes + 1024 <= 227 * 1024, "fits Hopper's shared memory per block");
// Named barriers: 0 is __syncthreads; ping-pong turns of consumers 0 / 1; per-consumer epilogue;
// per-consumer relative-term tables.
constexpr int kTurnBarrier = 1, kEpilogueBarrier = 3, kRelBarrier = 5;

using KvSchedule = flexc_attn::KvSchedule<kBlockN>;
using Scores = flexc_attn::ScoreTile<1, kNT>;

struct Smem {
  unsigned q, k, v, bars;  // shared-memory addresses
  __device__ __forceinline__ unsigned k_tile(int s) const { return k + s * KTile::kBytes; }
  __device__ __forceinline__ unsigned v_tile(int s) const { return v + s * VTile::kBytes; }
  __device__ __forceinline__ unsigned q_full() const { return bars; }
  __device__ __forceinline__ unsigned k_full(int s) const { return bars + 8 * (1 + s); }
  __device__ __forceinline__ unsigned v_full(int s) const { return bars + 8 * (1 + kStages + s); }
  __device__ __forceinline__ unsigned k_empty(int s) const { return bars + 8 * (1 + 2 * kStages + s); }
  __device__ __forceinline__ unsigned v_empty(int s) const { return bars + 8 * (1 + 3 * kStages + s); }
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

// Warpgroup 0: the loads. Stage s of round r (tile j = r * kStages + s) is reused once both
// consumers released round r - 1.
__device__ __forceinline__ void produce(const Smem& sm, const FlexcTensorMap& tq,
                                        const FlexcTensorMap& tk, const FlexcTensorMap& tv,
                                        const KvSchedule& sched, int q0, int h, int h_kv, int b) {
  load_tile<QTile>(sm.q, tq, q0, h, b, sm.q_full());
  KvSchedule::Cursor cur;
  for (int j = 0; j < sched.count; ++j) {
    const int s = j % kStages;
    const unsigned empty_parity = ((j / kStages) & 1) ^ 1;
    const int kv0 = sched.start(cur);
    sched.advance(cur);
    mbar_wait(sm.k_empty(s), empty_parity);
    load_tile<KTile>(sm.k_tile(s), tk, kv0, h_kv, b, sm.k_full(s));
    mbar_wait(sm.v_empty(s), empty_parity);
    load_tile<VTile>(sm.v_tile(s), tv, kv0, h_kv, b, sm.v_full(s));
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
  sm.bars = sm.v + kStages * VTile::kBytes;
  unsigned char* q_smem = smem_raw + (sm.q - raw);

  // Heaviest q tiles first: under a causal mask the last ones visit the most kv tiles. With a
  // head-shared [Q_LEN, KV_LEN] tile load the grid is (heads, q tiles) instead (dsl::LaunchFacts),
  // so that the heads of one q tile, which read the same rows of it, run together; the two then
  // go through a shuffle, which keeps them in registers: read again from special registers for
  // the tile loads' row offsets of each kv tile, they cost bias_2d 8-14% at D 128 (docs/perf.md).
  constexpr bool kHeadsFirst = FlexcVariant::kScoreTilesShareHeads;
  int m_block = gridDim.x - 1 - blockIdx.x, h = blockIdx.y;
  if constexpr (kHeadsFirst) {
    m_block = __shfl_sync(0xffffffffu, int(gridDim.y - 1 - blockIdx.y), 0);
    h = __shfl_sync(0xffffffffu, int(blockIdx.x), 0);
  }
  const int b = blockIdx.z;
  const int h_kv = h / (p.q_heads / p.kv_heads);
  const int q0 = m_block * kBlockM;
  const KvSchedule sched(bm, b, h, q0, p.kv_len);
  const int count = sched.count;
  // Warp-uniform to the compiler too (a shuffle from lane 0), so role branches stay uniform.
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);

  if (threadIdx.x == 0) {
    mbar_init(sm.q_full(), 1);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(sm.k_full(s), 1);
      mbar_init(sm.v_full(s), 1);
      mbar_init(sm.k_empty(s), 256);  // every consumer thread releases
      mbar_init(sm.v_empty(s), 256);
    }
    mbar_fence_init();
  }
  __syncthreads();  // the last CTA-wide barrier: the producer leaves early

  if (wg == 0) {
    regs_dec<kProducerRegs>();
    if (threadIdx.x == 0) produce(sm, tq, tk, tv, sched, q0, h, h_kv, b);
    return;
  }
  regs_inc<kConsumerRegs>();  // 128 x (168 - 24) = 256 x (240 - 168): see kLaunchRegs
  const int cw = wg - 1;                                     // consumer 0 or 1
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
  KvSchedule::Cursor cur;

  mbar_wait(sm.q_full(), 0);
  // Ping-pong: consumer c issues its products after the other one issued its own. Consumer 1
  // lets consumer 0 go first and skips its last hand-over, so every barrier phase that is started
  // is completed before the CTA exits.
  // Both consumers visit the same `count` tiles (the schedule is per 128-row q tile); a schedule
  // per consumer would need the turns rebalanced, or they deadlock.
  auto take_turn = [&] { named_sync(kTurnBarrier + cw, 256); };
  auto pass_turn = [&](int j) {
    if (!(cw == 1 && j == count - 1)) named_arrive(kTurnBarrier + 1 - cw, 256);
  };
  if (cw == 1 && count > 0) named_arrive(kTurnBarrier, 256);
  // score_mod's column and tile loads (a per-key bias, a [Q_LEN, KV_LEN] one) of the tile `cur`,
  // issued before this consumer waits for its turn and for S: the wait hides their latency.
  typename Scores::Columns cols;
  auto load_columns = [&] { Scores::load_columns(cols, p, args, b, h, row0, sched.start(cur)); };
  // Its relative terms, tabulated by the consumer's 128 threads while Q.K^T runs (ahead of the
  // wait, T5's cost 3% more, docs/perf.md), into the table of tile j's parity; the barrier orders
  // the writes before every thread's reads, and those before the writes of tile j + 2.
  auto fill_rel_table = [&](int j) {
    if constexpr (RelTable::kTerms > 0) {
      unsigned* table = reinterpret_cast<unsigned*>(smem_raw + (sm.bars + 8 * kBarriers - raw)) +
                        (cw * 2 + (j & 1)) * RelTable::kWords;
      RelTable::fill(table, args, b, h, q0 + q_rows + p.q_pos0, sched.start(cur),
                     Scores::hook_q_len(p), p.kv_len, threadIdx.x & 127, 128);
      named_sync(kRelBarrier + cw, 128);
      cols.rel = RelTable::thread_view(table, (warp & 3) * 16);
    }
  };
  // Hooks and softmax of the tile `cur` in s (left as probabilities); whether O must be rescaled.
  auto softmax_tile = [&](float (&alpha)[1][2]) {
    Scores::apply_mods(s, p, args, b, h, row0, sched.start(cur), sched.is_partial(cur), &cols);
    sched.advance(cur);
    return softmax.step(s, to_log2, alpha);
  };

  // Tile 0 has no P.V to overlap: peeled, so that in the loop every issue has its wait on every
  // path (ptxas serializes wgmmas when it cannot prove that).
  if (count > 0) {
    load_columns();
    mbar_wait(sm.k_full(0), 0);
    take_turn();
    wgmma_fence();
    issue_qk(s[0], sm.q, q_rows, sm.k_tile(0));
    pass_turn(0);
    fill_rel_table(0);
    wgmma_wait<0>();
    fence_regs(s[0]);
    mbar_arrive(sm.k_empty(0));
    float alpha[1][2];
    softmax_tile(alpha);  // O is still 0: nothing to rescale
    pack_p(s[0], pa);
  }
  for (int j = 1; j < count; ++j) {
    const int st = j % kStages, prev = (j - 1) % kStages;
    load_columns();
    mbar_wait(sm.k_full(st), (j / kStages) & 1);
    mbar_wait(sm.v_full(prev), ((j - 1) / kStages) & 1);
    take_turn();
    fence_regs(pa);
    fence_regs(o[0]);
    wgmma_fence();
    issue_qk(s[0], sm.q, q_rows, sm.k_tile(st));
    issue_pv(o[0], pa, sm.v_tile(prev));
    pass_turn(j);
    fill_rel_table(j);
    wgmma_wait<1>();  // S_j; P_{j-1}.V_{j-1} may still run
    fence_regs(s[0]);
    mbar_arrive(sm.k_empty(st));
    float alpha[1][2];
    const bool rescale = softmax_tile(alpha);
    wgmma_wait<0>();  // P_{j-1}.V_{j-1}
    fence_regs(o[0]);
    mbar_arrive(sm.v_empty(prev));
    if (rescale) softmax.rescale(o, alpha);
    // Packed only now: registers a running wgmma reads must not change (ptxas would serialize
    // every wgmma to protect them).
    pack_p(s[0], pa);
  }
  if (count > 0) {
    const int last = (count - 1) % kStages;
    mbar_wait(sm.v_full(last), ((count - 1) / kStages) & 1);
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
