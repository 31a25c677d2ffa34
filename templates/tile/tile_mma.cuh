// Warp-level tile primitives for the attention kernels (sm_80+): cp.async copies into swizzled
// shared-memory tiles, ldmatrix fragment loads, mma.sync m16n8k16 (bf16 / fp16 in, fp32
// accumulate) and fp32 -> 16-bit packing. Inline PTX only, so NVRTC needs no CUDA header.
//
// Fragment layouts (PTX ISA, mma.m16n8k16; g = lane / 4, t = lane % 4):
//   A 16x16: a0 (row g, cols 2t..2t+1), a1 (row g+8, same cols), a2 (row g, cols 2t+8..),
//            a3 (row g+8, cols 2t+8..)
//   B 16x8:  b0 (k 2t..2t+1, col g), b1 (k 2t+8.., col g)
//   C 16x8:  c0 c1 (row g, cols 2t, 2t+1), c2 c3 (row g+8, cols 2t, 2t+1)
#pragma once

namespace flexc_tile {

// A tile of ROWS x COLS 16-bit elements in shared memory, row-major, stored in 16-byte chunks
// whose position inside the row is XOR-swizzled with the row number. ldmatrix reads one chunk
// from each of 8 consecutive rows; the swizzle puts those 8 chunks in 8 different bank groups,
// so the reads (and the cp.async writes) are free of bank conflicts without padding.
template <int ROWS, int COLS>
struct SmemTile {
  static_assert(COLS % 32 == 0, "tile width must be a multiple of 32 elements");
  static constexpr int kRows = ROWS;
  static constexpr int kChunks = COLS / 8;  // 16-byte chunks per row
  static constexpr int kRowBytes = COLS * 2;
  static constexpr int kBytes = ROWS * kRowBytes;

  // The XOR key of row `r`. Rows of a multiple of 128 bytes: 8 consecutive rows span the 8
  // bank groups by XOR with r % 8. Rows of 64 (mod 128) bytes: two rows share a 128-byte line,
  // so the key changes every second row and touches only the low two chunk bits. Either way
  // rows 8 apart have the same key.
  __device__ __forceinline__ static int key(int r) {
    if constexpr (kChunks % 8 == 0) {
      return r & 7;
    } else {
      return (r >> 1) & 3;
    }
  }
  // Byte offset of chunk `c` of row `r`.
  __device__ __forceinline__ static unsigned offset(int r, int c) {
    return r * kRowBytes + ((c ^ key(r)) << 4);
  }
};

// Where one lane points ldmatrix.x4 inside a tile. Lanes address rows lane_row + row0 (row0 a
// multiple of 8) and chunks lane_chunk + c0 (c0 even, lane_chunk 0 or 1), so a lane's swizzle
// key never changes and the XOR splits: (c0 + lane_chunk) ^ key == c0 ^ (lane_chunk ^ key). Each
// fragment address is then an add and an XOR with constants.
template <class Tile>
struct FragAddr {
  unsigned row;  // lane_row * row bytes
  unsigned key;  // (lane_chunk ^ key(lane_row)) << 4

  __device__ __forceinline__ FragAddr(int lane_row, int lane_chunk)
      : row(lane_row * Tile::kRowBytes), key((lane_chunk ^ Tile::key(lane_row)) << 4) {}
  __device__ __forceinline__ unsigned operator()(unsigned tile, int row0, int c0) const {
    return tile + row + row0 * Tile::kRowBytes + ((c0 << 4) ^ key);
  }

  // A fragment of rows [row0, row0+16) x cols [16 c0/2, +16) of a row-major [m][k] tile:
  // matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15).
  __device__ __forceinline__ static FragAddr a() {
    const int lane = threadIdx.x & 31;
    return FragAddr(lane & 15, lane >> 4);
  }
  // B fragments of two n8 tiles from a [n][k] tile (K for Q.K^T): regs 0-1 n-tile row0,
  // regs 2-3 n-tile row0 + 8.
  __device__ __forceinline__ static FragAddr b_nk() {
    const int lane = threadIdx.x & 31;
    return FragAddr((lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
  }
  // The A fragment of rows [16 c0/2, +16) x k [row0, row0 + 16) of M^T from a row-major
  // [k][m] tile M, for ldmatrix .trans (dA^T Q from a stored dA): the lanes point where b_nk's do.
  __device__ __forceinline__ static FragAddr a_km() { return b_nk(); }
  // B fragments of two n8 tiles from a [k][n] tile (V for P.V), for ldmatrix .trans: regs 0-1
  // n-tile c0, regs 2-3 n-tile c0 + 1 (in chunks of 8 columns).
  __device__ __forceinline__ static FragAddr b_kn() {
    const int lane = threadIdx.x & 31;
    return FragAddr((lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4);
  }
};

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
// A store to shared memory by its 32-bit address (no 64-bit generic pointer to keep live).
__device__ __forceinline__ void st_shared(unsigned addr, float v) {
  asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(addr), "f"(v) : "memory");
}
__device__ __forceinline__ void st_shared(unsigned addr, unsigned v) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
// A word another thread wrote (ordered by a barrier the caller waited on).
__device__ __forceinline__ unsigned ld_shared_volatile(unsigned addr) {
  unsigned v;
  asm volatile("ld.volatile.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
  return v;
}

// 16-byte global -> shared copy that bypasses L1; `valid == false` writes zeros and reads nothing
// (so `src` may point past the tensor), for rows past a sequence's end: zeros keep
// 0 * garbage = NaN out of P.V.
__device__ __forceinline__ void cp_async_16(unsigned dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// One thread's share of copying an SmemTile, set up once per kernel so that each tile copy costs a
// pointer add and a compare per 16-byte chunk. The row stride comes with each call (a kernel
// parameter: no register is held for it), so one TileCopy serves K and V. When the block's threads
// cover whole rows and a thread's rows are a multiple of 8 apart, a thread always copies the same
// chunk column with the same swizzle, so its shared-memory offsets differ by constants; other
// shapes (head dim 96) recompute the position of each chunk.
template <class Tile, int THREADS>
struct TileCopy {
  static constexpr int kPerThread = Tile::kRows * Tile::kChunks / THREADS;
  static_assert(kPerThread * THREADS == Tile::kRows * Tile::kChunks,
                "tile chunks must split evenly");
  static constexpr bool kRegular =
      THREADS % Tile::kChunks == 0 && (THREADS / Tile::kChunks) % 8 == 0;
  static constexpr int kRowStep = kRegular ? THREADS / Tile::kChunks : 0;

  int row;       // this thread's first row (kRegular)
  int col;       // its first element in the row
  unsigned dst;  // its shared-memory offset

  __device__ __forceinline__ TileCopy() {
    const int t = static_cast<int>(threadIdx.x);
    row = t / Tile::kChunks;
    col = (t % Tile::kChunks) * 8;
    dst = Tile::offset(row, t % Tile::kChunks);
  }

  // Copies rows [row0, row0 + kRows) of the matrix at `base` (row stride `stride` elements) into
  // `tile`; rows >= len become zeros.
  __device__ __forceinline__ void operator()(unsigned tile, const unsigned short* base,
                                             long long stride, int row0, int len) const {
    const int rows_left = len - row0;
    if constexpr (kRegular) {
      const unsigned short* p = base + (row0 + row) * stride + col;
#pragma unroll
      for (int i = 0; i < kPerThread; ++i, p += kRowStep * stride) {
        cp_async_16(tile + dst + i * kRowStep * Tile::kRowBytes, p, row + i * kRowStep < rows_left);
      }
    } else {
      const unsigned short* first = base + row0 * stride;
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
        const int idx = i * THREADS + static_cast<int>(threadIdx.x);
        const int r = idx / Tile::kChunks, c = idx % Tile::kChunks;
        cp_async_16(tile + Tile::offset(r, c), first + r * stride + c * 8, r < rows_left);
      }
    }
  }
};

__device__ __forceinline__ void ldmatrix_x4(unsigned (&d)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&d)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "r"(addr));
}

// D = A * B + D, 16x8x16, fp32 accumulators. BF16 selects bf16 inputs, else fp16.
template <bool BF16>
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                          unsigned b1) {
  // C is a separate input so that a zero accumulator stays a constant (no register zeroing).
  if constexpr (BF16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(d[0]), "f"(d[1]),
          "f"(d[2]), "f"(d[3]));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(d[0]), "f"(d[1]),
          "f"(d[2]), "f"(d[3]));
  }
}

// Zeroes a set of C fragments (the compiler keeps the zeros as constants for the first MMA).
template <int MT, int NT>
__device__ __forceinline__ void zero_fragments(float (&c)[MT][NT][4]) {
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) c[i][j][e] = 0.f;
}

// acc[i][j] += a[i] x B over the n8 column tiles j of every row tile i. load_b(b, n) fetches the
// B fragments of column tiles n / 8 and n / 8 + 1 (one ldmatrix.x4); each feeds all MT row tiles.
template <bool BF16, int MT, int NT, class LoadB>
__device__ __forceinline__ void mma_rows(float (&acc)[MT][NT][4], const unsigned (&a)[MT][4],
                                         LoadB load_b) {
#pragma unroll
  for (int n = 0; n < NT * 8; n += 16) {
    unsigned b[4];
    load_b(b, n);
#pragma unroll
    for (int i = 0; i < MT; ++i) {
      mma_16816<BF16>(acc[i][n / 8], a[i], b[0], b[1]);
      mma_16816<BF16>(acc[i][n / 8 + 1], a[i], b[2], b[3]);
    }
  }
}

// Two floats -> two 16-bit values in one register (lo in the low half), round to nearest even.
template <bool BF16>
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
  unsigned r;
  if constexpr (BF16) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  }
  return r;
}

// The low / high 16-bit value of a register as a float (exact).
template <bool BF16>
__device__ __forceinline__ float unpack_lo(unsigned v) {
  if constexpr (BF16) {
    return __uint_as_float(v << 16);
  } else {
    float f;
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(static_cast<unsigned short>(v & 0xffffu)));
    return f;
  }
}
template <bool BF16>
__device__ __forceinline__ float unpack_hi(unsigned v) {
  return unpack_lo<BF16>(v >> 16);
}

// The A fragment of columns [16 kk, 16 kk + 16) of a row tile held as C fragments (P for P.V, in
// the input type): the layouts agree, two n8 C tiles make one k16 A tile.
template <bool BF16, int NT>
__device__ __forceinline__ void c_to_a(const float (&c)[NT][4], int kk, unsigned (&a)[4]) {
  a[0] = pack2<BF16>(c[2 * kk][0], c[2 * kk][1]);
  a[1] = pack2<BF16>(c[2 * kk][2], c[2 * kk][3]);
  a[2] = pack2<BF16>(c[2 * kk + 1][0], c[2 * kk + 1][1]);
  a[3] = pack2<BF16>(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

// acc += A B^T over K columns: A's MT 16-row tiles from row a_row0 of a shared-memory tile
// (ldmatrix at frag_a), B's rows from b_row0 of another (ldmatrix at frag_b): Q.K^T, K.Q^T,
// V.dO^T.
template <bool BF16, int K, int MT, int NT, class FragA, class FragB>
__device__ __forceinline__ void mma_a_bt(float (&acc)[MT][NT][4], const FragA& frag_a,
                                         unsigned a_tile, int a_row0, const FragB& frag_b,
                                         unsigned b_tile, int b_row0) {
#pragma unroll
  for (int kk = 0; kk < K; kk += 16) {
    unsigned a[MT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i) ldmatrix_x4(a[i], frag_a(a_tile, a_row0 + i * 16, kk / 8));
    mma_rows<BF16>(acc, a, [&](unsigned(&b)[4], int n) {
      ldmatrix_x4(b, frag_b(b_tile, b_row0 + n, kk / 8));
    });
  }
}

// acc += C B: a warp's MT x NT C fragments (P, dS) as the A operand, in the input type, times
// rows [row0, row0 + 8 NT) of a [k][n] shared-memory tile read with ldmatrix .trans at `frag`
// (P.V, P^T dO, dS^T Q, dS K).
template <bool BF16, int MT, int NT, int DT, class Frag>
__device__ __forceinline__ void mma_c_b(float (&acc)[MT][DT][4], const float (&c)[MT][NT][4],
                                        const Frag& frag, unsigned tile, int row0) {
#pragma unroll
  for (int kk = 0; kk < NT * 8; kk += 16) {
    unsigned a[MT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i) c_to_a<BF16>(c[i], kk / 16, a[i]);
    mma_rows<BF16>(acc, a, [&](unsigned(&b)[4], int n) {
      ldmatrix_x4_trans(b, frag(tile, row0 + kk, n / 8));
    });
  }
}

// Programmatic dependent launch (sm_90+; nothing before): a kernel lets the next kernel in its
// stream launch (launch_dependents), and that kernel waits for the first's writes (wait_primary).
__device__ __forceinline__ void launch_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_primary() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// 2^x on the special-function unit; 2^-inf = +0.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace flexc_tile
