// Warpgroup-level primitives for the Hopper kernel (sm_90a): the shared-memory tile layout wgmma
// reads, its matrix descriptors, wgmma.mma_async with fp32 accumulators, and what feeds it: TMA
// tile loads completing on mbarriers, named barriers, register reallocation. Inline PTX only.
//
// wgmma m64nNk16 is issued by the 4 warps of a warpgroup together; warp w of the group holds
// rows 16 w .. 16 w + 15 of the 64-row result, in the mma.sync C fragment layout of
// tile_mma.cuh (n8 column tile j in d[j][0..3]), and an A operand from registers uses the
// mma.sync A fragment layout. So scores from wgmma feed the same hooks and online softmax as
// scores from mma.sync, and P goes from the softmax to the next product without leaving
// registers.
#pragma once

#include "attention_params.cuh"  // FlexcTensorMap
#include "tile_mma.cuh"

namespace flexc_tile {

// A ROWS x COLS tile of 16-bit elements in the layout wgmma reads with 128-byte swizzling:
// ceil(COLS / 64) panels of ROWS x 64 elements, one 128-byte line per row, each line's 16-byte
// chunks XOR-permuted by row % 8 (TMA's SWIZZLE_128B pattern). Reads of 8 rows of one chunk column
// hit 8 different bank groups. The tile starts 1024-byte aligned (the swizzle repeats every 8
// rows). When COLS is not a multiple of 64 (head dim 96), the last panel is whole in memory and
// its columns past COLS hold TMA's zero fill; products never read them.
template <int ROWS, int COLS>
struct Sw128Tile {
  static_assert(COLS % 32 == 0 && ROWS % 8 == 0, "32-column multiples of 8-row groups");
  static constexpr int kRows = ROWS;
  static constexpr int kChunks = COLS / 8;  // 16-byte chunks per row that hold data
  static constexpr int kPanels = (COLS + 63) / 64;
  static constexpr int kPanelBytes = ROWS * 128;
  static constexpr int kBytes = kPanels * kPanelBytes;

  // Byte offset of chunk `c` of row `r`.
  __device__ __forceinline__ static unsigned offset(int r, int c) {
    return (c >> 3) * kPanelBytes + r * 128 + (((c & 7) ^ (r & 7)) << 4);
  }
  // Descriptor of the rows [row0, ...) x columns [col0, col0 + 16) of the tile as a K-major
  // operand (K = columns, contiguous): 8-row groups 1024 bytes apart. Moving along K inside a
  // panel moves the start address by 32 bytes per 16 columns; the hardware applies the swizzle
  // to the final address, which is why the tile must be 1024-byte aligned.
  __device__ __forceinline__ static unsigned long long k_major(unsigned tile, int row0, int col0) {
    return desc(tile + (col0 >> 6) * kPanelBytes + row0 * 128 + (col0 & 63) * 2, 16, 1024);
  }
  // Descriptor of rows [row0, row0 + 16) x columns [col0, ...) as an MN-major operand (K = rows,
  // M or N = columns, contiguous): 8-row groups 1024 bytes apart along K, 64-column panels
  // kPanelBytes apart along N. Used with the transpose flag (V in O += P.V). Like k_major, a
  // start inside a panel moves the address and the hardware swizzles the final one.
  __device__ __forceinline__ static unsigned long long mn_major(unsigned tile, int row0,
                                                                int col0 = 0) {
    return desc(tile + (col0 >> 6) * kPanelBytes + row0 * 128 + (col0 & 63) * 2, kPanelBytes, 1024);
  }

 private:
  // PTX ISA "matrix descriptor": start address, leading and stride byte offsets (all >> 4) and
  // the swizzle mode in bits 62-63 (1: 128-byte).
  __device__ __forceinline__ static unsigned long long desc(unsigned addr, unsigned lead,
                                                            unsigned stride) {
    return static_cast<unsigned long long>((addr & 0x3ffff) >> 4) |
           static_cast<unsigned long long>(lead >> 4) << 16 |
           static_cast<unsigned long long>(stride >> 4) << 32 | 1ull << 62;
  }
};

// wgmma needs its register operands untouched while it runs: `wgmma_fence` orders earlier
// register writes before the next wgmma, `fence_regs` stops the compiler moving accesses to the
// accumulators across the issue / wait points.
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most N of this warpgroup's committed wgmma groups are still running.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
template <int NT>
__device__ __forceinline__ void fence_regs(float (&d)[NT][4]) {
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
}
template <int KT>
__device__ __forceinline__ void fence_regs(unsigned (&a)[KT][4]) {
#pragma unroll
  for (int j = 0; j < KT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[j][e])::"memory");
}

// ---- mbarriers (PTX ISA "mbarrier"): a phase completes when `count` threads arrived and the
// transaction bytes announced with expect_tx have landed. Waiters name the phase by its parity.
__device__ __forceinline__ void mbar_init(unsigned bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes initialised barriers visible to the other threads and to the TMA unit (then a barrier).
__device__ __forceinline__ void mbar_fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Arrives and announces `bytes` more to land in this phase.
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
// Waits until the phase of parity `parity` completed. A fresh barrier counts the phase before
// its first (parity 1) as completed, so producers wait for "empty" with parity 1 first.
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// TMA: the box at coordinates (c0 innermost, ..., c3) of a 4-D tensor map into shared memory at
// `dst`, completing its bytes on `bar` (announced there by mbar_expect_tx). Out-of-range elements
// are written as zeros.
__device__ __forceinline__ void tma_load_4d(unsigned dst, const FlexcTensorMap& map, int c0, int c1,
                                            int c2, int c3, unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<unsigned long long>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}

// The same for a 2-D tensor map (c0 innermost).
__device__ __forceinline__ void tma_load_2d(unsigned dst, const FlexcTensorMap& map, int c0, int c1,
                                            unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<unsigned long long>(&map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

// A warp's 16 rows from `row0` of a 16-bit Sw128Tile in the accumulator layout (tile_mma.cuh's C
// fragment): w[r][j] holds row row0 + lane / 4 + 8 r, columns 8 j + 2 (lane % 4) and the next
// one. Four 8 x 8 matrices per ldmatrix; the swizzle spreads a matrix's 8 rows over all banks.
template <class Tile, int NT>
__device__ __forceinline__ void ldmatrix_c(unsigned (&w)[2][NT], unsigned tile, int row0) {
  static_assert(NT % 2 == 0, "n8 column tiles in pairs");
  const int lane = threadIdx.x & 31, m = lane >> 3;  // lane m * 8 + i: row i of matrix m
  const int row = row0 + 8 * (m & 1) + (lane & 7);
#pragma unroll
  for (int k = 0; k < NT / 2; ++k)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(w[0][2 * k]), "=r"(w[1][2 * k]), "=r"(w[0][2 * k + 1]),
                   "=r"(w[1][2 * k + 1])
                 : "r"(tile + Tile::offset(row, 2 * k + (m >> 1))));
}

// Named barriers 1..15 (0 is __syncthreads): `sync` waits until `count` threads arrived, counting
// itself; `arrive` only counts.
__device__ __forceinline__ void named_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// ---- bulk copies from shared memory (the async proxy): generic-proxy writes to shared memory
// are made visible to it with fence_proxy_async before the copy is issued.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// global[dst .. dst + bytes) += shared[src ..) as float32, atomically per element (bytes a
// multiple of 16, both addresses 16-byte aligned); completes with the issuing thread's bulk group.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, unsigned src, unsigned bytes) {
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
      "r"(src), "r"(bytes)
      : "memory");
}
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Waits until at most N of this thread's bulk groups still read their shared memory source.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
// Waits until at most N of this thread's bulk groups are still running (writes included).
template <int N>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

// Register reallocation between warpgroups (each warp of a warpgroup executes it).
template <int N>
__device__ __forceinline__ void regs_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void regs_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

// The accumulator operands of an m64nNk16 wgmma: N / 8 column tiles of 4 registers.
#define FLEXC_ACC4(d, j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define FLEXC_ACC32(d, j)                                                             \
  FLEXC_ACC4(d, j), FLEXC_ACC4(d, j + 1), FLEXC_ACC4(d, j + 2), FLEXC_ACC4(d, j + 3), \
      FLEXC_ACC4(d, j + 4), FLEXC_ACC4(d, j + 5), FLEXC_ACC4(d, j + 6), FLEXC_ACC4(d, j + 7)
#define FLEXC_ACC16(d, j) \
  FLEXC_ACC4(d, j), FLEXC_ACC4(d, j + 1), FLEXC_ACC4(d, j + 2), FLEXC_ACC4(d, j + 3)
#define FLEXC_REGS16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define FLEXC_REGS32                                                                            \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define FLEXC_REGS64                                                                            \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "  \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "  \
  "%56, %57, %58, %59, %60, %61, %62, %63}"
#define FLEXC_REGS40                                                                            \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "  \
  "%38, %39}"
#define FLEXC_REGS56                                                                            \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "  \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55}"
#define FLEXC_REGS88                                                                            \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "  \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "  \
  "%56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, "  \
  "%74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87}"
// One wgmma: SHAPE like "m64n128k16", T "bf16" / "f16", REGS the accumulator list, A and B the
// operand text, SCALE_D the operand of the accumulate flag (an immediate: 0 for D = A.B, 1 for
// D += A.B; a predicate computed in the asm would count as a non-wgmma instruction feeding it,
// and ptxas would then serialize the wgmmas).
#define FLEXC_WGMMA(SHAPE, T, REGS, A, B, SCALE_D, TRANS)                                   \
  "wgmma.mma_async.sync.aligned." SHAPE ".f32." T "." T " " REGS ", " A ", " B ", " SCALE_D \
  ", 1, 1, " TRANS ";\n"

// The kv tile widths the Hopper forward kernel's S = Q.K^T takes (N = 8 NT): 32, 64, 128, and
// 80, 112 and 176 for its wide tiles (kWide in templates/attention/attention_fwd_sm90.cuh).
template <int NT>
constexpr bool kWgmmaN = NT == 4 || NT == 8 || NT == 10 || NT == 14 || NT == 16 || NT == 22;
#define FLEXC_SS_ASM(T, SHAPE, REGS, A, B, SD, TR, ...)  \
  asm volatile(FLEXC_WGMMA(SHAPE, T, REGS, A, B, SD, TR) \
               : __VA_ARGS__                             \
               : "l"(a), "l"(b), "n"(ACCUMULATE), "n"(TRANS_A), "n"(TRANS_B))
#define FLEXC_SS_CASE(SHAPE, REGS, A, B, SD, TR, ...)             \
  if constexpr (BF16)                                             \
    FLEXC_SS_ASM("bf16", SHAPE, REGS, A, B, SD, TR, __VA_ARGS__); \
  else                                                            \
    FLEXC_SS_ASM("f16", SHAPE, REGS, A, B, SD, TR, __VA_ARGS__)
#define FLEXC_RS_ASM(T, SHAPE, REGS, A, B, SD, TR, ...)                               \
  asm volatile(FLEXC_WGMMA(SHAPE, T, REGS, A, B, SD, TR)                              \
               : __VA_ARGS__                                                          \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(ACCUMULATE), \
                 "n"(TRANS_B))
#define FLEXC_RS_CASE(SHAPE, REGS, A, B, SD, TR, ...)             \
  if constexpr (BF16)                                             \
    FLEXC_RS_ASM("bf16", SHAPE, REGS, A, B, SD, TR, __VA_ARGS__); \
  else                                                            \
    FLEXC_RS_ASM("f16", SHAPE, REGS, A, B, SD, TR, __VA_ARGS__)

// d (+)= A.B, m64nNk16 (N = 8 NT, kWgmmaN), A and B from shared memory, K-major unless
// TRANS_A / TRANS_B (then MN-major, 16-bit types only).
template <bool BF16, int ACCUMULATE, int TRANS_A = 0, int TRANS_B = 0, int NT>
__device__ __forceinline__ void wgmma_ss(float (&d)[NT][4], unsigned long long a,
                                         unsigned long long b) {
  static_assert(kWgmmaN<NT>, "wgmma_ss: N must be 32, 64, 80, 112, 128 or 176");
  if constexpr (NT == 4) {
    FLEXC_SS_CASE("m64n32k16", FLEXC_REGS16, "%16", "%17", "%18", "%19, %20", FLEXC_ACC16(d, 0));
  } else if constexpr (NT == 8) {
    FLEXC_SS_CASE("m64n64k16", FLEXC_REGS32, "%32", "%33", "%34", "%35, %36", FLEXC_ACC32(d, 0));
  } else if constexpr (NT == 10) {
    FLEXC_SS_CASE("m64n80k16", FLEXC_REGS40, "%40", "%41", "%42", "%43, %44", FLEXC_ACC32(d, 0),
                  FLEXC_ACC4(d, 8), FLEXC_ACC4(d, 9));
  } else if constexpr (NT == 14) {
    FLEXC_SS_CASE("m64n112k16", FLEXC_REGS56, "%56", "%57", "%58", "%59, %60", FLEXC_ACC32(d, 0),
                  FLEXC_ACC16(d, 8), FLEXC_ACC4(d, 12), FLEXC_ACC4(d, 13));
  } else if constexpr (NT == 16) {
    FLEXC_SS_CASE("m64n128k16", FLEXC_REGS64, "%64", "%65", "%66", "%67, %68", FLEXC_ACC32(d, 0),
                  FLEXC_ACC32(d, 8));
  } else if constexpr (NT == 22) {
    FLEXC_SS_CASE("m64n176k16", FLEXC_REGS88, "%88", "%89", "%90", "%91, %92", FLEXC_ACC32(d, 0),
                  FLEXC_ACC32(d, 8), FLEXC_ACC16(d, 16), FLEXC_ACC4(d, 20), FLEXC_ACC4(d, 21));
  }
}

// d[J0 .. J0 + N / 8) (+)= A.B, m64nNk16, A from registers (mma.sync A fragment of the warp's 16
// rows), B from shared memory MN-major (transposed) unless TRANS_B is 0 (then K-major). N as
// wgmma_ss's; SLICE_NT = N / 8, 0 for all of d.
template <bool BF16, int SLICE_NT = 0, int J0 = 0, int ACCUMULATE = 1, int TRANS_B = 1, int NT>
__device__ __forceinline__ void wgmma_rs(float (&d)[NT][4], const unsigned (&a)[4],
                                         unsigned long long b) {
  constexpr int kNT = SLICE_NT ? SLICE_NT : NT;
  static_assert(kWgmmaN<kNT>, "wgmma_rs: N must be 32, 64, 80, 112, 128 or 176");
  static_assert(J0 + kNT <= NT, "the slice lies in d");
  if constexpr (kNT == 4) {
    FLEXC_RS_CASE("m64n32k16", FLEXC_REGS16, "{%16, %17, %18, %19}", "%20", "%21", "%22",
                  FLEXC_ACC16(d, J0));
  } else if constexpr (kNT == 8) {
    FLEXC_RS_CASE("m64n64k16", FLEXC_REGS32, "{%32, %33, %34, %35}", "%36", "%37", "%38",
                  FLEXC_ACC32(d, J0));
  } else if constexpr (kNT == 10) {
    FLEXC_RS_CASE("m64n80k16", FLEXC_REGS40, "{%40, %41, %42, %43}", "%44", "%45", "%46",
                  FLEXC_ACC32(d, J0), FLEXC_ACC4(d, J0 + 8), FLEXC_ACC4(d, J0 + 9));
  } else if constexpr (kNT == 14) {
    FLEXC_RS_CASE("m64n112k16", FLEXC_REGS56, "{%56, %57, %58, %59}", "%60", "%61", "%62",
                  FLEXC_ACC32(d, J0), FLEXC_ACC16(d, J0 + 8), FLEXC_ACC4(d, J0 + 12),
                  FLEXC_ACC4(d, J0 + 13));
  } else if constexpr (kNT == 16) {
    FLEXC_RS_CASE("m64n128k16", FLEXC_REGS64, "{%64, %65, %66, %67}", "%68", "%69", "%70",
                  FLEXC_ACC32(d, J0), FLEXC_ACC32(d, J0 + 8));
  } else if constexpr (kNT == 22) {
    FLEXC_RS_CASE("m64n176k16", FLEXC_REGS88, "{%88, %89, %90, %91}", "%92", "%93", "%94",
                  FLEXC_ACC32(d, J0), FLEXC_ACC32(d, J0 + 8), FLEXC_ACC16(d, J0 + 16),
                  FLEXC_ACC4(d, J0 + 20), FLEXC_ACC4(d, J0 + 21));
  }
}

// d += A.B for any N that is a multiple of 32 (head dims 96, 192, 256 as well as 64 and 128):
// one wgmma_rs per column slice of at most 128, on B's rows [row0, row0 + 16) of the MN-major
// tile `Tile` from column 8 J0. The slices share A's registers and the caller's commit group.
template <class Tile, bool BF16, int J0 = 0, int NT>
__device__ __forceinline__ void wgmma_rs_cols(float (&d)[NT][4], const unsigned (&a)[4],
                                              unsigned tile, int row0) {
  constexpr int kLeft = NT - J0;
  constexpr int kSlice = kLeft >= 16 ? 16 : kLeft >= 8 ? 8 : 4;
  static_assert(kLeft % 4 == 0, "N a multiple of 32");
  wgmma_rs<BF16, kSlice, J0>(d, a, Tile::mn_major(tile, row0, 8 * J0));
  if constexpr (kLeft > kSlice) wgmma_rs_cols<Tile, BF16, J0 + kSlice>(d, a, tile, row0);
}

#undef FLEXC_RS_CASE
#undef FLEXC_RS_ASM
#undef FLEXC_SS_CASE
#undef FLEXC_SS_ASM
#undef FLEXC_WGMMA
#undef FLEXC_REGS88
#undef FLEXC_REGS56
#undef FLEXC_REGS40
#undef FLEXC_REGS64
#undef FLEXC_REGS32
#undef FLEXC_REGS16
#undef FLEXC_ACC16
#undef FLEXC_ACC32
#undef FLEXC_ACC4

}  // namespace flexc_tile
