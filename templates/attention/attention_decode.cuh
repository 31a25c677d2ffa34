// Decode attention (FlashDecoding): Q_LEN query tokens per sequence (1 for plain generation, a
// few for speculative decoding) against a KV cache, contiguous or paged, of per-sequence lengths.
// Memory-bound: the kernel's job is to stream the unmasked part of K and V once at full
// bandwidth.
//
// One CTA per (kv split, block of packed query rows, kv head, batch). The query rows of one kv
// head, Q_LEN x (Hq / Hkv) of them (GQA packing), are its rows: row x is query x / G of head
// h_kv * G + x % G, so every K / V load serves all of them. The CTA walks the tiles of its split
// (every splits-th kv tile: the tiles a mask keeps spread evenly over the splits) through a ring
// of kStages cp.async stages; the four warps share each tile, a quarter of its keys each, with
// their own online softmax, and merge at the end. With one split the CTA writes out and LSE; with
// more it writes its normalised partial result and LSE, which flexc_attention_combine merges.
//
// Positions: query i of sequence b sits at position q_offsets[b] + i (default kv_lens[b] -
// Q_LEN + i), which is the q_idx the hooks see; their q_len is the position after the last query
// and their kv_len the sequence's length, so every variant means what it means in prefill. A row
// at a position outside [0, capacity) has no keys (out 0, LSE -inf).
//
// Block sparsity without a BlockMask (lengths and positions change every step): the CTA
// classifies its coming tiles 128 at a time, a lane per tile (mask_mod over the tile's keys and
// query rows), and skips empty ones before loading them, so a sliding window reads only its
// window. Full tiles skip mask_mod when computed.
//
// Bad device arguments (a length outside [0, capacity], a page index outside [0, num_pages))
// never read out of bounds: they make the CTA's output NaN.
//
// Compile-time configuration: FLEXC_HEAD_DIM, FLEXC_HEAD_DIM_V, FLEXC_BF16, FLEXC_DECODE_MT
// (16-row tiles of query rows per CTA), FLEXC_BLOCK_N (keys per tile), FLEXC_STAGES.
#include "attention_combine.cuh"
#include "attention_tile.cuh"
#include "online_softmax.cuh"
#include "tile_mma.cuh"

namespace flexc_dec {

using namespace flexc_tile;

constexpr int kD = FLEXC_HEAD_DIM;
constexpr int kDv = FLEXC_HEAD_DIM_V;
constexpr bool kBf16 = FLEXC_BF16 != 0;
constexpr int kMT = FLEXC_DECODE_MT;
constexpr int kStages = FLEXC_STAGES;
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRows = 16 * kMT;         // query rows per CTA, shared by all warps
constexpr int kBlockN = FLEXC_BLOCK_N;  // keys per tile
constexpr int kWarpN = kBlockN / kWarps;
constexpr int kNT = kWarpN / 8;
constexpr int kDT = kDv / 8;

static_assert(kD % 32 == 0 && kD <= 256 && kDv % 32 == 0 && kDv <= 256, "head dims: 32k <= 256");
static_assert(kWarpN % 16 == 0, "a warp's keys are whole k16 steps of P.V");
static_assert(kStages >= 2, "the pipeline keeps one tile in flight");

using QTile = SmemTile<kRows, kD>;
using KTile = SmemTile<kBlockN, kD>;
using VTile = SmemTile<kBlockN, kDv>;
constexpr int kStageBytes = KTile::kBytes + VTile::kBytes;
constexpr int kLoopBytes = QTile::kBytes + kStages * kStageBytes;
// The merge of the warps' results overlays the loop's tiles: per warp, a row's Dv floats (padded
// against bank conflicts), then its max and sum.
constexpr int kAccStride = kDv + 4;
constexpr int kMergeBytes = kWarps * kRows * (kAccStride + 2) * 4;
constexpr int kSmemBytes = kLoopBytes > kMergeBytes ? kLoopBytes : kMergeBytes;

using Scores = flexc_attn::ScoreTile<kMT, kNT>;

// A thread's share of a K or V tile copy: kPer rows and one 16-byte chunk column. Where the
// block's threads cover whole rows, a thread's rows are consecutive (rows kPer (t / chunks) + i):
// in a paged cache they then share one page (pages of at least kPer keys), so one page-table
// lookup serves them. (A warp still copies whole rows per instruction: the shared-memory writes
// take the same wavefronts as with rows kThreads / chunks apart.)
template <class Tile>
struct TileRows {
  static constexpr int kPer = kBlockN * Tile::kChunks / kThreads;
  static constexpr bool kConsecutive = kThreads % Tile::kChunks == 0;
  __device__ __forceinline__ static int row(int i) {
    const int t = static_cast<int>(threadIdx.x);
    return kConsecutive ? t / Tile::kChunks * kPer + i : (i * kThreads + t) / Tile::kChunks;
  }
  __device__ __forceinline__ static int chunk(int i) {
    const int t = static_cast<int>(threadIdx.x);
    return kConsecutive ? t % Tile::kChunks : (i * kThreads + t) % Tile::kChunks;
  }
};

// Where the keys of one sequence live: the element offset of a key's row of this kv head, in k
// and v.
struct Cache {
  const FlexcDecodeParams& p;
  const int* pages;  // this sequence's page table row; null: contiguous
  long long k_base, v_base;

  // Offsets of the rows of a thread's share (TileRows<Tile>) of the tile at key kv0, in k (K)
  // and v (V); keys past `last` are not read (the copy zero-fills them) and get an address inside
  // the cache. `bad` is set for a page index out of range (page 0 is read instead).
  template <class Tile, bool K, bool V, int N>
  __device__ __forceinline__ void offsets(int kv0, int last, long long (&k_off)[N],
                                          long long (&v_off)[N], bool& bad) const {
    if (pages == nullptr) {
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const long long kv = min(kv0 + TileRows<Tile>::row(i), last);
        if (K) k_off[i] = k_base + kv * p.k_stride[2];
        if (V) v_off[i] = v_base + kv * p.v_stride[2];
      }
      return;
    }
    const int mask = (1 << p.page_shift) - 1;
    auto page_at = [&](int kv) {
      const int page = pages[kv >> p.page_shift];
      const bool in = static_cast<unsigned>(page) < static_cast<unsigned>(p.num_pages);
      bad |= !in;
      return in ? page : 0;
    };
    if (TileRows<Tile>::kConsecutive && (1 << p.page_shift) >= N) {
      // One page for the thread's N consecutive keys (they start at a multiple of N).
      const int first = kv0 + TileRows<Tile>::row(0);
      const int kv = min(first, last), slot0 = first <= last ? kv & mask : 0;
      const long long page = page_at(kv);
#pragma unroll
      for (int i = 0; i < N; ++i) {
        if (K) k_off[i] = k_base + page * p.k_stride[0] + (slot0 + i) * p.k_stride[2];
        if (V) v_off[i] = v_base + page * p.v_stride[0] + (slot0 + i) * p.v_stride[2];
      }
      return;
    }
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int kv = min(kv0 + TileRows<Tile>::row(i), last);
      const long long page = page_at(kv);
      if (K) k_off[i] = k_base + page * p.k_stride[0] + (kv & mask) * p.k_stride[2];
      if (V) v_off[i] = v_base + page * p.v_stride[0] + (kv & mask) * p.v_stride[2];
    }
  }
};

// One thread's share of a K / V tile copy at the row offsets Cache::offsets gave; rows at or
// past rows_left (keys past kv_len) become zeros (0 * garbage = NaN stays out of P.V).
template <class Tile>
__device__ __forceinline__ void copy_rows(unsigned tile, const unsigned short* base,
                                          const long long (&row_off)[TileRows<Tile>::kPer],
                                          int rows_left) {
#pragma unroll
  for (int i = 0; i < TileRows<Tile>::kPer; ++i) {
    const int r = TileRows<Tile>::row(i), c = TileRows<Tile>::chunk(i);
    cp_async_16(tile + Tile::offset(r, c), base + row_off[i] + c * 8, r < rows_left);
  }
}

// The positions of this CTA's query rows and its sequence.
struct Rows {
  int group;       // query heads per kv head
  int first;       // first packed row of the CTA
  int count;       // packed rows of the kv head (Q_LEN x group)
  int q_off;       // position of query 0
  int q_len_hook;  // the hooks' q_len: the position after the last query
  int kv_len;
  int pos_end;  // rows at positions >= pos_end have no keys (the capacity)

  __device__ __forceinline__ bool row_ok(int x, int& pos, int& h, int h_kv) const {
    const int pr = first + x;
    const int qi = pr / group;
    h = h_kv * group + pr % group;
    pos = q_off + qi;
    return pr < count && pos >= 0 && pos < pos_end;
  }
};

}  // namespace flexc_dec

extern "C" __global__ void __launch_bounds__(flexc_dec::kThreads)
    flexc_attention_decode(const FlexcDecodeParams p, const FlexcArgs args) {
  using namespace flexc_dec;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int tile_ring[kWarps][kStages];  // per warp: kv0 of each stage, partial in bit 31
  const unsigned q_tile = smem_addr(smem);
  auto k_tile = [&](int stage) { return q_tile + QTile::kBytes + stage * kStageBytes; };
  auto v_tile = [&](int stage) { return k_tile(stage) + KTile::kBytes; };

  const int split = blockIdx.x, b = blockIdx.z;
  const int row_blocks = (p.q_len * (p.q_heads / p.kv_heads) + kRows - 1) / kRows;
  const int h_kv = blockIdx.y / row_blocks, row_block = blockIdx.y % row_blocks;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  Rows rows;
  rows.group = p.q_heads / p.kv_heads;
  rows.first = row_block * kRows;
  rows.count = p.q_len * rows.group;
  const int kv_len_arg = p.kv_lens[b];
  bool bad = kv_len_arg < 0 || kv_len_arg > p.capacity;
  rows.kv_len = bad ? 0 : kv_len_arg;
  rows.q_off = p.q_offsets != nullptr ? p.q_offsets[b] : rows.kv_len - p.q_len;
  rows.q_len_hook = rows.q_off + p.q_len;
  rows.pos_end = p.capacity;

  // This thread's rows (mma C fragment rows g and g + 8 of each row tile): hook positions
  // clamped into range, heads, and whether the row has keys at all.
  int q_idx[kMT][2], head[kMT][2];
  bool ok[kMT][2];
  bool any_ok = false, all_ok = true;
#pragma unroll
  for (int i = 0; i < kMT; ++i)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      int pos, h;
      ok[i][r] = rows.row_ok(i * 16 + (lane >> 2) + r * 8, pos, h, h_kv);
      q_idx[i][r] = ok[i][r] ? pos : 0;
      head[i][r] = ok[i][r] ? h : h_kv * rows.group;
      any_ok |= ok[i][r];
      all_ok &= ok[i][r];
    }
  any_ok = __syncthreads_or(any_ok);
  all_ok = __syncthreads_and(all_ok);
  // Clamp the positions of rows without keys into a valid one (their scores are discarded).
  int q_idx_valid = 0;
  if (any_ok) {
    for (int x = 0; x < kRows; ++x) {
      int pos, h;
      if (rows.row_ok(x, pos, h, h_kv)) {
        q_idx_valid = pos;
        break;
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kMT; ++i)
#pragma unroll
    for (int r = 0; r < 2; ++r)
      if (!ok[i][r]) q_idx[i][r] = q_idx_valid;

  // The split's kv tiles: every splits-th from tile `split`, so that the tiles a mask keeps (a
  // window, a document) spread evenly over the splits, whatever their place in the sequence.
  const int n_tiles = any_ok ? (rows.kv_len + kBlockN - 1) / kBlockN : 0;

  // The hooks' view of this sequence (ScoreTile reads lengths and scale from it).
  FlexcAttentionParams hp{};
  hp.q_len = rows.q_len_hook, hp.kv_len = rows.kv_len;
  hp.q_heads = p.q_heads, hp.kv_heads = p.kv_heads, hp.batch = p.batch;
  hp.scale = p.scale, hp.scale_log2 = p.scale_log2;

  // The rows a tile's verdict depends on (those with keys; without h in the mask, one head per
  // query, as the group's heads agree), listed once for every tile.
  __shared__ int test_pos[kRows], test_head[kRows], num_tests;
  if (!FlexcVariant::kMaskAlwaysTrue && threadIdx.x == 0) {
    int n = 0;
    for (int x = 0; x < kRows; ++x) {
      int pos, h;
      if (!rows.row_ok(x, pos, h, h_kv)) continue;
      if (!FlexcVariant::kMaskReadsH && x != 0 && (rows.first + x) % rows.group != 0) continue;
      test_pos[n] = pos, test_head[n] = h, ++n;
    }
    num_tests = n;
  }
  __syncthreads();

  // The split's next tile to visit, or -1 when done; `partial`: mask_mod must run on it. Without
  // a mask every tile is visited whole. Otherwise candidates are classified in rounds of
  // 4 x 32: warp w takes window w, lane l of it candidate l (all its keys against the test
  // rows), two ballots give the window's verdicts, and after a barrier every warp walks the
  // same 128 verdicts from shared memory (double-buffered by round: a warp cannot be two rounds
  // ahead of another across the barrier). All warps call this in step, so the barrier is safe.
  __shared__ unsigned verdicts[2][kWarps][2];  // [round parity][window]: kept at all, kept whole
  int round0 = split;                          // the first candidate of the next round
  int base = 0;                                // the first candidate of the round being walked
  int window = kWarps, parity = 1;
  unsigned keeps = 0, fulls = 0;  // the window being walked, walked candidates cleared
  auto next_tile = [&](bool& partial) -> int {
    if constexpr (FlexcVariant::kMaskAlwaysTrue) {
      partial = false;
      const int t = round0;
      round0 += p.splits;
      return t < n_tiles ? t : -1;
    } else {
      for (;;) {
        if (keeps != 0) {
          const int l = __ffs(keeps) - 1;
          keeps &= keeps - 1;
          partial = ((fulls >> l) & 1) == 0;
          return base + (window * 32 + l) * p.splits;
        }
        if (++window < kWarps) {
          keeps = verdicts[parity][window][0], fulls = verdicts[parity][window][1];
          continue;
        }
        if (round0 >= n_tiles) return -1;
        parity ^= 1;
        const int t = round0 + (warp * 32 + lane) * p.splits;
        bool any = false, all = t < n_tiles;
        if (t < n_tiles) {
          const int kv_end = min((t + 1) * kBlockN, rows.kv_len);
          for (int x = 0; x < num_tests && (all || !any); ++x)
            for (int kv = t * kBlockN; kv < kv_end; ++kv) {
              const bool m = FlexcVariant::mask_mod(args, b, test_head[x], test_pos[x], kv,
                                                    rows.q_len_hook, rows.kv_len);
              any |= m, all &= m;
            }
        }
        const unsigned k_bits = __ballot_sync(0xffffffffu, any);
        const unsigned f_bits = __ballot_sync(0xffffffffu, any & all);
        if (lane == 0) verdicts[parity][warp][0] = k_bits, verdicts[parity][warp][1] = f_bits;
        __syncthreads();
        base = round0;
        round0 += kWarps * 32 * p.splits;
        window = 0;
        keeps = verdicts[parity][0][0], fulls = verdicts[parity][0][1];
      }
    }
  };

  const Cache cache{p, p.page_table != nullptr ? p.page_table + b * p.page_table_stride : nullptr,
                    (p.page_table != nullptr ? 0 : b * p.k_stride[0]) + h_kv * p.k_stride[1],
                    (p.page_table != nullptr ? 0 : b * p.v_stride[0]) + h_kv * p.v_stride[1]};
  const auto* k = static_cast<const unsigned short*>(p.k);
  const auto* v = static_cast<const unsigned short*>(p.v);
  int fetched = 0;  // tiles issued
  auto load_next = [&]() {
    bool partial;
    const int t = next_tile(partial);
    if (t >= 0) {
      const int kv0 = t * kBlockN, stage = fetched % kStages;
      // (With D == Dv a thread copies the same rows of K and V: one lookup serves both.)
      long long k_off[TileRows<KTile>::kPer], v_off[TileRows<VTile>::kPer];
      if constexpr (kD == kDv) {
        cache.offsets<KTile, true, true>(kv0, rows.kv_len - 1, k_off, v_off, bad);
      } else {
        cache.offsets<KTile, true, false>(kv0, rows.kv_len - 1, k_off, k_off, bad);
        cache.offsets<VTile, false, true>(kv0, rows.kv_len - 1, v_off, v_off, bad);
      }
      copy_rows<KTile>(k_tile(stage), k, k_off, rows.kv_len - kv0);
      copy_rows<VTile>(v_tile(stage), v, v_off, rows.kv_len - kv0);
      if (lane == 0) tile_ring[warp][stage] = kv0 | (partial ? int(0x80000000u) : 0);
      ++fetched;
    }
    cp_async_commit();  // empty groups too: keeps the wait counts uniform
  };

  // Q: the CTA's packed rows (zeros past the last one).
  {
    const auto* q = static_cast<const unsigned short*>(p.q);
    for (int c = threadIdx.x; c < kRows * QTile::kChunks; c += kThreads) {
      const int x = c / QTile::kChunks, ch = c % QTile::kChunks;
      const int pr = rows.first + x;
      const bool valid = pr < rows.count;
      const int qi = valid ? pr / rows.group : 0,
                h = h_kv * rows.group + (valid ? pr % rows.group : 0);
      cp_async_16(q_tile + QTile::offset(x, ch),
                  q + b * p.q_stride[0] + h * p.q_stride[1] + qi * p.q_stride[2] + ch * 8, valid);
    }
    cp_async_commit();
  }
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) load_next();

  float acc[kMT][kDT][4];
  zero_fragments(acc);
  OnlineSoftmax<kMT, kNT> softmax;
  softmax.init();
  const auto frag_q = FragAddr<QTile>::a();
  const auto frag_k = FragAddr<KTile>::b_nk();
  const auto frag_v = FragAddr<VTile>::b_kn();
  const int key0 = warp * kWarpN;  // this warp's keys inside each tile

  for (int it = 0; it < fetched; ++it) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    load_next();
    const int stage = it % kStages;
    __syncwarp();
    const int info = tile_ring[warp][stage];
    const int kv0 = info & 0x7fffffff;
    const bool partial = info < 0;

    float s[kMT][kNT][4];
    zero_fragments(s);
    mma_a_bt<kBf16, kD>(s, frag_q, q_tile, 0, frag_k, k_tile(stage), key0);
    const Scores::Idx idx(q_idx, head, kv0 + key0, rows.kv_len);
    float no_grad[1][1][4];
    Scores::apply_mods_at(s, no_grad, hp, args, b, idx, 0, kv0 + key0, partial);
    if (!all_ok) {
#pragma unroll
      for (int i = 0; i < kMT; ++i)
#pragma unroll
        for (int j = 0; j < kNT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[i][j][e] = ok[i][e >> 1] ? s[i][j][e] : neg_inf();
    }
    float alpha[kMT][2];
    if (softmax.step(s, flexc_attn::units_log2(hp), alpha)) softmax.rescale(acc, alpha);
    mma_c_b<kBf16>(acc, s, frag_v, v_tile(stage), key0);
  }
  cp_async_wait<0>();
  bad = __syncthreads_or(bad);
  launch_dependents();  // the combine may launch: it waits for this grid's writes

  // Merge the warps: each stages its rows' max, sum and unnormalised output; then every thread
  // combines 8 columns of a row across the warps and writes them.
  float* merge = reinterpret_cast<float*>(smem);
  auto acc_at = [&](int w, int x) { return merge + (w * kRows + x) * kAccStride; };
  float* stats = merge + kWarps * kRows * kAccStride;  // [warp][row][max, sum]
  const int g = lane >> 2, t = lane & 3;
  const float to_log2 = flexc_attn::units_log2(hp);
#pragma unroll
  for (int i = 0; i < kMT; ++i)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int x = i * 16 + g + r * 8;
      float sum = softmax.sum_[i][r];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      if (t == 0) {
        stats[(warp * kRows + x) * 2] = softmax.max_[i][r];
        stats[(warp * kRows + x) * 2 + 1] = sum;
      }
#pragma unroll
      for (int j = 0; j < kDT; ++j)
        *reinterpret_cast<float2*>(acc_at(warp, x) + j * 8 + t * 2) =
            make_float2(acc[i][j][2 * r], acc[i][j][2 * r + 1]);
    }
  __syncthreads();

  const float to_ln = flexc_attn::units_ln(hp);
  const bool direct = p.splits == 1;
  constexpr int kChunks = kDv / 8;
  for (int c = threadIdx.x; c < kRows * kChunks; c += kThreads) {
    const int x = c / kChunks, col = (c % kChunks) * 8;
    int pos, h;
    const bool has_keys = rows.row_ok(x, pos, h, h_kv);
    if (rows.first + x >= rows.count) continue;  // padding rows
    // The rows' softmax over the warps: base = the largest max (rounded as OnlineSoftmax does).
    float m = neg_inf();
    for (int w = 0; w < kWarps; ++w) m = fmaxf(m, stats[(w * kRows + x) * 2]);
    const float base = m == neg_inf() ? 0.f : __fmul_rn(m, to_log2);
    float o[8] = {}, l = 0.f;
    for (int w = 0; w < kWarps; ++w) {
      const float mw = stats[(w * kRows + x) * 2];
      const float f = mw == neg_inf() ? 0.f : exp2_approx(__fmul_rn(mw, to_log2) - base);
      l += f * stats[(w * kRows + x) * 2 + 1];
      const float* src = acc_at(w, x) + col;
#pragma unroll
      for (int e = 0; e < 8; ++e) o[e] += f * src[e];
    }
    const bool empty = l == 0.f || !has_keys;
    const float inv = bad ? __int_as_float(0x7fffffff) : empty ? 0.f : 1.f / l;
    const float base_error = fmaf(m, to_log2, -base);  // exact
    const float lse = bad     ? __int_as_float(0x7fffffff)
                      : empty ? neg_inf()
                              : fmaf(m, to_ln, fmaf(-base_error, 0.69314718055994531f, logf(l)));
    const int qi = (rows.first + x) / rows.group;
    const long long row = (static_cast<long long>(b) * p.q_heads + h) * p.q_len + qi;
    if (direct) {
      auto* out = static_cast<unsigned short*>(p.o) + b * p.o_stride[0] + h * p.o_stride[1] +
                  qi * p.o_stride[2] + col;
      uint4 packed;
      packed.x = pack2<kBf16>(o[0] * inv, o[1] * inv);
      packed.y = pack2<kBf16>(o[2] * inv, o[3] * inv);
      packed.z = pack2<kBf16>(o[4] * inv, o[5] * inv);
      packed.w = pack2<kBf16>(o[6] * inv, o[7] * inv);
      *reinterpret_cast<uint4*>(out) = packed;
      if (p.lse != nullptr && col == 0) p.lse[row] = lse;
    } else {
      float* out = p.o_part + (row * p.splits + split) * kDv + col;
#pragma unroll
      for (int e = 0; e < 8; e += 4)
        *reinterpret_cast<float4*>(out + e) =
            make_float4(o[e] * inv, o[e + 1] * inv, o[e + 2] * inv, o[e + 3] * inv);
      if (col == 0) p.lse_part[row * p.splits + split] = lse;
    }
  }
}
