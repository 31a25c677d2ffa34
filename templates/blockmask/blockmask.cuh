// The BlockMask's GPU builder (src/blockmask/blockmask_gpu.cpp drives it; docs/blockmask.md
// explains it).
//
// The host's interval analysis decides most tiles as boxes of tiles. On the device:
//   1. the tile-verdict grid (one byte per tile: 0 empty, 1 partial, 2 full) is zeroed,
//   2. flexc_blockmask_paint marks the tiles of the boxes decided full,
//   3. flexc_blockmask_classify evaluates mask_mod on the elements of each undecided tile, one
//      block per tile, and stops as soon as the tile has a true and a false element,
//   4. flexc_blockmask_lists turns the grid into FlexcBlockMask's lists: one warp per q-tile row
//      and one warp per kv-tile column, ballots and popcounts as the prefix sums.
// A box is 8 ints: b0, b1, h0, h1, q0, q1, k0, k1 (half-open; b / h in broadcast coordinates),
// and `prefix` holds the running tile counts of a box list (n + 1 entries, prefix[0] = 0), so
// that tile number w of the list lies in the box i with prefix[i] <= w < prefix[i + 1].
// Only the classify kernel calls the variant; the others are the same for every variant. The
// host launches them with the block sizes below (src/blockmask/blockmask_gpu.cpp mirrors them).
#include "flexc_hooks.cuh"
#include "flexc_variant.cuh"

namespace flexc_bm {

constexpr unsigned char kEmpty = 0, kPartial = 1, kFull = 2;
constexpr int kPaintThreads = 256, kPaintPerThread = 16;
constexpr int kClassifyThreads = 256, kProbe = 16;  // kProbe * kProbe == kClassifyThreads
constexpr int kSweepPerThread = 8;  // elements per thread between two early-exit checks
constexpr int kListWarps = 32;

// The box holding tile number w: the largest i in [lo, hi) with prefix[i] <= w.
__device__ __forceinline__ int find_box(const long long* prefix, int lo, int hi, long long w) {
  while (hi - lo > 1) {
    const int mid = lo + (hi - lo) / 2;
    if (prefix[mid] <= w)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

struct TileAt {
  int b, h, qt, kt;
};

// Tile number `local` of box `x`, kv tile fastest.
__device__ __forceinline__ TileAt tile_in_box(const int* x, long long local) {
  TileAt t;
  const long long wk = x[7] - x[6], wq = x[5] - x[4], wh = x[3] - x[2];
  t.kt = x[6] + int(local % wk);
  local /= wk;
  t.qt = x[4] + int(local % wq);
  local /= wq;
  t.h = x[2] + int(local % wh);
  t.b = x[0] + int(local / wh);
  return t;
}

__device__ __forceinline__ long long grid_at(const TileAt& t, int nh, int nqt, int nkt) {
  return ((long long)(t.b * nh + t.h) * nqt + t.qt) * nkt + t.kt;
}

}  // namespace flexc_bm

// Marks every tile of the `n` boxes full; `total` = prefix[n]. Each block covers
// kPaintThreads * kPaintPerThread consecutive tile numbers (grid-stride beyond that).
extern "C" __global__ void __launch_bounds__(flexc_bm::kPaintThreads)
    flexc_blockmask_paint(unsigned char* grid, const int* boxes, const long long* prefix, int n,
                          long long total, int nh, int nqt, int nkt) {
  using namespace flexc_bm;
  constexpr long long kChunk = (long long)kPaintThreads * kPaintPerThread;
  for (long long base = (long long)blockIdx.x * kChunk; base < total;
       base += (long long)gridDim.x * kChunk) {
    long long w = base + threadIdx.x;
    if (w >= total) continue;
    int i = find_box(prefix, 0, n, w);
    for (int k = 0; k < kPaintPerThread && w < total; ++k, w += kPaintThreads) {
      while (prefix[i + 1] <= w) ++i;  // the thread's tiles only move forward
      grid[grid_at(tile_in_box(boxes + 8 * i, w - prefix[i]), nh, nqt, nkt)] = kFull;
    }
  }
}

// Classifies each tile of the `n` undecided boxes (total = prefix[n] tiles), one block per tile.
extern "C" __global__ void __launch_bounds__(flexc_bm::kClassifyThreads)
    flexc_blockmask_classify(const FlexcArgs args, unsigned char* grid, const int* boxes,
                             const long long* prefix, int n, long long total, int nh, int nqt,
                             int nkt, int q_tile, int kv_tile, int q_len, int kv_len, int q_offset,
                             int kv_offset, int hook_q_len, int hook_kv_len) {
  using namespace flexc_bm;
  for (long long w = blockIdx.x; w < total; w += gridDim.x) {
    const int i = find_box(prefix, 0, n, w);
    const TileAt t = tile_in_box(boxes + 8 * i, w - prefix[i]);
    const int q0 = t.qt * q_tile, k0 = t.kt * kv_tile;
    const int rows = min(q_tile, q_len - q0), cols = min(kv_tile, kv_len - k0);
    bool seen_true = false, seen_false = false;
    auto eval = [&](int q, int kv) {
      if (FlexcVariant::mask_mod(args, t.b, t.h, q_offset + q, kv_offset + kv, hook_q_len,
                                 hook_kv_len))
        seen_true = true;
      else
        seen_false = true;
    };
    // A probe of kProbe x kProbe points spread over the tile (corners included) first: a
    // boundary anywhere in the tile is usually seen by it.
    const int pr = min(kProbe, rows), pc = min(kProbe, cols);
    const int pi = threadIdx.x / kProbe, pj = threadIdx.x % kProbe;
    if (pi < pr && pj < pc)
      eval(q0 + (pr > 1 ? int((long long)pi * (rows - 1) / (pr - 1)) : 0),
           k0 + (pc > 1 ? int((long long)pj * (cols - 1) / (pc - 1)) : 0));
    bool any_true = __syncthreads_or(seen_true), any_false = __syncthreads_or(seen_false);
    // Then every element, row-major: thread j takes elements j, j + kClassifyThreads, ..., kept
    // as (row, col) to avoid a division per element. The loop is uniform over the block.
    const long long n_elems = (long long)rows * cols;
    const int step_r = kClassifyThreads / cols, step_c = kClassifyThreads % cols;
    int r = threadIdx.x / cols, c = threadIdx.x % cols;
    for (long long base = 0; base < n_elems && !(any_true && any_false);
         base += kSweepPerThread * kClassifyThreads) {
      for (int k = 0; k < kSweepPerThread; ++k) {
        if (r < rows) eval(q0 + r, k0 + c);
        r += step_r;
        c += step_c;
        if (c >= cols) c -= cols, ++r;
      }
      any_true = __syncthreads_or(seen_true);
      any_false = __syncthreads_or(seen_false);
    }
    if (threadIdx.x == 0)
      grid[grid_at(t, nh, nqt, nkt)] = any_true ? (any_false ? kPartial : kFull) : kEmpty;
    __syncthreads();  // the next tile's early exit must not see this tile's flags
  }
}

// Writes the lists from the grid. Blocks [0, row_blocks) take kListWarps rows each (a warp per
// row); the others take kListWarps kv-tile columns of one (b, h) group each, read row by row
// (coalesced) and turned through shared memory so that a warp again owns one column.
extern "C" __global__ void __launch_bounds__(flexc_bm::kListWarps * 32)
    flexc_blockmask_lists(const unsigned char* grid, int groups, int nqt, int nkt, int row_blocks,
                          int* kv_num, int* kv_idx, int* full_kv_num, int* full_kv_idx, int* q_num,
                          int* q_idx, int* full_q_num, int* full_q_idx) {
  using namespace flexc_bm;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned below = (1u << lane) - 1;
  // Appends this lane's tile `idx` (kind v) to the warp's partial / full lists.
  auto append = [&](unsigned char v, int idx, int* part, int* full, int& np, int& nf) {
    const unsigned pm = __ballot_sync(0xffffffffu, v == kPartial);
    const unsigned fm = __ballot_sync(0xffffffffu, v == kFull);
    if (v == kPartial) part[np + __popc(pm & below)] = idx;
    if (v == kFull) full[nf + __popc(fm & below)] = idx;
    np += __popc(pm);
    nf += __popc(fm);
  };
  if ((int)blockIdx.x < row_blocks) {
    const long long row = (long long)blockIdx.x * kListWarps + warp;
    if (row >= (long long)groups * nqt) return;
    const unsigned char* g = grid + row * nkt;
    int np = 0, nf = 0;
    for (int k0 = 0; k0 < nkt; k0 += 32) {
      const int kt = k0 + lane;
      append(kt < nkt ? g[kt] : kEmpty, kt, kv_idx + row * nkt, full_kv_idx + row * nkt, np, nf);
    }
    if (lane == 0) kv_num[row] = np, full_kv_num[row] = nf;
    return;
  }
  __shared__ unsigned char s[32][33];
  const int per_group = (nkt + 31) / 32;
  const int c = blockIdx.x - row_blocks, grp = c / per_group, kt0 = (c % per_group) * 32;
  const int kt = kt0 + warp;  // this warp's column
  const long long col = (long long)grp * nkt + kt;
  int np = 0, nf = 0;
  for (int qb = 0; qb < nqt; qb += 32) {
    const int lq = qb + warp, lk = kt0 + lane;  // loaded: row qb + warp, column kt0 + lane
    s[warp][lane] = lq < nqt && lk < nkt ? grid[((long long)grp * nqt + lq) * nkt + lk] : kEmpty;
    __syncthreads();
    const int qt = qb + lane;
    if (kt < nkt) append(s[lane][warp], qt, q_idx + col * nqt, full_q_idx + col * nqt, np, nf);
    __syncthreads();
  }
  if (kt < nkt && lane == 0) q_num[col] = np, full_q_num[col] = nf;
}
