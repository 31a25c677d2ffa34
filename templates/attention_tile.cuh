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

#include "attention_params.cuh"
#include "flexc_hooks.cuh"
#include "flexc_variant.cuh"
#include "online_softmax.cuh"

namespace flexc_attn {

using flexc_tile::neg_inf;

// The kv tiles one CTA visits, in order: partial ones first, then full ones. A BlockMask tile
// covers bm.kv_tile / BLOCK_N kernel tiles. Tiles are walked in order with cursors (one for the
// prefetch, one for the compute), so no division happens in the loop.
template <int BLOCK_N>
struct KvSchedule {
  struct Cursor {
    int blk = 0, sub = 0;  // BlockMask list position, kernel tile inside that BlockMask tile
  };
  const int* partial = nullptr;  // null: every tile, in order
  const int* full = nullptr;
  int num_partial = 0;
  int per_block = 1;
  int count = 0;  // kernel tiles to visit
  bool dense_partial = false;

  __device__ KvSchedule(const FlexcBlockMask& bm, int b, int h, int q0, int kv_len) {
    if (bm.kv_num == nullptr) {
      count = (kv_len + BLOCK_N - 1) / BLOCK_N;
      dense_partial = !FlexcVariant::kMaskAlwaysTrue;
      return;
    }
    const int bb = bm.nb == 1 ? 0 : b, hh = bm.nh == 1 ? 0 : h;
    const int row = (bb * bm.nh + hh) * bm.num_q_tiles + q0 / bm.q_tile;
    num_partial = bm.kv_num[row];
    const int num_full = bm.full_kv_num[row];
    partial = bm.kv_idx + static_cast<long long>(row) * bm.num_kv_tiles;
    full = bm.full_kv_idx + static_cast<long long>(row) * bm.num_kv_tiles;
    per_block = bm.kv_tile / BLOCK_N;
    count = (num_partial + num_full) * per_block;
  }
  // First kv index of the cursor's tile.
  __device__ __forceinline__ int start(const Cursor& c) const {
    if (partial == nullptr) return c.blk * BLOCK_N;
    const int tile = c.blk < num_partial ? partial[c.blk] : full[c.blk - num_partial];
    return (tile * per_block + c.sub) * BLOCK_N;
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

// Row `h` of batch `b` of a [B, H, S, D] tensor with strides `stride` (elements).
template <class T>
__device__ __forceinline__ const T* at(const void* base, const long long (&stride)[3], int b,
                                       int h) {
  return static_cast<const T*>(base) + b * stride[0] + h * stride[1];
}

// The hooks on a warp's MT x NT fragment tile of scores (layout above).
template <int MT, int NT>
struct ScoreTile {
  // The hook indices of this thread's scores, clamped into [0, len) as the hooks' contract
  // requires (flexc_hooks.cuh). Scores of rows past q_len are never written and those of columns
  // past kv_len (`in_kv` false) are masked, so what the hooks return there is discarded. Computed
  // once per row / column. Never built when q_len or kv_len is 0: the host launches nothing for
  // q_len 0, and kv_len 0 leaves no kv tile to visit (a BlockMask needs kv_len >= 1).
  struct Idx {
    int q[MT][2];
    int kv[NT][2];
    bool in_kv[NT][2];

    __device__ __forceinline__ Idx(int row0, int kv0, int q_len, int kv_len) {
      const int lane = threadIdx.x & 31;
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int r = 0; r < 2; ++r) q[i][r] = min(row0 + i * 16 + (lane >> 2) + r * 8, q_len - 1);
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int col = kv0 + j * 8 + (lane & 3) * 2 + c;
          kv[j][c] = min(col, kv_len - 1);
          in_kv[j][c] = col < kv_len;
        }
    }
  };

  // Calls f(s[i][j][e], q_idx, kv_idx, in_kv) for every score this thread holds.
  template <class F>
  __device__ __forceinline__ static void for_each(float (&s)[MT][NT][4], const Idx& idx, F f) {
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          f(s[i][j][e], idx.q[i][e >> 1], idx.kv[j][e & 1], idx.in_kv[j][e & 1]);
  }

  // score_mod on scale * q.k, then the mask (FlexAttention's order), for the warp's rows from
  // row0 and the tile's columns from kv0. Leaves scores in the units OnlineSoftmax expects: raw
  // q.k for an identity score_mod (the softmax scale folds into the exponent), score_mod's
  // output otherwise. The mask is evaluated without short-circuit so the unrolled tile is
  // straight-line code and row- or column-only terms (capture loads, index wrapping) are computed
  // once per row / column, not per element.
  __device__ __forceinline__ static void apply_mods(float (&s)[MT][NT][4],
                                                    const FlexcAttentionParams& p,
                                                    const FlexcArgs& args, int b, int h, int row0,
                                                    int kv0, bool partial) {
    const Idx idx(row0, kv0, p.q_len, p.kv_len);
    if constexpr (!FlexcVariant::kIdentityScore) {
      for_each(s, idx, [&](float& x, int q_idx, int kv_idx, bool) {
        x = FlexcVariant::score_mod(args, x * p.scale, b, h, q_idx, kv_idx, p.q_len, p.kv_len);
      });
    }
    if constexpr (!FlexcVariant::kMaskAlwaysTrue) {
      if (partial) {
        for_each(s, idx, [&](float& x, int q_idx, int kv_idx, bool in_kv) {
          const bool keep =
              in_kv & FlexcVariant::mask_mod(args, b, h, q_idx, kv_idx, p.q_len, p.kv_len);
          x = keep ? x : neg_inf();
        });
        return;
      }
    }
    if (kv0 + NT * 8 > p.kv_len) {
      for_each(s, idx, [&](float& x, int, int, bool in_kv) { x = in_kv ? x : neg_inf(); });
    }
  }
};

// Softmax units -> log2 and -> natural log (see ScoreTile::apply_mods).
__device__ __forceinline__ float units_log2(const FlexcAttentionParams& p) {
  return FlexcVariant::kIdentityScore ? p.scale_log2 : 1.4426950408889634f;
}
__device__ __forceinline__ float units_ln(const FlexcAttentionParams& p) {
  return FlexcVariant::kIdentityScore ? p.scale : 1.f;
}

// The epilogue of one warp: normalises its MT x DT accumulator tiles, stages them in rows
// [tile_row, tile_row + 16 MT) of `tile` (shared memory no other warp reads any more, in Tile's
// layout), then stores those rows of O from q row `row0` with 16-byte coalesced stores, and their
// LSE when p.lse is set.
template <class Tile, bool BF16, int MT, int DT>
__device__ __forceinline__ void store_rows(const float (&acc)[MT][DT][4],
                                           const float (&inv_sum)[MT][2],
                                           const float (&lse)[MT][2], unsigned char* tile,
                                           int tile_row, const FlexcAttentionParams& p, int b,
                                           int h, int row0) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < DT; ++j)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = tile_row + i * 16 + g + r * 8, col = j * 8 + t * 2;
        *reinterpret_cast<unsigned*>(tile + Tile::offset(row, col >> 3) + (col & 7) * 2) =
            flexc_tile::pack2<BF16>(acc[i][j][2 * r] * inv_sum[i][r],
                                    acc[i][j][2 * r + 1] * inv_sum[i][r]);
      }
  __syncwarp();
  auto* o = static_cast<unsigned short*>(p.o) + b * p.o_stride[0] + h * p.o_stride[1];
#pragma unroll
  for (int c = lane; c < MT * 16 * Tile::kChunks; c += 32) {
    const int r = c / Tile::kChunks, ch = c % Tile::kChunks;
    if (row0 + r < p.q_len) {
      *reinterpret_cast<uint4*>(o + (row0 + r) * p.o_stride[2] + ch * 8) =
          *reinterpret_cast<const uint4*>(tile + Tile::offset(tile_row + r, ch));
    }
  }
  if (p.lse != nullptr && t == 0) {
    float* out = p.lse + (static_cast<long long>(b) * p.q_heads + h) * p.q_len;
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row0 + i * 16 + g + r * 8;
        if (row < p.q_len) out[row] = lse[i][r];
      }
  }
}

}  // namespace flexc_attn
