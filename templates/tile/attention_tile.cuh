// What every forward kernel does around its matrix products, whatever instructions compute them:
// the kv tiles a CTA visits (from the BlockMask), the variant's hooks on a tile of scores, and the
// epilogue that normalises and stores O and LSE. Both kernels (attention_fwd.cuh on mma.sync,
// attention_fwd_sm90.cuh on wgmma) hold scores in the same register layout, the mma.sync C
// fragment (tile_mma.cuh), so these helpers serve both.
//
// A warp holds MT row tiles of 16 rows and NT n8 column tiles: s[i][j][e] is row
// 16 i + g + 8 (e >> 1), column 8 j + 2 t + (e & 1) of the warp's part of the tile
// (g = lane / 4, t = lane % 4).
#pragma once

#include "attention_layout.cuh"
#include "flexc_hooks.cuh"
#include "flexc_variant.cuh"
#include "online_softmax.cuh"

namespace flexc_attn {

using flexc_tile::neg_inf;

// Positions (FlexcAttentionParams::q_pos0 and the rest). A kernel built with FLEXC_POSITIONS (a
// block of a longer sequence: ring attention's steps) reads them all. The others see keys from
// 0 and the tensors' lengths, queries from q_pos0 in the forward kernels (chunked prefill) and
// from 0 in the backward ones: any more runtime positions perturb ptxas's register allocation
// (the Hopper backward's spills moved by -120..+80 bytes across the catalogue), so the host
// builds the positions kernel only for calls that need it (src/attention/attention.cpp).
#ifndef FLEXC_POSITIONS
#define FLEXC_POSITIONS 0
#endif
constexpr bool kPositions = FLEXC_POSITIONS != 0;
// Packed sequences (the forward kernels built with FLEXC_VARLEN): the grid's batch index is the
// sequence, and a CTA computes on its sequence's view of the params (sequence_params).
#ifndef FLEXC_VARLEN
#define FLEXC_VARLEN 0
#endif
constexpr bool kVarlen = FLEXC_VARLEN != 0;
// Sequence b's view of packed params: its lengths, its first rows, and q, k, v from them (o and
// lse at out_rows / lse_rows: a register less held to the epilogue). Offsets that do not describe
// rows of the tensors never read or write past them: a sequence whose queries fall outside q's
// rows (or exceed q_len, the longest) gets none (its output is not written); one whose keys do
// gets none and stores NaN rows (nan_if_bad_keys). Host checks:
// PackedSequences::check_device_args.
__device__ __forceinline__ bool keys_valid(const FlexcAttentionParams& p, int b) {
  const int k0 = p.cu_seqlens_kv[b], k1 = p.cu_seqlens_kv[b + 1];
  return 0 <= k0 && k0 <= k1 && k1 <= p.total_kv && k1 - k0 <= p.kv_len;
}
__device__ __forceinline__ FlexcAttentionParams sequence_params(const FlexcAttentionParams& p,
                                                                int b) {
  FlexcAttentionParams s = p;
  const int q0 = p.cu_seqlens_q[b], q1 = p.cu_seqlens_q[b + 1];
  const bool q_ok = 0 <= q0 && q0 <= q1 && q1 <= p.total_q && q1 - q0 <= p.q_len;
  const bool kv_ok = keys_valid(p, b);
  s.q_start = q_ok ? q0 : 0;
  s.q_len = q_ok ? q1 - q0 : 0;
  s.kv_start = kv_ok ? p.cu_seqlens_kv[b] : 0;
  s.kv_len = kv_ok ? p.cu_seqlens_kv[b + 1] - s.kv_start : 0;
  s.q = static_cast<const unsigned short*>(p.q) + s.q_start * p.q_stride[2];
  s.k = static_cast<const unsigned short*>(p.k) + s.kv_start * p.k_stride[2];
  s.v = static_cast<const unsigned short*>(p.v) + s.kv_start * p.v_stride[2];
  return s;
}
// The params a work item of sequence b computes on: its view under kVarlen, the params
// themselves (a reference) otherwise.
__device__ __forceinline__ decltype(auto) item_params(const FlexcAttentionParams& p, int b) {
  if constexpr (kVarlen) {
    return sequence_params(p, b);
  } else {
    return (p);
  }
}
// A packed sequence whose key offsets are bad stores its rows as NaN (its view has no keys):
// read from `params` (the kernel's) again at the epilogue rather than held through the loop.
template <int MT>
__device__ __forceinline__ void nan_if_bad_keys(const FlexcAttentionParams& params, int b,
                                                float (&inv_sum)[MT][2], float (&lse)[MT][2]) {
  if constexpr (kVarlen) {
    if (keys_valid(params, b)) return;
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int r = 0; r < 2; ++r) inv_sum[i][r] = lse[i][r] = __int_as_float(0x7fffffff);
  }
}
// Row 0 of head (b, h)'s LSEs: [B, q_heads, q_len], or packed [q_heads, total_q] from the
// sequence's first row (sequence_params).
__device__ __forceinline__ float* lse_rows(const FlexcAttentionParams& p, int b, int h) {
  if constexpr (kVarlen) return p.lse + static_cast<long long>(h) * p.total_q + p.q_start;
  return p.lse + (static_cast<long long>(b) * p.q_heads + h) * p.q_len;
}
// Row 0 of head (b, h) of the output (16-bit, or float32 in a FLEXC_F32_OUT build): packed, from
// the sequence's first row.
__device__ __forceinline__ void* out_rows(const FlexcAttentionParams& p, int b, int h) {
  char* o = static_cast<char*>(head_rows(p.o, p.o_stride, b, h));
  if constexpr (kVarlen) o += p.q_start * p.o_stride[2] * (kF32Out ? 4 : 2);
  return o;
}

// A kernel built with FLEXC_ROWS_APART computes the rowless score (FlexcVariant::kRowless):
// score_mod without its row terms, in units of kRowlessUnits. A value added to a row's every
// score changes only its LSE: the forward kernels add the row terms to each row's LSE in their
// epilogue (add_row_terms), the backward ones take them off the LSE they read (row_lse_log2).
// With FLEXC_ROWS_APART 2 (the forward kernels) the units scale the exponent; with 1 (the
// backward ones) only a variant with row terms computes the rowless score, each multiplied by
// the units: units in the exponent cost the backward 2-5% (docs/perf.md).
#ifndef FLEXC_ROWS_APART
#define FLEXC_ROWS_APART 0
#endif
constexpr bool kRowsApart = FLEXC_ROWS_APART == 2
                                ? FlexcVariant::kRowless
                                : FLEXC_ROWS_APART == 1 && FlexcVariant::kRowTerms;
constexpr bool kUnitsInExponent = kRowsApart && FLEXC_ROWS_APART == 2;
constexpr float kUnits = kUnitsInExponent ? FlexcVariant::kRowlessUnits : 1.f;
// What multiplies each rowless score (1: none).
constexpr float kScoreUnits = kRowsApart && !kUnitsInExponent ? FlexcVariant::kRowlessUnits : 1.f;
// score_mod as this kernel computes it is the identity.
constexpr bool kIdentityScore = kRowsApart ? FlexcVariant::kRowlessIdentity && kScoreUnits == 1.f
                                           : FlexcVariant::kIdentityScore;
__device__ __forceinline__ int kv_pos0(const FlexcAttentionParams& p) {
  return kPositions ? p.kv_pos0 : 0;
}
// The lengths the hooks see; Q_POS: the kernel's queries start at q_pos0 (the forward kernels).
template <bool Q_POS>
__device__ __forceinline__ int hook_q_len(const FlexcAttentionParams& p) {
  if constexpr (kPositions) return p.hook_q_len;
  return Q_POS ? p.q_pos0 + p.q_len : p.q_len;
}
__device__ __forceinline__ int hook_kv_len(const FlexcAttentionParams& p) {
  return kPositions ? p.hook_kv_len : p.kv_len;
}

// Which way a kernel walks the score matrix from its fixed tile: along a q tile's row, visiting kv
// tiles (the forward kernels), or along a kv tile's column, visiting q tiles (the backward kernel).
enum class Along { Kv, Q };

// The tiles of one row (Along::Kv) or column (Along::Q) that a CTA visits, in order: partial ones
// first, then full ones, from the BlockMask's lists (the transposed lists for a column). A
// BlockMask tile covers BlockMask tile size / BLOCK kernel tiles. Tiles are walked in order with
// cursors (one for the prefetch, one for the compute), so no division happens in the loop.
template <int BLOCK, Along A = Along::Kv>
struct TileSchedule {
  struct Cursor {
    int blk = 0, sub = 0;  // BlockMask list position, kernel tile inside that BlockMask tile
  };
  const int* partial = nullptr;  // null: every tile, in order
  const int* full = nullptr;
  int num_partial = 0;
  int per_block = 1;
  int count = 0;  // kernel tiles to visit
  bool dense_partial = false;

  // For the tile whose first fixed-axis index is `fixed0`, walking an axis of length `len`.
  __device__ TileSchedule(const FlexcBlockMask& bm, int b, int h, int fixed0, int len) {
    if (kVarlen && len <= 0) return;  // a packed sequence without keys visits none
    if (bm.kv_num == nullptr) {
      count = (len + BLOCK - 1) / BLOCK;
      dense_partial = !FlexcVariant::kMaskAlwaysTrue;
      return;
    }
    const int group = (bm.nb == 1 ? 0 : b) * bm.nh + (bm.nh == 1 ? 0 : h);
    int num_full;
    if constexpr (A == Along::Kv) {
      const int row = group * bm.num_q_tiles + fixed0 / bm.q_tile;
      num_partial = bm.kv_num[row];
      num_full = bm.full_kv_num[row];
      partial = bm.kv_idx + static_cast<long long>(row) * bm.num_kv_tiles;
      full = bm.full_kv_idx + static_cast<long long>(row) * bm.num_kv_tiles;
      per_block = bm.kv_tile / BLOCK;
    } else {
      const int col = group * bm.num_kv_tiles + fixed0 / bm.kv_tile;
      num_partial = bm.q_num[col];
      num_full = bm.full_q_num[col];
      partial = bm.q_idx + static_cast<long long>(col) * bm.num_q_tiles;
      full = bm.full_q_idx + static_cast<long long>(col) * bm.num_q_tiles;
      per_block = bm.q_tile / BLOCK;
    }
    count = (num_partial + num_full) * per_block;
  }
  // First index of the cursor's tile.
  __device__ __forceinline__ int start(const Cursor& c) const {
    if (partial == nullptr) return c.blk * BLOCK;
    const int tile = c.blk < num_partial ? partial[c.blk] : full[c.blk - num_partial];
    return (tile * per_block + c.sub) * BLOCK;
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

template <int BLOCK_N>
using KvSchedule = TileSchedule<BLOCK_N, Along::Kv>;
template <int BLOCK_M>
using QSchedule = TileSchedule<BLOCK_M, Along::Q>;

// The steps of a backward CTA, which owns one kv tile of kv head h_kv: for each query head of
// the group [h_first, h_first + heads), the q tiles of that head's column, in order. Each walker
// (a prefetching producer, a computing consumer) keeps its own copy.
template <int BLOCK_M>
struct ColumnSteps {
  QSchedule<BLOCK_M> sched;
  typename QSchedule<BLOCK_M>::Cursor cur;
  const FlexcBlockMask* bm;
  int b, h, h_end, kv0, q_len, left;

  __device__ ColumnSteps(const FlexcBlockMask& m, int b_, int h_first, int heads, int kv0_,
                         int q_len_)
      : sched(m, b_, h_first, kv0_, q_len_),
        bm(&m),
        b(b_),
        h(h_first),
        h_end(h_first + heads),
        kv0(kv0_),
        q_len(q_len_),
        left(sched.count) {}
  // The next step's query head, first q row and whether mask_mod must run; false when done.
  // Kernel tiles of a BlockMask tile that start past q_len are skipped.
  __device__ __forceinline__ bool next(int& head, int& q0, bool& partial) {
    for (;;) {
      while (left == 0) {
        if (h + 1 >= h_end) return false;
        sched = QSchedule<BLOCK_M>(*bm, b, ++h, kv0, q_len);
        cur = {};
        left = sched.count;
      }
      head = h;
      q0 = sched.start(cur);
      partial = sched.is_partial(cur);
      sched.advance(cur);
      --left;
      if (q0 < q_len) return true;
    }
  }
};

// Whether mask_mod must run on a tile, per q-row group: the kinds a KvUnion reports. kTileDone:
// empty, and so is every later tile of the union for that group (its BlockMask row's lists are
// taken), which a consumer then skips whole.
enum TileKind : unsigned { kTileEmpty = 0, kTilePartial = 1, kTileFull = 2, kTileDone = 3 };

// The kv tiles of a CTA whose q rows span one or two BlockMask rows (the Hopper forward kernel's
// 192-row tiles over 128-row BlockMask tiles), in ascending kv order: the union of the rows'
// tiles, each with its kind in each row (a tile of one row only is empty in the other). Kernel
// tiles of a BlockMask tile that start past kv_len are skipped. One thread walks it (a producer
// with few registers: the lists' pointers are read from the kernel parameter `bm` on each step).
template <int BLOCK_N>
struct KvUnion {
  // One BlockMask row: its partial and full lists (each ascending, no tile in both), merged.
  // Without a BlockMask, row 0's "full list" is every kernel tile.
  struct Row {
    long long off = 0;  // of the row in the lists
    int at_partial = 0, num_partial = 0, at_full = 0, num_full = 0;
  };
  static constexpr int kNone = 0x7fffffff;
  static constexpr unsigned kDenseKind = FlexcVariant::kMaskAlwaysTrue ? kTileFull : kTilePartial;
  Row row[2];
  int per_block = 1, tile = 0, sub = 1;  // the BlockMask tile being split, the next kernel tile
  bool dense;

  // For the BlockMask rows holding q rows `q_a` and `q_b` (the same row: one row).
  __device__ KvUnion(const FlexcBlockMask& bm, int b, int h, int q_a, int q_b, int kv_len) {
    dense = bm.kv_num == nullptr;
    if (dense) {
      row[0].num_full = (kv_len + BLOCK_N - 1) / BLOCK_N;
      return;
    }
    const int group = (bm.nb == 1 ? 0 : b) * bm.nh + (bm.nh == 1 ? 0 : h);
    per_block = sub = bm.kv_tile / BLOCK_N;
    const int rows[2] = {q_a / bm.q_tile, q_b / bm.q_tile};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (r == 1 && rows[1] == rows[0]) continue;
      const int at = group * bm.num_q_tiles + rows[r];
      row[r].off = static_cast<long long>(at) * bm.num_kv_tiles;
      row[r].num_partial = bm.kv_num[at];
      row[r].num_full = bm.full_kv_num[at];
    }
  }
  __device__ __forceinline__ int partial_at(const FlexcBlockMask& bm, const Row& r) const {
    return r.at_partial < r.num_partial ? bm.kv_idx[r.off + r.at_partial] : kNone;
  }
  __device__ __forceinline__ int full_at(const FlexcBlockMask& bm, const Row& r) const {
    if (r.at_full >= r.num_full) return kNone;
    return dense ? r.at_full : bm.full_kv_idx[r.off + r.at_full];
  }
  // Takes `t` if it is the row's next tile; its kind there (full where mask_mod is always true:
  // nothing to evaluate; done where the row has no tile left).
  __device__ __forceinline__ unsigned take(const FlexcBlockMask& bm, Row& r, int t) const {
    if (partial_at(bm, r) == t)
      return ++r.at_partial, FlexcVariant::kMaskAlwaysTrue ? kTileFull : kTilePartial;
    if (full_at(bm, r) == t) return ++r.at_full, dense ? kDenseKind : kTileFull;
    return r.at_partial < r.num_partial || r.at_full < r.num_full ? kTileEmpty : kTileDone;
  }
  // The union's next BlockMask tile (without a BlockMask: kernel tile), kNone when done; its
  // kinds as next's.
  __device__ __forceinline__ int next_block(const FlexcBlockMask& bm, unsigned& kinds) {
    const int t = min(min(partial_at(bm, row[0]), full_at(bm, row[0])),
                      min(partial_at(bm, row[1]), full_at(bm, row[1])));
    if (t != kNone) kinds = take(bm, row[0], t) | take(bm, row[1], t) << 2;
    return t;
  }
  // The next kernel tile's first kv index, with its kind in row 0 in bits 0-1 of `kinds` and in
  // row 1 in bits 2-3 (row 1's are meaningless with one row); -1 when done.
  __device__ __forceinline__ int next(const FlexcBlockMask& bm, int kv_len, unsigned& kinds) {
    for (;;) {
      if (sub < per_block) {
        const int kv0 = (tile * per_block + sub++) * BLOCK_N;
        if (kv0 < kv_len) return kv0;
        sub = per_block;  // the rest of this BlockMask tile lies past kv_len too
      }
      tile = next_block(bm, kinds);
      if (tile == kNone) return -1;
      sub = 0;
    }
  }
};

// Kernel tiles of W keys over one BlockMask row whose kv tiles (T > W keys) they do not divide
// (the Hopper forward kernel's wide tiles): every kernel tile that overlaps a listed BlockMask
// tile, ascending, with the kinds of the BlockMask tiles its first and its last key lie in
// (bits 0-1 and 2-3; empty where that tile is not listed), which differ where it straddles two.
// Without a BlockMask every kernel tile, both kinds the dense one.
template <int W>
struct KvStraddle {
  KvUnion<W> blocks;  // the row's listed tiles one by one
  int tile_len;       // T (W without a BlockMask)
  int cur, nxt;       // the listed tile whose kernel tiles are being walked, and the next one
  unsigned cur_kind = 0, nxt_kind = 0;
  int next_i = 0;  // the first kernel tile not walked yet

  // For the BlockMask row holding q rows `q_a` (and `q_b`: the same row).
  __device__ KvStraddle(const FlexcBlockMask& bm, int b, int h, int q_a, int, int kv_len)
      : blocks(bm, b, h, q_a, q_a, kv_len), tile_len(bm.kv_num == nullptr ? W : bm.kv_tile) {
    cur = blocks.next_block(bm, cur_kind);
    nxt = blocks.next_block(bm, nxt_kind);
  }
  // The next kernel tile's first kv index (-1 when done) and its two kinds.
  __device__ __forceinline__ int next(const FlexcBlockMask& bm, int kv_len, unsigned& kinds) {
    while (cur != KvUnion<W>::kNone) {
      const int i = max(next_i, cur * tile_len / W);
      if (i <= (cur * tile_len + tile_len - 1) / W && i * W < kv_len) {
        next_i = i + 1;
        // A first key before cur's tile lies in an unlisted one (a listed one would have
        // walked this kernel tile already).
        const int first = i * W / tile_len, last = (i * W + W - 1) / tile_len;
        const unsigned lo = first == cur ? cur_kind & 3u : kTileEmpty;
        const unsigned hi = last == cur ? cur_kind & 3u : last == nxt ? nxt_kind & 3u : kTileEmpty;
        kinds = lo | hi << 2;
        return i * W;
      }
      cur = nxt, cur_kind = nxt_kind;
      nxt = blocks.next_block(bm, nxt_kind);
    }
    return -1;
  }
};

// score_mod's relative terms (FlexcVariant::kScoreRelTerms: functions of d = kv_idx - q_idx, b
// and h fixed, such as a T5 bucketed bias or a distance decay) for the ROWS x COLS scores of a
// group of threads: ROWS + COLS - 1 differences, tabulated once per tile, where the scores would
// compute each term ROWS x COLS times. A table holds kRelStride words per term, entry e at
// d = col0 - (row0 + ROWS - 1) + e for the tile whose first row (query position) is row0 and
// first column col0.
constexpr int kRelStride = 256;
template <int ROWS, int COLS>
struct RelTable {
  static constexpr int kTerms = FlexcVariant::kScoreRelTerms;
  static constexpr int kEntries = ROWS + COLS - 1;
  static constexpr int kWords = kTerms * kRelStride;
  static_assert(kEntries <= kRelStride, "a tile's differences fit a table");

  // Threads [0, THREADS) of the group fill `table` (thread `tid`); `q_len` as the hooks see it.
  // Unrolled, so that a thread's loads (a captured table's) are in flight together.
  template <int THREADS>
  __device__ __forceinline__ static void fill(unsigned* table, const FlexcArgs& args, int b, int h,
                                              int row0, int col0, int q_len, int kv_len, int tid) {
    const int d0 = col0 - (row0 + ROWS - 1);
#pragma unroll
    for (int i = 0; i < (kEntries + THREADS - 1) / THREADS; ++i) {
      const int e = tid + i * THREADS;
      if (e >= kEntries) break;
      unsigned w[kTerms > 0 ? kTerms : 1];
      FlexcVariant::score_rel_terms(args, b, h, d0 + e, q_len, kv_len, w);
#pragma unroll
      for (int k = 0; k < kTerms; ++k) table[k * kRelStride + e] = w[k];
    }
  }
  // Where a warp's thread reads it (ScoreTile::Columns::rel), the warp's rows starting `row_off`
  // rows into the group's: its score at fragment row r, column c (ScoreTile's layout) is entry
  // c - r + ROWS - 1.
  __device__ __forceinline__ static const unsigned* thread_view(const unsigned* table,
                                                                int row_off) {
    const int lane = threadIdx.x & 31;
    return table + (ROWS - 1) - row_off - (lane >> 2) + (lane & 3) * 2;
  }
};

// score_mod's and mask_mod's column loads (flexc_hooks.cuh) of one kv tile, staged in shared
// memory by loader threads ahead of the scores (the Hopper forward's idle producer warps), so that
// the threads computing the scores hold no registers for them across their waits (a word per
// score column and load: 32 registers at 128-wide tiles). A stage holds word k * BLOCK_N + c for
// key kv0 + c: score_mod's loads k < kScoreCols, then mask_mod's.
// (Its [Q_LEN, KV_LEN] tile loads come by TMA where their layout allows, the Hopper kernel's
// kTileTma; staged here by cp.async they ran 3-5% slower than the consumers' own loads,
// docs/perf.md.)
template <int BLOCK_N>
struct StagedColumns {
  static constexpr int kScoreCols = FlexcVariant::kScoreColumnLoads;
  static constexpr int kCols = kScoreCols + FlexcVariant::kMaskColumnLoads;
  static constexpr int kBytes = kCols * BLOCK_N * 4;

  // Loader `tid` of `n` fills the stage at shared address `stage` for the kv tile from kv0
  // (keys past kv_len read the last one: the kernel masks their scores).
  __device__ __forceinline__ static void load(unsigned stage, const FlexcAttentionParams& p,
                                              const FlexcArgs& args, int b, int h, int kv0, int tid,
                                              int n) {
#pragma unroll 1
    for (int c = tid; c < BLOCK_N; c += n) {
      unsigned w[kCols > 0 ? kCols : 1];
      const int kv = min(kv0 + c, p.kv_len - 1) + kv_pos0(p);
      const int q_len = hook_q_len<true>(p), kv_len = hook_kv_len(p);
      if constexpr (kScoreCols > 0)
        FlexcVariant::score_columns(args, b, h, 0, kv, q_len, kv_len, w);
      if constexpr (kCols > kScoreCols)
        FlexcVariant::mask_columns(args, b, h, 0, kv, q_len, kv_len, w + kScoreCols);
#pragma unroll
      for (int k = 0; k < kCols; ++k) flexc_tile::st_shared(stage + 4 * (k * BLOCK_N + c), w[k]);
    }
  }
  // Where a consumer thread reads a stage (at `stage` in the CTA's shared memory): the words of
  // its scores' n8 column tile j, column 2t + e, at view[k * BLOCK_N + 8 j + e].
  using View = const unsigned*;
  __device__ __forceinline__ static View view(const unsigned char* stage) {
    return reinterpret_cast<const unsigned*>(stage) + 2 * (threadIdx.x & 3);
  }
};

// Which index a fragment tile's rows run along: queries (S = Q.K^T, the forward kernels) or keys
// (S^T = K.Q^T, the backward kernel). The hooks always see logical (q_idx, kv_idx).
enum class Rows { Q, Kv };

// No staged loads: apply_mods evaluates score_mod's column loads where they stand.
struct Unstaged {
  static constexpr int kCols = 0, kBytes = 0;
  using View = const unsigned*;
};

// The hooks on a warp's MT x NT fragment tile of scores (layout above), rows along R. STAGED: a
// StagedColumns whose loads someone else puts in shared memory (Columns::staged says where).
// TIGHT: registers are short (D 64's three consumers of 160), see apply_mods_at.
template <int MT, int NT, Rows R = Rows::Q, class STAGED = Unstaged, bool TIGHT = false,
          bool SPLIT = false>
struct ScoreTile {
  // The hook indices of this thread's scores, clamped into [0, len) as the hooks' contract
  // requires (flexc_hooks.cuh), and whether each row / column is inside its length. Computed
  // once per row / column. Never built when q_len or kv_len is 0: the host launches nothing for
  // q_len 0, and kv_len 0 leaves no tile to visit (a BlockMask needs kv_len >= 1).
  // `head`: the query head of each row (rows along Q; the decode kernel packs a kv head's
  // query heads into its rows); one head for the whole tile otherwise.
  struct Idx {
    int row[MT][2];
    int col[NT][2];
    int head[MT][2];
    bool row_in[MT][2];
    bool col_in[NT][2];

    // Tensor rows / columns from row0 / col0, inside row_len / col_len; the hooks see them
    // shifted by row_pos0 / col_pos0 (their positions, FlexcAttentionParams::q_pos0, kv_pos0).
    __device__ __forceinline__ Idx(int h, int row0, int col0, int row_len, int col_len,
                                   int row_pos0 = 0, int col_pos0 = 0) {
      const int lane = threadIdx.x & 31;
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int x = row0 + i * 16 + (lane >> 2) + r * 8;
          row[i][r] = min(x, row_len - 1) + row_pos0;
          row_in[i][r] = x < row_len;
          head[i][r] = h;
        }
      set_cols(col0, col_len, col_pos0);
    }
    // Rows given per row (already inside their length), columns from col0.
    __device__ __forceinline__ Idx(const int (&q_idx)[MT][2], const int (&h)[MT][2], int col0,
                                   int col_len) {
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          row[i][r] = q_idx[i][r], head[i][r] = h[i][r], row_in[i][r] = true;
      set_cols(col0, col_len, 0);
    }
    __device__ __forceinline__ void set_cols(int col0, int col_len, int col_pos0) {
      const int lane = threadIdx.x & 31;
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int x = col0 + j * 8 + (lane & 3) * 2 + c;
          col[j][c] = min(x, col_len - 1) + col_pos0;
          col_in[j][c] = x < col_len;
        }
    }
  };

  // Positions (see kPositions): query rows from p.q_pos0 along Q, and from 0 along Kv (the
  // backward) unless built with positions.
  __device__ __forceinline__ static Idx index(int h, int row0, int col0,
                                              const FlexcAttentionParams& p) {
    if constexpr (kPositions)
      return R == Rows::Q ? Idx(h, row0, col0, p.q_len, p.kv_len, p.q_pos0, p.kv_pos0)
                          : Idx(h, row0, col0, p.kv_len, p.q_len, p.kv_pos0, p.q_pos0);
    return R == Rows::Q ? Idx(h, row0, col0, p.q_len, p.kv_len, p.q_pos0, 0)
                        : Idx(h, row0, col0, p.kv_len, p.q_len);
  }
  // The q_len the hooks see: the position after the last query (or the sequence's length).
  __device__ __forceinline__ static int hook_q_len(const FlexcAttentionParams& p) {
    return flexc_attn::hook_q_len<R == Rows::Q>(p);
  }

  // Calls f(i, j, e, h, q_idx, kv_idx, in) for every score s[i][j][e] this thread holds. `in`:
  // the element lies inside both lengths; for rows along Q only the kv length is checked (rows
  // past q_len are never stored).
  template <class F>
  __device__ __forceinline__ static void for_each(const Idx& idx, F f) {
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = idx.row[i][e >> 1], c = idx.col[j][e & 1], h = idx.head[i][e >> 1];
          if constexpr (R == Rows::Q) {
            f(i, j, e, h, r, c, idx.col_in[j][e & 1]);
          } else {
            f(i, j, e, h, c, r, idx.row_in[i][e >> 1] & idx.col_in[j][e & 1]);
          }
        }
  }

  // Whether a tile starting at (row0, col0) reaches past a length that must be masked.
  __device__ __forceinline__ static bool crosses_edge(int row0, int col0,
                                                      const FlexcAttentionParams& p) {
    if constexpr (R == Rows::Q) return col0 + NT * 8 > p.kv_len;
    return row0 + MT * 16 > p.kv_len || col0 + NT * 8 > p.q_len;
  }

  // The variant's column, tile and relative-term loads (flexc_hooks.cuh) at this thread's scores
  // of one tile, rows along Q, which apply_mods reads: the column loads from `staged` (a
  // StagedColumns view: the Hopper kernel's loaders fill it); the tile loads, which load_columns
  // issues ahead of the tile's scores (the Hopper kernel: before it waits for its turn and for
  // Q.K^T, which hide their latency), 16-bit, a word holding a row's columns 2t and 2t + 1 of an
  // n8 tile, raw bits; `rel`, the tile's relative terms (RelTable::thread_view), filled by the
  // kernel.
  static constexpr int kScoreCols = FlexcVariant::kScoreColumnLoads;
  static constexpr int kMaskCols = FlexcVariant::kMaskColumnLoads;
  static constexpr int kScoreTiles = FlexcVariant::kScoreTileLoads;
  static constexpr int kRelTerms = FlexcVariant::kScoreRelTerms;
  static constexpr int kScoreWords = kScoreCols + kScoreTiles + kRelTerms;
  static constexpr bool kStagedCols = STAGED::kCols > 0;
  static_assert(!kStagedCols || STAGED::kBytes == (kScoreCols + kMaskCols) * NT * 8 * 4,
                "the stages hold every column load of the tile's columns");
  struct Columns {
    unsigned tile[MT][2][NT][kScoreTiles > 0 ? kScoreTiles : 1];
    const unsigned* rel;
    typename STAGED::View staged;
    // SPLIT (rows along Q): a partial tile's keys below kv index `split` take BlockMask kind
    // `kind_lo`, the others `kind_hi` (a wide kv tile over two BlockMask tiles, KvStraddle):
    // empty masks them, full keeps them without mask_mod.
    int split;
    unsigned kind_lo, kind_hi;
  };
  // Where this thread's rows of the tile loads start (element kv_idx = 0 plus its first key of
  // an n8 tile, 2t), and whether the fast path applies to them: the capture's kv dim has stride 1
  // and every such pair is 4-byte aligned. The same for every kv tile of a q tile, so a kernel
  // computes them once (the Hopper kernel keeps them in registers: read again per tile from
  // special registers, they cost bias_2d 8-10% at D 128, docs/perf.md).
  struct TileRows {
    const unsigned* at[MT][2][kScoreTiles > 0 ? kScoreTiles : 1];
    bool pairs;
    // Keeps them in registers: the compiler may no longer recompute them.
    __device__ __forceinline__ void pin() {
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
          for (int k = 0; k < kScoreTiles; ++k) asm volatile("" : "+l"(at[i][r][k]));
    }
  };
  __device__ __forceinline__ static TileRows tile_rows(const FlexcAttentionParams& p,
                                                       const FlexcArgs& args, int b, int h,
                                                       int row0) {
    TileRows t{};
    t.pairs = true;
    if constexpr (kScoreTiles > 0) {
      const Idx idx = index(h, row0, 0, p);
      const int col = (threadIdx.x & 3) * 2;
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          long long base[kScoreTiles > 0 ? kScoreTiles : 1];
          FlexcVariant::score_tile_offsets(args, b, idx.head[i][r], idx.row[i][r], kv_pos0(p),
                                           hook_q_len(p), hook_kv_len(p), base);
#pragma unroll
          for (int k = 0; k < kScoreTiles; ++k) {
            const FlexcCapture& cap = args.captures[FlexcVariant::score_tile_slot(k)];
            const unsigned short* at = static_cast<const unsigned short*>(cap.data) + base[k] + col;
            t.pairs &= cap.stride[FlexcVariant::score_tile_dim(k)] == 1 &&
                       reinterpret_cast<unsigned long long>(at) % 4 == 0;
            t.at[i][r][k] = reinterpret_cast<const unsigned*>(at);
          }
        }
    }
    return t;
  }
  // The tile loads of the tile from col0: on the fast path (inside kv_len, `rows.pairs`) a
  // thread's columns 2t, 2t + 1 of each n8 tile of a row are one 32-bit load from the row's
  // pointer, no per-score address arithmetic; element by element otherwise.
  __device__ __forceinline__ static void load_columns(Columns& c, const TileRows& rows,
                                                      const FlexcAttentionParams& p,
                                                      const FlexcArgs& args, int b, int h, int row0,
                                                      int col0) {
    static_assert(R == Rows::Q, "columns are keys");
    if constexpr (kScoreTiles > 0) {
      if (rows.pairs && col0 + NT * 8 <= p.kv_len) {
#pragma unroll
        for (int k = 0; k < kScoreTiles; ++k)
#pragma unroll
          for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
              for (int j = 0; j < NT; ++j)
                c.tile[i][r][j][k] = rows.at[i][r][k][(col0 >> 1) + j * 4];
        return;
      }
      const Idx idx = index(h, row0, col0, p);
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
          for (int j = 0; j < NT; ++j) {
            unsigned w[2][kScoreTiles > 0 ? kScoreTiles : 1];
#pragma unroll
            for (int e = 0; e < 2; ++e)
              FlexcVariant::score_tiles(args, b, h, idx.row[i][r], idx.col[j][e], hook_q_len(p),
                                        hook_kv_len(p), w[e]);
#pragma unroll
            for (int k = 0; k < kScoreTiles; ++k)
              c.tile[i][r][j][k] = pack_pair(FlexcVariant::score_tile_type(k), w[0][k], w[1][k]);
          }
    }
  }

  // Two elements of a 16-bit load (type 1 bf16, 2 fp16) given as float32 bits (score_tiles) as
  // one word of raw bits, and element c of such a word as float32 bits: exact, the values being
  // 16-bit ones.
  __device__ __forceinline__ static unsigned pack_pair(int type, unsigned f0, unsigned f1) {
    if (type == 1) return (f0 >> 16) | (f1 & 0xffff0000u);
    unsigned short h0, h1;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h0) : "f"(__uint_as_float(f0)));
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h1) : "f"(__uint_as_float(f1)));
    return unsigned(h0) | (unsigned(h1) << 16);
  }
  __device__ __forceinline__ static unsigned unpack(int type, unsigned w, int c) {
    if (type == 1) return c ? w & 0xffff0000u : w << 16;
    float f;
    const unsigned short half = static_cast<unsigned short>(c ? w >> 16 : w & 0xffffu);
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(half));
    return __float_as_uint(f);
  }

  // Staged load k's word for score (j, e) (StagedColumns::View): both columns of the pair in one
  // 8-byte shared load, which the tile's other scores of column tile j share.
  __device__ __forceinline__ static unsigned staged_word(const unsigned* view, int k, int j,
                                                         int e) {
    const uint2 w = *reinterpret_cast<const uint2*>(view + k * NT * 8 + 8 * j);
    return e & 1 ? w.y : w.x;
  }

  // score_mod on scale * q.k, then the mask (FlexAttention's order), for the tile at (row0,
  // col0). Leaves scores in the units OnlineSoftmax expects: raw q.k for an identity score_mod
  // (the softmax scale folds into the exponent), score_mod's output otherwise; masked ones -inf.
  // With GRAD, also writes d score_mod / d score at the same point into grad (the backward pass;
  // unused when the derivative is 1 everywhere). The mask is evaluated without short-circuit so
  // the unrolled tile is straight-line code and row- or column-only terms (capture loads, index
  // wrapping) are computed once per row / column, not per element. With `cols` (rows along Q),
  // score_mod's column loads and relative terms come from there (load_columns of the same tile,
  // the kernel's RelTable).
  template <bool GRAD = false>
  __device__ __forceinline__ static void apply_mods(
      float (&s)[MT][NT][4], float (&grad)[GRAD ? MT : 1][GRAD ? NT : 1][4],
      const FlexcAttentionParams& p, const FlexcArgs& args, int b, int h, int row0, int col0,
      bool partial, const Columns* cols = nullptr, bool empty = false) {
    apply_mods_at<GRAD>(s, grad, p, args, b, index(h, row0, col0, p), row0, col0, partial, cols,
                        empty);
  }
  // The same at the positions `idx` (the decode kernel's packed rows).
  template <bool GRAD = false>
  __device__ __forceinline__ static void apply_mods_at(
      float (&s)[MT][NT][4], float (&grad)[GRAD ? MT : 1][GRAD ? NT : 1][4],
      const FlexcAttentionParams& p, const FlexcArgs& args, int b, const Idx& idx, int row0,
      int col0, bool partial, const Columns* cols = nullptr, bool empty = false) {
    // (The derivative where the rowless score is the identity: `score * 0.5`'s.)
    if constexpr (!kIdentityScore || (GRAD && !FlexcVariant::kScoreGradIsOne)) {
      // score_mod with tanh in `form` (flexc_hooks.cuh, "Tanh forms"), which writes the scores
      // unless it only notes tanh's arguments (FlexcTanhBound).
      const auto mods = [&](auto form) {
        constexpr bool kPut = decltype(form)::kValue;
        for_each(idx, [&](int i, int j, int e, int h, int q_idx, int kv_idx, bool) {
          const float x = s[i][j][e] * p.scale;
          if constexpr (GRAD && !FlexcVariant::kScoreGradIsOne) {
            const float g = FlexcVariant::score_mod_grad(args, x, b, h, q_idx, kv_idx,
                                                         hook_q_len(p), hook_kv_len(p), form);
            if constexpr (kPut) grad[i][j][e] = g;
          }
          const auto value = [&]() -> float {
            // (Column loads are read from cols only where someone staged them.)
            if constexpr (kScoreWords > 0 && (kScoreCols == 0 || kStagedCols)) {
              if (cols) {
                unsigned cv[kScoreWords > 0 ? kScoreWords : 1];
#pragma unroll
                for (int k = 0; k < kScoreCols; ++k) cv[k] = staged_word(cols->staged, k, j, e);
#pragma unroll
                for (int k = 0; k < kScoreTiles; ++k)
                  cv[kScoreCols + k] =
                      unpack(FlexcVariant::score_tile_type(k), cols->tile[i][e >> 1][j][k], e & 1);
#pragma unroll
                for (int k = 0; k < kRelTerms; ++k)
                  cv[kScoreCols + kScoreTiles + k] =
                      cols->rel[k * kRelStride + 8 * j + (e & 1) - 16 * i - 8 * (e >> 1)];
                return kRowsApart
                           ? kScoreUnits * FlexcVariant::score_mod_rowless_cols(
                                               args, x, b, h, q_idx, kv_idx, hook_q_len(p),
                                               hook_kv_len(p), cv, form)
                           : FlexcVariant::score_mod_cols(args, x, b, h, q_idx, kv_idx,
                                                          hook_q_len(p), hook_kv_len(p), cv, form);
              }
            }
            return kRowsApart ? kScoreUnits * FlexcVariant::score_mod_rowless(args, x, b, h, q_idx,
                                                                              kv_idx, hook_q_len(p),
                                                                              hook_kv_len(p), form)
                              : FlexcVariant::score_mod(args, x, b, h, q_idx, kv_idx, hook_q_len(p),
                                                        hook_kv_len(p), form);
          };
          if constexpr (!kIdentityScore) {
            const float v = value();
            if constexpr (kPut) s[i][j][e] = v;
          }
        });
      };
      // A pass for the bound, then one in the form it allows. Not where registers are TIGHT:
      // two forms of the pass spilled there (docs/perf.md, "tanh by tile").
      flexc_tanh_forms<FlexcVariant::kTanhForms && !TIGHT>(mods);
    }
    // Where registers are TIGHT, the mask and the edge read the columns again, computed anew from
    // a col0 the compiler cannot see through: a score_mod reading kv_idx would otherwise keep
    // every column's index, clamped and not, live across its scores (64 registers at 128-wide
    // tiles: D 64's 192-row tiles spilled under any mask with a per-key float term). Not
    // elsewhere: it cost prefix_alibi 4-5% at D 128 (docs/perf.md).
    Idx fresh = idx;
    if constexpr (TIGHT && !kIdentityScore) {
      int c0 = col0;
      asm volatile("" : "+r"(c0));
      fresh.set_cols(c0, R == Rows::Q ? p.kv_len : p.q_len,
                     !kPositions    ? 0
                     : R == Rows::Q ? p.kv_pos0
                                    : p.q_pos0);
    }
    // (SPLIT: a tile over an empty and a full BlockMask tile is partial whatever mask_mod.)
    if constexpr (!FlexcVariant::kMaskAlwaysTrue || SPLIT) {
      if (partial) {
        for_each(fresh, [&](int i, int j, int e, int h, int q_idx, int kv_idx, bool in) {
          bool keep = true;
          if constexpr (FlexcVariant::kMaskAlwaysTrue) {
            // (a SPLIT tile's kinds alone)
          } else if constexpr (kMaskCols > 0 && kStagedCols) {
            unsigned cv[kMaskCols > 0 ? kMaskCols : 1];
#pragma unroll
            for (int k = 0; k < kMaskCols; ++k)
              cv[k] = staged_word(cols->staged, kScoreCols + k, j, e);
            keep = FlexcVariant::mask_mod_cols(args, b, h, q_idx, kv_idx, hook_q_len(p),
                                               hook_kv_len(p), cv);
          } else {
            keep = FlexcVariant::mask_mod(args, b, h, q_idx, kv_idx, hook_q_len(p), hook_kv_len(p));
          }
          if constexpr (SPLIT) {
            const unsigned k = kv_idx < cols->split ? cols->kind_lo : cols->kind_hi;
            keep = k == kTileFull || (k == kTilePartial && keep);
          }
          s[i][j][e] = in & keep ? s[i][j][e] : neg_inf();
        });
        return;
      }
    }
    // Past a length, and the whole of a tile `empty` for these rows (the Hopper kernel's D 64
    // tiles over two BlockMask rows): in the branch the edge takes anyway, not a select per
    // score on every tile (ptxas would also keep two copies of s across a branch of its own).
    if (crosses_edge(row0, col0, p) || empty) {
      for_each(fresh, [&](int i, int j, int e, int, int, int, bool in) {
        s[i][j][e] = in && !empty ? s[i][j][e] : neg_inf();
      });
    }
  }
  __device__ __forceinline__ static void apply_mods(
      float (&s)[MT][NT][4], const FlexcAttentionParams& p, const FlexcArgs& args, int b, int h,
      int row0, int col0, bool partial, const Columns* cols = nullptr, bool empty = false) {
    float unused[1][1][4];
    apply_mods<false>(s, unused, p, args, b, h, row0, col0, partial, cols, empty);
  }
};

// Softmax units -> log2 and -> natural log (see ScoreTile::apply_mods).
__device__ __forceinline__ float units_log2(const FlexcAttentionParams& p) {
  return kUnits * (kIdentityScore ? p.scale_log2 : 1.4426950408889634f);
}
__device__ __forceinline__ float units_ln(const FlexcAttentionParams& p) {
  return kUnits * (kIdentityScore ? p.scale : 1.f);
}

// The pre-mod scores (scale * q.k) of a warp's fragment tile, kept before the hooks overwrite
// them: capture gradients are taken there. `x` is [NT][4] when the variant's capture gradients
// read the score (kKeepPreMod), else a [1][4] placeholder, left alone.
template <int NT, int XN>
__device__ __forceinline__ void keep_pre_mod(const float (&s)[NT][4], float scale,
                                             float (&x)[XN][4]) {
  if constexpr (XN == NT) {
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) x[j][e] = s[j][e] * scale;
  }
}

// The capture-gradient contributions of score (j, e) of a backward kernel's step: P, dP and the
// row's delta; x the pre-mod scores, [NT][4] when the variant's gradients read the score
// (kKeepPreMod), else a [1][4] placeholder. Called for every score, without a branch: where P
// is 0 (masked, past a length) grad_score is 0 and the sink adds nothing.
constexpr bool kKeepPreMod = FlexcVariant::kCaptureGradsReadScore;
template <class Sink, int XN>
__device__ __forceinline__ void add_capture_grads(Sink& sink, const FlexcArgs& args,
                                                  const FlexcAttentionParams& p, float pv, float dp,
                                                  float delta, const float (&x)[XN][4], int j,
                                                  int e, int b, int h, int q_idx, int kv_idx) {
  const float grad_score = pv == 0.f ? 0.f : pv * (dp - delta);
  FlexcVariant::accumulate_capture_grads(args, sink, grad_score, XN > 1 ? x[j][e] : 0.f, b, h,
                                         q_idx, kv_idx, hook_q_len<false>(p), hook_kv_len(p));
}

// Writes a warp's MT x DT C fragments, row (i, r) times factor(i, r), into rows [tile_row,
// tile_row + 16 MT) of a staging tile (shared memory in Tile's layout), in the input type.
template <class Tile, bool BF16, int MT, int DT, class Factor>
__device__ __forceinline__ void stage_fragments(const float (&acc)[MT][DT][4], Factor factor,
                                                unsigned char* tile, int tile_row) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < DT; ++j)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = tile_row + i * 16 + g + r * 8, col = j * 8 + t * 2;
        const float f = factor(i, r);
        *reinterpret_cast<unsigned*>(tile + Tile::offset(row, col >> 3) + (col & 7) * 2) =
            flexc_tile::pack2<BF16>(acc[i][j][2 * r] * f, acc[i][j][2 * r + 1] * f);
      }
}

// Stores ROWS staged rows from tile_row of `tile` at out + (row0 + r) * stride with 16-byte
// coalesced stores, one warp; rows at or past `len` are skipped.
template <class Tile, int ROWS>
__device__ __forceinline__ void store_staged(const unsigned char* tile, int tile_row,
                                             unsigned short* out, long long stride, int row0,
                                             int len) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int c = lane; c < ROWS * Tile::kChunks; c += 32) {
    const int r = c / Tile::kChunks, ch = c % Tile::kChunks;
    if (row0 + r < len) {
      *reinterpret_cast<uint4*>(out + (row0 + r) * stride + ch * 8) =
          *reinterpret_cast<const uint4*>(tile + Tile::offset(tile_row + r, ch));
    }
  }
}

// One warp's MT x DT accumulator tiles, each row scaled by factor(i, r), as rows row0.. of a
// [rows, 8 DT] matrix at `out` (row stride `stride`, elements; rows at or past `len` skipped):
// 16-bit, staged in rows [tile_row, tile_row + 16 MT) of `tile` (shared memory no other warp reads
// any more, in Tile's layout) for 16-byte coalesced stores; float32 (kF32Out), unrounded, from
// the fragments as they are (added into `out`: kAddOut).
template <class Tile, bool BF16, int MT, int DT, class Factor>
__device__ __forceinline__ void store_fragments(const float (&acc)[MT][DT][4], Factor factor,
                                                unsigned char* tile, int tile_row, void* out,
                                                long long stride, int row0, int len) {
  if constexpr (kF32Out) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row0 + i * 16 + g + r * 8;
        if (row >= len) continue;
        const float f = factor(i, r);
        float* at = static_cast<float*>(out) + row * stride + t * 2;
#pragma unroll
        for (int j = 0; j < DT; ++j)
          put_f32x2(at + j * 8, acc[i][j][2 * r] * f, acc[i][j][2 * r + 1] * f);
      }
  } else {
    stage_fragments<Tile, BF16>(acc, factor, tile, tile_row);
    __syncwarp();
    store_staged<Tile, MT * 16>(tile, tile_row, static_cast<unsigned short*>(out), stride, row0,
                                len);
  }
}

// A backward kernel's row of query `q` (head h of batch b; past q_len: no key): its LSE in log2
// units (lse_log2), less score_mod's row terms where the kernel computes the rowless scores
// (kRowsApart), so that P is what the forward computed. (The terms come off with their rounding
// errors carried: row_terms(-lse) negated.)
__device__ __forceinline__ float row_lse_log2(const FlexcAttentionParams& p, const FlexcArgs& args,
                                              int b, int h, int q) {
  const bool valid = q < p.q_len;
  float l = valid ? p.lse[(static_cast<long long>(b) * p.q_heads + h) * p.q_len + q] : neg_inf();
  if constexpr (kRowsApart)
    if (l != neg_inf() && l == l)
      l = -FlexcVariant::row_terms(args, -l, b, h, q + (kPositions ? p.q_pos0 : 0), kv_pos0(p),
                                   hook_q_len<false>(p), hook_kv_len(p));
  return flexc_tile::lse_log2(l);
}

// score_mod's row terms (kRowsApart) added to the LSE of each row of a warp's from q row `row0`,
// after OnlineSoftmax::finish. A row with keys whose terms sum to -inf has all its scores -inf:
// no key, output 0; +inf or NaN make it NaN, as they would in its scores. Rows without keys
// (LSE -inf) and NaN rows stay as they are.
template <int MT>
__device__ __forceinline__ void add_row_terms(float (&inv_sum)[MT][2], float (&lse)[MT][2],
                                              const FlexcAttentionParams& p, const FlexcArgs& args,
                                              int b, int h, int row0) {
  if constexpr (kRowsApart) {
    const int g = (threadIdx.x & 31) >> 2;
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int q_idx = min(row0 + i * 16 + g + r * 8, p.q_len - 1) + p.q_pos0;
        const float l = lse[i][r];
        if (l == neg_inf() || l != l) continue;
        const float t = FlexcVariant::row_terms(args, l, b, h, q_idx, kv_pos0(p),
                                                hook_q_len<true>(p), hook_kv_len(p));
        if (fabsf(t) < __int_as_float(0x7f800000)) {
          lse[i][r] = t;
        } else {
          const float nan = __int_as_float(0x7fffffff);
          lse[i][r] = t == neg_inf() ? neg_inf() : nan;
          inv_sum[i][r] = t == neg_inf() ? 0.f : nan;
        }
      }
  }
}

// A warp's rows' LSEs (rows at or past q_len skipped), where p.lse is set.
template <int MT>
__device__ __forceinline__ void put_lse(const float (&lse)[MT][2], const FlexcAttentionParams& p,
                                        int b, int h, int row0) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  if (p.lse == nullptr || t != 0) return;
  float* row_lse = lse_rows(p, b, h);
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + i * 16 + g + r * 8;
      if (row < p.q_len) row_lse[row] = lse[i][r];
    }
}

// store_rows's 16-bit path in two halves, for a kernel that stores one item's rows while the
// next one computes (templates/attention/attention_fwd_sm90.cuh, kDefer): stage_rows stages the
// normalized rows in `tile` (the last reader of the accumulators); put_rows stores them and
// their LSEs from there (reading no register a wgmma may write, so it may run under one).
template <class Tile, bool BF16, int MT, int DT>
__device__ __forceinline__ void stage_rows(const float (&acc)[MT][DT][4],
                                           const float (&inv_sum)[MT][2], unsigned char* tile,
                                           int tile_row) {
  static_assert(!kF32Out, "stage_rows stages 16-bit rows");
  stage_fragments<Tile, BF16>(
      acc, [&](int i, int r) { return inv_sum[i][r]; }, tile, tile_row);
}
template <class Tile, int MT>
__device__ __forceinline__ void put_rows(const float (&lse)[MT][2], const unsigned char* tile,
                                         int tile_row, const FlexcAttentionParams& p, int b, int h,
                                         int row0) {
  static_assert(!kF32Out, "put_rows stores 16-bit rows");
  __syncwarp();
  store_staged<Tile, MT * 16>(tile, tile_row, static_cast<unsigned short*>(out_rows(p, b, h)),
                              p.o_stride[2], row0, p.q_len);
  put_lse(lse, p, b, h, row0);
}

// The epilogue of one warp: its normalised rows of O from q row `row0` (store_fragments), and
// their LSE when p.lse is set. The forward's FLEXC_F32_OUT 2 build merges them instead into the
// float32 rows O holds and their LSE in p.lse (a softmax over other keys; 0 and -inf at first):
//   lse = log(exp(lse_o) + exp(lse_this)), O = exp(lse_o - lse) O + exp(lse_this - lse) O_this,
// as templates/tile/attention_combine.cuh merges split-KV parts: a side without keys (LSE -inf)
// weighs 0, a NaN LSE makes the row NaN.
template <class Tile, bool BF16, int MT, int DT>
__device__ __forceinline__ void store_rows(const float (&acc)[MT][DT][4],
                                           const float (&inv_sum)[MT][2], const float (&lse)[MT][2],
                                           unsigned char* tile, int tile_row,
                                           const FlexcAttentionParams& p, int b, int h, int row0) {
  if constexpr (kAddOut) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float* row_lse = p.lse == nullptr ? nullptr : lse_rows(p, b, h);
    float* o = static_cast<float*>(out_rows(p, b, h));
    float merged[MT][2];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row0 + i * 16 + g + r * 8;
        merged[i][r] = neg_inf();
        if (row >= p.q_len) continue;
        const float la = row_lse[row], lb = lse[i][r];
        const bool nan = la != la || lb != lb;
        const float m = nan ? la + lb : fmaxf(la, lb);
        if (m == neg_inf()) continue;  // no key on either side: the row stays 0, -inf
        const float wa = expf(la - m), wb = expf(lb - m), inv = 1.f / (wa + wb);
        const float fa = wa * inv, fb = wb * inv * inv_sum[i][r];
        float* at = o + row * p.o_stride[2] + t * 2;
#pragma unroll
        for (int j = 0; j < DT; ++j) {
          const float2 x = *reinterpret_cast<const float2*>(at + j * 8);
          // A weight of 0 adds exactly 0, whatever the other side holds.
          *reinterpret_cast<float2*>(at + j * 8) = make_float2(
              (wa == 0.f ? 0.f : fa * x.x) + (wb == 0.f ? 0.f : fb * acc[i][j][2 * r]),
              (wa == 0.f ? 0.f : fa * x.y) + (wb == 0.f ? 0.f : fb * acc[i][j][2 * r + 1]));
        }
        merged[i][r] = m + logf(wa + wb);
      }
    __syncwarp();  // the row's four lanes read its LSE before one replaces it
    if (t == 0)
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = row0 + i * 16 + g + r * 8;
          if (row < p.q_len && merged[i][r] != neg_inf()) row_lse[row] = merged[i][r];
        }
  } else {
    store_fragments<Tile, BF16>(
        acc, [&](int i, int r) { return inv_sum[i][r]; }, tile, tile_row, out_rows(p, b, h),
        p.o_stride[2], row0, p.q_len);
    put_lse(lse, p, b, h, row0);
  }
}

}  // namespace flexc_attn
