// Backward attention for Hopper (sm_90a): the main kernel of templates/attention/attention_bwd.cuh
// on wgmma (attention_bwd_rows.cuh's prep and dq run around it, and with FLEXC_DETERMINISTIC
// attention_bwd.cuh's dq_rows), everything else shared with it (attention_tile.cuh: column
// schedule, hooks, epilogue; attention_layout.cuh: the dQ accumulator's layout;
// online_softmax.cuh: P from the LSE, dS).
//
// One CTA of three warpgroups per (128-row kv tile, kv head, batch), FlashAttention-3's layout:
// - warpgroup 0 produces: one thread loads K and V once and then, per step (a q tile of one query
//   head of the kv head's group, from the BlockMask's column lists), Q and dO with TMA into two
//   stages, completing on the stage's "full" mbarrier; the warp's lanes put the step's LSE (in
//   log2 units) and delta in shared memory and arrive there too. It waits on "empty" to reuse a
//   stage, and gives most of its registers to the consumers.
// - warpgroups 1 and 2 consume, 64 kv rows each, with dK and dV in registers. Per step, each
//   keeps the tensor cores busy while it does its elementwise work:
//     S^T = K Q^T; dP^T = V dO^T          wgmma, A and B from shared memory (two groups)
//     P^T from the LSE (hooks on logical (q_idx, kv_idx)) while dP^T runs
//     dV += P^T dO                        wgmma, P from registers, runs while dS^T is made
//     dS^T to registers and to the CTA's dS^T tile (both consumers' rows; two buffers)
//     dQ_half = dS K[:, half]             wgmma over all 128 kv rows, after both consumers wrote
//                                         dS^T; consumer c owns dQ's columns [c D/2, (c+1) D/2)
//     dK += dS^T Q                        wgmma, dS from registers, runs while dQ is staged
//   and adds its dQ half (float32, staged in the accumulator's fragment order: conflict-free
//   16-byte stores) into the accumulator with one bulk reduce-add per step. Splitting dQ by
//   columns rather than by kv rows halves the reduce traffic into L2.
// With FLEXC_DETERMINISTIC dQ is left out (attention_bwd.cuh's dq_rows computes it) and the two
// consumers never wait for each other.
//
// Compile-time configuration (src/attention/attention_backward.cpp's bwd_config_sm90):
// FLEXC_HEAD_DIM (64 or 128), FLEXC_BF16, FLEXC_BLOCK_M (64 q rows per step), FLEXC_BLOCK_N (128 kv
// rows per CTA), FLEXC_DETERMINISTIC.
#define FLEXC_ROWS_APART 1  // score_mod's row terms come off the LSE (attention_tile.cuh)
#include "attention_tile.cuh"
#include "online_softmax.cuh"
#include "tile_wgmma.cuh"

namespace flexc_bwd90 {

using namespace flexc_tile;

constexpr int kD = FLEXC_HEAD_DIM;
constexpr bool kBf16 = FLEXC_BF16 != 0;
constexpr int kBlockM = FLEXC_BLOCK_M;
constexpr int kBlockN = FLEXC_BLOCK_N;
constexpr bool kDeterministic = FLEXC_DETERMINISTIC != 0;
constexpr int kStages = 2;
constexpr int kThreads = 384;     // producer + two consumers of 64 kv rows
constexpr int kNT = kBlockM / 8;  // n8 column tiles (queries) of a warp's S^T
constexpr int kDT = kD / 8;       // n8 column tiles of dK, dV, dQ

static_assert(kD == 64 || kD == 128, "head dim 64 or 128");
static_assert(kBlockM == 64 && kBlockN == 128, "the configuration built and tested");
constexpr int kLaunchRegs = (65536 / kThreads) & ~7;
constexpr int kProducerRegs = 24, kConsumerRegs = 240;
static_assert(128 * (kLaunchRegs - kProducerRegs) >= 256 * (kConsumerRegs - kLaunchRegs),
              "register reallocation must balance");

using KvTile = Sw128Tile<kBlockN, kD>;
using QTile = Sw128Tile<kBlockM, kD>;
using DsTile = Sw128Tile<kBlockN, kBlockM>;  // dS^T of the CTA: rows keys, columns queries
using Accum = flexc_attn::DqAccum<kD>;
static_assert(Accum::kRows == kBlockM, "a step's dQ is one accumulator block");
constexpr int kHalfNT = Accum::kHalfCols / 8;     // n8 column tiles of a consumer's dQ half
constexpr int kDqBytes = Accum::kHalfFloats * 4;  // one consumer's staged dQ half
constexpr int kDsBuffers = 2;
// Shared memory (1024-byte aligned pieces): K, V, kStages x (Q, dO), kDsBuffers x dS^T, per
// consumer its dQ half, kStages x (LSE * log2(e), delta) rows, mbarriers. The host adds 1024 for
// alignment.
constexpr int kRowsBytes = 2 * kBlockM * 4;
constexpr int kBarriers = 1 + 2 * kStages;  // kv_full, full[], empty[]
constexpr int kSmemBytes = 2 * KvTile::kBytes + kStages * 2 * QTile::kBytes +
                           (kDeterministic ? 0 : kDsBuffers * DsTile::kBytes + 2 * kDqBytes) +
                           kStages * kRowsBytes + 8 * kBarriers;
static_assert(kSmemBytes + 1024 <= 227 * 1024, "fits Hopper's shared memory per block");
// Named barriers (0 is __syncthreads): both consumers' dS^T written; per consumer, its dQ half.
constexpr int kDsBarrier = 1;
constexpr int kConsumerBarrier = 2;

using Scores = flexc_attn::ScoreTile<1, kNT, flexc_attn::Rows::Kv>;
using Steps = flexc_attn::ColumnSteps<kBlockM>;
constexpr bool kGrad = !FlexcVariant::kScoreGradIsOne;

struct Smem {
  unsigned k, v, stages, ds, dq, rows, bars;
  __device__ __forceinline__ unsigned q_tile(int s) const { return stages + s * 2 * QTile::kBytes; }
  __device__ __forceinline__ unsigned do_tile(int s) const { return q_tile(s) + QTile::kBytes; }
  __device__ __forceinline__ unsigned ds_tile(int i) const { return ds + i * DsTile::kBytes; }
  __device__ __forceinline__ unsigned dq_part(int c) const { return dq + c * kDqBytes; }
  __device__ __forceinline__ unsigned lse2(int s) const { return rows + s * kRowsBytes; }
  __device__ __forceinline__ unsigned delta(int s) const { return lse2(s) + kBlockM * 4; }
  __device__ __forceinline__ unsigned kv_full() const { return bars; }
  __device__ __forceinline__ unsigned full(int s) const { return bars + 8 * (1 + s); }
  __device__ __forceinline__ unsigned empty(int s) const { return bars + 8 * (1 + kStages + s); }
};

// Warp 0 of warpgroup 0: K and V once, then each step's Q, dO (lane 0, TMA) and rows (all lanes).
__device__ __forceinline__ void produce(const Smem& sm, const FlexcAttentionBwdParams& bp,
                                        const FlexcTensorMap& tq, const FlexcTensorMap& tdo,
                                        const FlexcTensorMap& tk, const FlexcTensorMap& tv,
                                        const FlexcArgs& args, Steps steps, int kv0, int h_kv,
                                        int b) {
  const FlexcAttentionParams& p = bp.fwd;
  const int lane = threadIdx.x & 31;
  if (lane == 0) {
    mbar_expect_tx(sm.kv_full(), 2 * KvTile::kBytes);
#pragma unroll
    for (int panel = 0; panel < KvTile::kPanels; ++panel) {
      tma_load_4d(sm.k + panel * KvTile::kPanelBytes, tk, panel * 64, kv0, h_kv, b, sm.kv_full());
      tma_load_4d(sm.v + panel * KvTile::kPanelBytes, tv, panel * 64, kv0, h_kv, b, sm.kv_full());
    }
  }
  int hq, q0;
  bool partial;
  for (int it = 0; steps.next(hq, q0, partial); ++it) {
    const int s = it % kStages;
    mbar_wait(sm.empty(s), ((it / kStages) & 1) ^ 1);
    const long long base = (static_cast<long long>(b) * p.q_heads + hq) * p.q_len;
#pragma unroll
    for (int r = lane; r < kBlockM; r += 32) {
      const int q = q0 + r;
      st_shared(sm.lse2(s) + 4 * r, flexc_attn::row_lse_log2(p, args, b, hq, q));
      st_shared(sm.delta(s) + 4 * r, q < p.q_len ? bp.delta[base + q] : 0.f);
    }
    if (lane == 0) {
      mbar_expect_tx(sm.full(s), 2 * QTile::kBytes);
#pragma unroll
      for (int panel = 0; panel < QTile::kPanels; ++panel) {
        tma_load_4d(sm.q_tile(s) + panel * QTile::kPanelBytes, tq, panel * 64, q0, hq, b,
                    sm.full(s));
        tma_load_4d(sm.do_tile(s) + panel * QTile::kPanelBytes, tdo, panel * 64, q0, hq, b,
                    sm.full(s));
      }
    } else {
      mbar_arrive(sm.full(s));
    }
  }
}

// acc (=) rows [row0, row0 + 64) of `a` (K-major) times the kBlockM rows of `bt` (K-major, as
// B^T): S^T = K Q^T and dP^T = V dO^T.
__device__ __forceinline__ void issue_ss_t(float (&acc)[kNT][4], unsigned a, int row0,
                                           unsigned bt) {
  wgmma_ss<kBf16, 0>(acc, KvTile::k_major(a, row0, 0), QTile::k_major(bt, 0, 0));
#pragma unroll
  for (int kk = 16; kk < kD; kk += 16)
    wgmma_ss<kBf16, 1>(acc, KvTile::k_major(a, row0, kk), QTile::k_major(bt, 0, kk));
}

// acc += A B for A in registers (kBlockM / 16 fragments along the queries) and B the q-row tile
// `b` (MN-major): dV += P^T dO, dK += dS^T Q.
__device__ __forceinline__ void issue_rs(float (&acc)[kDT][4], const unsigned (&a)[kNT / 2][4],
                                         unsigned b) {
#pragma unroll
  for (int kk = 0; kk < kNT / 2; ++kk) wgmma_rs<kBf16>(acc, a[kk], QTile::mn_major(b, kk * 16));
}

// A consumer warpgroup's whole life: the steps, then its dK and dV rows. CAPTURE_GRADS: the call
// asked for capture gradients (the pre-mod scores and the gradient sink then take registers the
// other instance keeps free).
template <bool CAPTURE_GRADS>
__device__ __forceinline__ void consume(const Smem& sm, const FlexcAttentionBwdParams& bp,
                                        const FlexcArgs& args, const Steps& steps,
                                        unsigned char* smem_raw, unsigned raw, int wg, int kv0,
                                        int h_kv, int b) {
  const FlexcAttentionParams& p = bp.fwd;
  const int cw = wg - 1;                     // consumer 0 or 1: kv rows cw * 64 ..
  const int wwarp = (threadIdx.x >> 5) & 3;  // warp within the warpgroup
  const int lane = threadIdx.x & 31;
  const int row0 = kv0 + cw * 64 + wwarp * 16;  // this warp's first kv row
  const bool leader = (threadIdx.x & 127) == 0;

  float dk[1][kDT][4], dv[1][kDT][4];
  zero_fragments(dk);
  zero_fragments(dv);
  FlexcGradSink<FlexcVariant::kCaptureGradLoads> capture_grads;
  const float to_log2 = flexc_attn::units_log2(p);
  // Without capture gradients (which read P itself), P and the derivative become one array
  // (p_grad) as soon as P is packed for dV (softcap at D 128: 152 bytes of spills, 220 without).
  constexpr bool kFoldGrad = kGrad && !CAPTURE_GRADS;

  mbar_wait(sm.kv_full(), 0);
  Steps walk = steps;
  int hq, q0;
  bool partial;
  for (int it = 0; walk.next(hq, q0, partial); ++it) {
    const int st = it % kStages;
    mbar_wait(sm.full(st), (it / kStages) & 1);

    float s[1][kNT][4], dp[1][kNT][4];
    wgmma_fence();
    issue_ss_t(s[0], sm.k, cw * 64, sm.q_tile(st));
    wgmma_commit();
    issue_ss_t(dp[0], sm.v, cw * 64, sm.do_tile(st));
    wgmma_commit();
    wgmma_wait<1>();
    fence_regs(s[0]);

    // P^T while dP^T runs.
    float x[CAPTURE_GRADS && flexc_attn::kKeepPreMod ? kNT : 1][4];
    flexc_attn::keep_pre_mod(s[0], p.scale, x);
    float grad[1][kGrad ? kNT : 1][4];
    Scores::apply_mods<kGrad>(s, grad, p, args, b, hq, row0, q0, partial);
    const float* lse2 = reinterpret_cast<const float*>(smem_raw + (sm.lse2(st) - raw));
    const float* delta = reinterpret_cast<const float*>(smem_raw + (sm.delta(st) - raw));
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        s[0][j][e] = p_from_lse(s[0][j][e], to_log2, lse2[j * 8 + (lane & 3) * 2 + (e & 1)]);
    unsigned pa[kNT / 2][4];
#pragma unroll
    for (int kk = 0; kk < kNT / 2; ++kk) c_to_a<kBf16>(s[0], kk, pa[kk]);
    if constexpr (kFoldGrad)
#pragma unroll
      for (int j = 0; j < kNT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[0][j][e] = p_grad(s[0][j][e], grad[0][j][e]);
    fence_regs(pa);
    fence_regs(dv[0]);
    wgmma_fence();
    issue_rs(dv[0], pa, sm.do_tile(st));
    wgmma_commit();

    // dS^T while dV runs.
    wgmma_wait<1>();
    fence_regs(dp[0]);
    const Scores::Idx idx = Scores::index(hq, row0, q0, p);
    Scores::for_each(idx, [&](int, int j, int e, int, int q_idx, int kv_idx, bool) {
      const int c = j * 8 + (lane & 3) * 2 + (e & 1);
      const float pv = s[0][j][e];
      if constexpr (CAPTURE_GRADS)
        flexc_attn::add_capture_grads(capture_grads, args, p, pv, dp[0][j][e], delta[c], x, j, e, b,
                                      hq, q_idx, kv_idx);
      constexpr bool kFromP = kGrad && !kFoldGrad;  // else pv is p_grad's already
      dp[0][j][e] = dscore<kFromP>(pv, dp[0][j][e], delta[c], grad[0][kGrad ? j : 0][e]);
    });
    unsigned dsa[kNT / 2][4];
#pragma unroll
    for (int kk = 0; kk < kNT / 2; ++kk) c_to_a<kBf16>(dp[0], kk, dsa[kk]);
    if constexpr (!kDeterministic) {
      // This consumer's rows of the CTA's dS^T, for dQ = dS K (A: dS^T read transposed).
      unsigned char* ds_bytes = smem_raw + (sm.ds_tile(it % kDsBuffers) - raw);
#pragma unroll
      for (int kk = 0; kk < kNT / 2; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int row = cw * 64 + wwarp * 16 + (lane >> 2) + (r & 1) * 8;
          const int col = kk * 16 + (r >> 1) * 8 + (lane & 3) * 2;
          *reinterpret_cast<unsigned*>(ds_bytes + DsTile::offset(row, col >> 3) + (col & 7) * 2) =
              dsa[kk][r];
        }
      fence_proxy_async();
    }
    float dq[kHalfNT][4];
    if constexpr (!kDeterministic) {
      // dQ first, so that its half is staged while dK += dS^T Q runs.
      named_sync(kDsBarrier, 256);  // both consumers' rows of dS^T are written
      const unsigned ds_tile = sm.ds_tile(it % kDsBuffers);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockN; kk += 16) {
        if (kk == 0)
          wgmma_ss<kBf16, 0, 1, 1>(dq, DsTile::mn_major(ds_tile, kk),
                                   KvTile::mn_major(sm.k, kk, cw * Accum::kHalfCols));
        else
          wgmma_ss<kBf16, 1, 1, 1>(dq, DsTile::mn_major(ds_tile, kk),
                                   KvTile::mn_major(sm.k, kk, cw * Accum::kHalfCols));
      }
      wgmma_commit();
    }
    fence_regs(dsa);
    fence_regs(dk[0]);
    wgmma_fence();
    issue_rs(dk[0], dsa, sm.q_tile(st));
    wgmma_commit();
    if constexpr (!kDeterministic) {
      wgmma_wait<1>();  // dV and dQ
      fence_regs(dq);
      // The dQ half to shared memory in the accumulator's order (once the last step's reduce has
      // read it), then one bulk reduce-add into the accumulator block of this q tile.
      if (leader) bulk_wait_read<0>();
      named_sync(kConsumerBarrier + cw, 128);
      float* part = reinterpret_cast<float*>(smem_raw + (sm.dq_part(cw) - raw));
      const int t = threadIdx.x & 127;
#pragma unroll
      for (int j = 0; j < kHalfNT; ++j)
        *reinterpret_cast<float4*>(part + (j * 128 + t) * 4) =
            make_float4(dq[j][0], dq[j][1], dq[j][2], dq[j][3]);
      fence_proxy_async();
      named_sync(kConsumerBarrier + cw, 128);
      if (leader) {
        float* acc = bp.dq_accum + Accum::block(p, b, hq, q0) + cw * Accum::kHalfFloats;
        bulk_reduce_add_f32(acc, sm.dq_part(cw), static_cast<unsigned>(kDqBytes));
        bulk_commit();
      }
    }
    wgmma_wait<0>();
    fence_regs(dv[0]);
    fence_regs(dk[0]);
    mbar_arrive(sm.empty(st));  // Q and dO of this stage are read
  }
  if constexpr (!kDeterministic) {
    if (leader) bulk_wait<0>();
  }
  if constexpr (CAPTURE_GRADS) capture_grads.flush_warp();

  // dK (times the softmax scale) and dV through this consumer's rows of the K and V tiles, which
  // only it read: each warp stages its own 16 rows, then stores them with 16-byte stores.
  const int tile_row = cw * 64 + wwarp * 16;
  unsigned char* k_bytes = smem_raw + (sm.k - raw);
  unsigned char* v_bytes = smem_raw + (sm.v - raw);
  flexc_attn::store_fragments<KvTile, kBf16>(
      dk, [&](int, int) { return p.scale; }, k_bytes, tile_row,
      flexc_attn::head_rows(bp.dk, bp.dk_stride, b, h_kv), bp.dk_stride[2], row0, p.kv_len);
  flexc_attn::store_fragments<KvTile, kBf16>(
      dv, [](int, int) { return 1.f; }, v_bytes, tile_row,
      flexc_attn::head_rows(bp.dv, bp.dv_stride, b, h_kv), bp.dv_stride[2], row0, p.kv_len);
}

}  // namespace flexc_bwd90

extern "C" __global__ void __launch_bounds__(flexc_bwd90::kThreads, 1)
    flexc_attention_bwd_sm90(const FlexcAttentionBwdParams bp, const FlexcArgs args,
                             const FlexcBlockMask bm, const __grid_constant__ FlexcTensorMap tq,
                             const __grid_constant__ FlexcTensorMap tdo,
                             const __grid_constant__ FlexcTensorMap tk,
                             const __grid_constant__ FlexcTensorMap tv) {
  using namespace flexc_bwd90;
  const FlexcAttentionParams& p = bp.fwd;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned raw = smem_addr(smem_raw);
  Smem sm;
  sm.k = (raw + 1023) & ~1023u;
  sm.v = sm.k + KvTile::kBytes;
  sm.stages = sm.v + KvTile::kBytes;
  sm.ds = sm.stages + kStages * 2 * QTile::kBytes;
  sm.dq = sm.ds + (kDeterministic ? 0 : kDsBuffers * DsTile::kBytes);
  sm.rows = sm.dq + (kDeterministic ? 0 : 2 * kDqBytes);
  sm.bars = sm.rows + kStages * kRowsBytes;

  const int kv0 = blockIdx.x * kBlockN;
  const int h_kv = blockIdx.y, b = blockIdx.z;
  const int group = p.q_heads / p.kv_heads;
  const Steps steps(bm, b, h_kv * group, group, kv0, p.q_len);
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);

  if (threadIdx.x == 0) {
    mbar_init(sm.kv_full(), 1);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(sm.full(s), 32);    // the producer warp's lanes (lane 0 with the TMA bytes)
      mbar_init(sm.empty(s), 256);  // every consumer thread
    }
    mbar_fence_init();
  }
  __syncthreads();

  if (wg == 0) {
    regs_dec<kProducerRegs>();
    if (threadIdx.x < 32) produce(sm, bp, tq, tdo, tk, tv, args, steps, kv0, h_kv, b);
    return;
  }
  regs_inc<kConsumerRegs>();
  bool capture_grads = false;
  if constexpr (FlexcVariant::kHasCaptureGrads)
    for (int c = 0; c < FLEXC_MAX_CAPTURES; ++c) capture_grads |= args.captures[c].grad != nullptr;
  if (capture_grads)
    consume<FlexcVariant::kHasCaptureGrads>(sm, bp, args, steps, smem_raw, raw, wg, kv0, h_kv, b);
  else
    consume<false>(sm, bp, args, steps, smem_raw, raw, wg, kv0, h_kv, b);
}
