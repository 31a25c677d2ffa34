// Backward attention, FlashAttention-2 structure, portable to sm_80 and newer, between the
// per-row kernels of attention_bwd_rows.cuh (delta before it, dQ's conversion after it):
//
//   flexc_attention_bwd       one CTA per (kv tile, kv head, batch). K_j and V_j stay in shared
//                             memory, dK_j and dV_j in registers (each warp 16 kv rows), while the
//                             CTA walks, for every query head of the kv head's group, the q tiles
//                             that the BlockMask's column lists name (partial, then full):
//                               S^T = K Q^T  (rows: keys; hooks on logical q_idx / kv_idx)
//                               P^T = exp(S^T - LSE)                  from the forward's LSE
//                               dV += P^T dO,  dP^T = V dO^T
//                               dS^T = P^T (dP^T - delta) d score_mod / d score
//                               dK += dS^T Q,  dQ += dS K             (dQ: float32 atomics)
//                             Capture gradients: dS before the score_mod factor, through the
//                             variant's accumulate_capture_grads into a FlexcGradSink (float32
//                             atomics when an element changes; a warp's equal ones combined).
//
// dK and dV are summed over the group's query heads inside the CTA (no atomics: deterministic);
// dQ and capture gradients use float32 atomics. With FLEXC_DETERMINISTIC the main kernel leaves
// dQ out, and flexc_attention_bwd_dq_rows computes it instead: one CTA per q tile walks the
// forward's row schedule and recomputes S, P, dP and dS (a second pass over K and V), so dq has
// the same bits every run. Elements past either length, masked ones and rows whose LSE is -inf
// (no unmasked element) contribute exactly 0.
//
// Compile-time configuration (KernelSpec defines): FLEXC_HEAD_DIM, FLEXC_BF16, FLEXC_BLOCK_M (q
// rows per step), FLEXC_BLOCK_N (kv rows per CTA), FLEXC_WARPS, FLEXC_DETERMINISTIC.
#define FLEXC_ROWS_APART 1  // score_mod's row terms come off the LSE (attention_tile.cuh)
#include "attention_tile.cuh"
#include "tile_mma.cuh"

namespace flexc_bwd {

using namespace flexc_tile;
using flexc_attn::at;

constexpr int kD = FLEXC_HEAD_DIM;
constexpr bool kBf16 = FLEXC_BF16 != 0;
constexpr int kBlockM = FLEXC_BLOCK_M;
constexpr int kBlockN = FLEXC_BLOCK_N;
constexpr int kWarps = FLEXC_WARPS;
constexpr bool kDeterministic = FLEXC_DETERMINISTIC != 0;
constexpr int kThreads = kWarps * 32;
constexpr int kNT = kBlockM / 8;          // n8 column tiles (queries) of a warp's S^T
constexpr int kDT = kD / 8;               // n8 column tiles of dK, dV, dQ
constexpr int kQRows = kBlockM / kWarps;  // dQ rows per warp
constexpr int kMQ = kQRows / 16;

static_assert(kBlockN == 16 * kWarps, "each warp owns 16 kv rows");
static_assert(kQRows % 16 == 0, "each warp owns a multiple of 16 dQ rows");
static_assert(!kDeterministic || kBlockM == 16 * kWarps, "dq_rows: 16 q rows per warp");
static_assert(kD % 32 == 0 && kD <= 128, "head dim: a multiple of 32, at most 128");

using KvTile = SmemTile<kBlockN, kD>;
using QTile = SmemTile<kBlockM, kD>;
using DsTile = SmemTile<kBlockN, kBlockM>;  // dS^T: rows keys, columns queries
// Shared memory: K, V, then two stages of (Q, dO), dS^T, and two stages of per-row LSE * log2(e)
// and delta. The host computes the same size for the launch.
constexpr int kStageBytes = 2 * QTile::kBytes;
constexpr int kRowBytes = 2 * kBlockM * 4;
constexpr int kSmemBytes = 2 * KvTile::kBytes + 2 * kStageBytes + DsTile::kBytes + 2 * kRowBytes;

using Scores = flexc_attn::ScoreTile<1, kNT, flexc_attn::Rows::Kv>;
using Steps = flexc_attn::ColumnSteps<kBlockM>;
constexpr bool kGrad = !FlexcVariant::kScoreGradIsOne;

}  // namespace flexc_bwd

extern "C" __global__ void __launch_bounds__(flexc_bwd::kThreads)
    flexc_attention_bwd(const FlexcAttentionBwdParams bp, const FlexcArgs args,
                        const FlexcBlockMask bm) {
  using namespace flexc_bwd;
  const FlexcAttentionParams& p = bp.fwd;
  extern __shared__ __align__(128) unsigned char smem[];
  const unsigned k_tile = smem_addr(smem);
  const unsigned v_tile = k_tile + KvTile::kBytes;
  auto q_tile = [&](int stage) { return v_tile + KvTile::kBytes + stage * kStageBytes; };
  auto do_tile = [&](int stage) { return q_tile(stage) + QTile::kBytes; };
  unsigned char* ds_bytes = smem + 2 * KvTile::kBytes + 2 * kStageBytes;
  const unsigned ds_tile = smem_addr(ds_bytes);
  float* rows = reinterpret_cast<float*>(ds_bytes + DsTile::kBytes);
  auto lse2_of = [&](int stage) { return rows + stage * 2 * kBlockM; };
  auto delta_of = [&](int stage) { return rows + stage * 2 * kBlockM + kBlockM; };

  const int kv0 = blockIdx.x * kBlockN;
  const int h_kv = blockIdx.y, b = blockIdx.z;
  const int group = p.q_heads / p.kv_heads;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row0 = kv0 + warp * 16;  // this warp's first kv row

  const TileCopy<KvTile, kThreads> copy_kv;
  copy_kv(k_tile, at<unsigned short>(p.k, p.k_stride, b, h_kv), p.k_stride[2], kv0, p.kv_len);
  copy_kv(v_tile, at<unsigned short>(p.v, p.v_stride, b, h_kv), p.v_stride[2], kv0, p.kv_len);
  cp_async_commit();

  // The (query head, q tile) steps: every head of the group, each with its column's schedule;
  // one walker prefetches, one computes.
  const Steps steps(bm, b, h_kv * group, group, kv0, p.q_len);
  Steps fetch_steps = steps, walk = steps;
  const TileCopy<QTile, kThreads> copy_q;
  // Issues the copies of the next step's Q and dO tiles into `stage`, and its rows' LSE and delta
  // (plain stores: visible after the next __syncthreads). Returns false when no step is left.
  auto load_step = [&](int stage) {
    int fetch_h, q0;
    bool unused;
    if (!fetch_steps.next(fetch_h, q0, unused)) return false;
    copy_q(q_tile(stage), at<unsigned short>(p.q, p.q_stride, b, fetch_h), p.q_stride[2], q0,
           p.q_len);
    copy_q(do_tile(stage), at<unsigned short>(bp.dout, bp.do_stride, b, fetch_h), bp.do_stride[2],
           q0, p.q_len);
    const long long base = (static_cast<long long>(b) * p.q_heads + fetch_h) * p.q_len;
    for (int r = threadIdx.x; r < kBlockM; r += kThreads) {
      const int q = q0 + r;
      lse2_of(stage)[r] = flexc_attn::row_lse_log2(p, args, b, fetch_h, q);
      delta_of(stage)[r] = q < p.q_len ? bp.delta[base + q] : 0.f;
    }
    return true;
  };

  float dk[1][kDT][4], dv[1][kDT][4];
  FlexcGradSink<FlexcVariant::kCaptureGradLoads> capture_grads;
  // Whether the caller asked for any capture gradient: if not, the hook is never called (its
  // derivatives and the sink's bookkeeping cost registers and time for nothing).
  bool want_capture_grads = false;
  if constexpr (FlexcVariant::kHasCaptureGrads)
    for (int c = 0; c < FLEXC_MAX_CAPTURES; ++c)
      want_capture_grads |= args.captures[c].grad != nullptr;
  zero_fragments(dk);
  zero_fragments(dv);
  const auto frag_a_kv = FragAddr<KvTile>::a();
  const auto frag_b_kv = FragAddr<KvTile>::b_kn();
  const auto frag_b_q = FragAddr<QTile>::b_nk();
  const auto frag_bt_q = FragAddr<QTile>::b_kn();
  const auto frag_a_ds = FragAddr<DsTile>::b_nk();  // A of dS from dS^T, with ldmatrix .trans
  const float to_log2 = flexc_attn::units_log2(p);

  bool more = load_step(0);
  cp_async_commit();
  for (int it = 0; more; ++it) {
    cp_async_wait<0>();
    // This step's tiles are visible, and every warp is done with the stage refilled next and
    // with the dS^T tile of the last step.
    __syncthreads();
    const int stage = it & 1;
    more = load_step(stage ^ 1);
    cp_async_commit();
    int hq, q0;
    bool partial;
    walk.next(hq, q0, partial);  // the step load_step fetched

    // S^T = K Q^T for this warp's 16 kv rows.
    float s[1][kNT][4];
    zero_fragments(s);
    mma_a_bt<kBf16, kD>(s, frag_a_kv, k_tile, warp * 16, frag_b_q, q_tile(stage), 0);
    float x[flexc_attn::kKeepPreMod ? kNT : 1][4];
    flexc_attn::keep_pre_mod(s[0], p.scale, x);
    float grad[1][kGrad ? kNT : 1][4];
    Scores::apply_mods<kGrad>(s, grad, p, args, b, hq, row0, q0, partial);

    // P^T from the forward's LSE, in place.
    const float* lse2 = lse2_of(stage);
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        s[0][j][e] = p_from_lse(s[0][j][e], to_log2, lse2[j * 8 + (lane & 3) * 2 + (e & 1)]);

    // dV += P^T dO
    mma_c_b<kBf16>(dv, s, frag_bt_q, do_tile(stage), 0);
    // dP^T = V dO^T
    float dp[1][kNT][4];
    zero_fragments(dp);
    mma_a_bt<kBf16, kD>(dp, frag_a_kv, v_tile, warp * 16, frag_b_q, do_tile(stage), 0);
    // dS^T = P^T (dP^T - delta) d score_mod / d score; where P is 0 (masked, past a length, a
    // score_mod of -inf) dS is exactly 0 whatever the derivative there.
    const float* delta = delta_of(stage);
    const Scores::Idx idx = Scores::index(hq, row0, q0, p);
    Scores::for_each(idx, [&](int, int j, int e, int, int q_idx, int kv_idx, bool) {
      const float pv = s[0][j][e];
      if constexpr (FlexcVariant::kHasCaptureGrads)
        if (want_capture_grads)
          flexc_attn::add_capture_grads(capture_grads, args, p, pv, dp[0][j][e],
                                        delta[j * 8 + (lane & 3) * 2 + (e & 1)], x, j, e, b, hq,
                                        q_idx, kv_idx);
      dp[0][j][e] = dscore<kGrad>(pv, dp[0][j][e], delta[j * 8 + (lane & 3) * 2 + (e & 1)],
                                  grad[0][kGrad ? j : 0][e]);
    });

    // dK += dS^T Q
    mma_c_b<kBf16>(dk, dp, frag_bt_q, q_tile(stage), 0);
    if constexpr (!kDeterministic) {
      // dS^T to shared memory, then each warp takes kQRows query rows of dQ += dS K.
#pragma unroll
      for (int j = 0; j < kNT; ++j)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = warp * 16 + (lane >> 2) + r * 8, col = j * 8 + (lane & 3) * 2;
          *reinterpret_cast<unsigned*>(ds_bytes + DsTile::offset(row, col >> 3) + (col & 7) * 2) =
              pack2<kBf16>(dp[0][j][2 * r], dp[0][j][2 * r + 1]);
        }
      __syncthreads();
      float dq[kMQ][kDT][4];
      zero_fragments(dq);
#pragma unroll
      for (int kk = 0; kk < kBlockN; kk += 16) {
        unsigned a[kMQ][4];
#pragma unroll
        for (int i = 0; i < kMQ; ++i)
          ldmatrix_x4_trans(a[i], frag_a_ds(ds_tile, kk, (warp * kQRows + i * 16) / 8));
        mma_rows<kBf16>(dq, a, [&](unsigned(&bf)[4], int n) {
          ldmatrix_x4_trans(bf, frag_b_kv(k_tile, kk, n / 8));
        });
      }
#pragma unroll
      for (int i = 0; i < kMQ; ++i)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int q = q0 + warp * kQRows + i * 16 + (lane >> 2) + r * 8;
          if (q < p.q_len) {
            float* acc = bp.dq_accum + flexc_attn::DqAccum<kD>::block(p, b, hq, q);
#pragma unroll
            for (int j = 0; j < kDT; ++j) {
              const int c = j * 8 + (lane & 3) * 2;
              atomicAdd(acc + flexc_attn::DqAccum<kD>::offset(q % 64, c), dq[i][j][2 * r]);
              atomicAdd(acc + flexc_attn::DqAccum<kD>::offset(q % 64, c + 1), dq[i][j][2 * r + 1]);
            }
          }
        }
    }
  }
  cp_async_wait<0>();
  capture_grads.flush_warp();
  __syncthreads();

  // dK (times the softmax scale) and dV through the K and V tiles, which no warp reads any more:
  // each warp stages its own 16 rows, then stores them with 16-byte stores.
  flexc_attn::store_fragments<KvTile, kBf16>(
      dk, [&](int, int) { return p.scale; }, smem, warp * 16,
      flexc_attn::head_rows(bp.dk, bp.dk_stride, b, h_kv), bp.dk_stride[2], row0, p.kv_len);
  flexc_attn::store_fragments<KvTile, kBf16>(
      dv, [](int, int) { return 1.f; }, smem + KvTile::kBytes, warp * 16,
      flexc_attn::head_rows(bp.dv, bp.dv_stride, b, h_kv), bp.dv_stride[2], row0, p.kv_len);
}

#if FLEXC_DETERMINISTIC
// Deterministic dQ: one CTA per (q tile, query head, batch) walks the kv tiles of its BlockMask
// row (the forward's schedule), recomputes S, P, dP and dS, and accumulates dQ = scale dS K in
// registers; no atomics, so dq has the same bits every run.
extern "C" __global__ void __launch_bounds__(flexc_bwd::kThreads)
    flexc_attention_bwd_dq_rows(const FlexcAttentionBwdParams bp, const FlexcArgs args,
                                const FlexcBlockMask bm) {
  using namespace flexc_bwd;
  using RowScores = flexc_attn::ScoreTile<1, kBlockN / 8>;
  using KvSchedule = flexc_attn::KvSchedule<kBlockN>;
  const FlexcAttentionParams& p = bp.fwd;
  extern __shared__ __align__(128) unsigned char smem[];
  // Q and dO, then two stages of K and V.
  const unsigned q_tile = smem_addr(smem), do_tile = q_tile + QTile::kBytes;
  auto k_tile = [&](int stage) { return do_tile + QTile::kBytes + stage * 2 * KvTile::kBytes; };
  auto v_tile = [&](int stage) { return k_tile(stage) + KvTile::kBytes; };

  const int m_block = gridDim.x - 1 - blockIdx.x;  // heaviest q tiles first, as the forward
  const int h = blockIdx.y, b = blockIdx.z;
  const int h_kv = h / (p.q_heads / p.kv_heads);
  const int q0 = m_block * kBlockM;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row0 = q0 + warp * 16;

  const auto* k = at<unsigned short>(p.k, p.k_stride, b, h_kv);
  const auto* v = at<unsigned short>(p.v, p.v_stride, b, h_kv);
  const KvSchedule sched(bm, b, h, q0, p.kv_len);
  KvSchedule::Cursor fetch, cur;
  const TileCopy<KvTile, kThreads> copy_kv;
  auto load_kv = [&](int i) {
    if (i < sched.count) {
      const int kv0 = sched.start(fetch);
      copy_kv(k_tile(i & 1), k, p.k_stride[2], kv0, p.kv_len);
      copy_kv(v_tile(i & 1), v, p.v_stride[2], kv0, p.kv_len);
      sched.advance(fetch);
    }
    cp_async_commit();
  };
  const TileCopy<QTile, kThreads> copy_q;
  copy_q(q_tile, at<unsigned short>(p.q, p.q_stride, b, h), p.q_stride[2], q0, p.q_len);
  copy_q(do_tile, at<unsigned short>(bp.dout, bp.do_stride, b, h), bp.do_stride[2], q0, p.q_len);
  cp_async_commit();
  load_kv(0);

  // This thread's two rows per row tile: LSE * log2(e) (+inf for rows with P = 0) and delta.
  float lse2[2], delta[2];
  const long long base = (static_cast<long long>(b) * p.q_heads + h) * p.q_len;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int q = row0 + (lane >> 2) + r * 8;
    lse2[r] = flexc_attn::row_lse_log2(p, args, b, h, q);
    delta[r] = q < p.q_len ? bp.delta[base + q] : 0.f;
  }
  const auto frag_a_q = FragAddr<QTile>::a();
  const auto frag_b_kv = FragAddr<KvTile>::b_nk();
  const auto frag_bt_kv = FragAddr<KvTile>::b_kn();
  const float to_log2 = flexc_attn::units_log2(p);
  float dq[1][kDT][4];
  zero_fragments(dq);

  for (int it = 0; it < sched.count; ++it) {
    cp_async_wait<0>();
    __syncthreads();  // tile `it` visible; every warp done with the stage refilled next
    load_kv(it + 1);
    const int stage = it & 1;
    const int kv0 = sched.start(cur);
    const bool partial = sched.is_partial(cur);
    sched.advance(cur);

    float s[1][kBlockN / 8][4], dp[1][kBlockN / 8][4];
    zero_fragments(s);
    zero_fragments(dp);
#pragma unroll
    for (int kk = 0; kk < kD; kk += 16) {
      unsigned a[1][4], a_do[1][4];
      ldmatrix_x4(a[0], frag_a_q(q_tile, warp * 16, kk / 8));
      ldmatrix_x4(a_do[0], frag_a_q(do_tile, warp * 16, kk / 8));
      mma_rows<kBf16>(s, a, [&](unsigned(&bf)[4], int n) {
        ldmatrix_x4(bf, frag_b_kv(k_tile(stage), n, kk / 8));
      });
      mma_rows<kBf16>(dp, a_do, [&](unsigned(&bf)[4], int n) {
        ldmatrix_x4(bf, frag_b_kv(v_tile(stage), n, kk / 8));
      });
    }
    float grad[1][kGrad ? kBlockN / 8 : 1][4];
    RowScores::apply_mods<kGrad>(s, grad, p, args, b, h, row0, kv0, partial);
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float pv = p_from_lse(s[0][j][e], to_log2, lse2[e >> 1]);
        dp[0][j][e] = dscore<kGrad>(pv, dp[0][j][e], delta[e >> 1], grad[0][kGrad ? j : 0][e]);
      }
    // dQ += dS K
    mma_c_b<kBf16>(dq, dp, frag_bt_kv, k_tile(stage), 0);
  }
  cp_async_wait<0>();
  __syncthreads();
  // Each warp stages its 16 rows in the Q tile (read by no one any more), then stores them.
  flexc_attn::store_fragments<QTile, kBf16>(
      dq, [&](int, int) { return p.scale; }, smem, warp * 16,
      flexc_attn::head_rows(bp.dq, bp.dq_stride, b, h), bp.dq_stride[2], row0, p.q_len);
}
#endif  // FLEXC_DETERMINISTIC
