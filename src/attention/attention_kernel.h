// The attention kernels' compile-time configurations, chosen per head dim, and their KernelSpecs
// for the JIT: templates/attention/attention_fwd.cuh (portable, mma.sync, sm_80+),
// templates/attention/attention_fwd_sm90.cuh (Hopper, wgmma, sm_90a),
// templates/attention/attention_bwd.cuh (portable backward),
// templates/attention/attention_bwd_sm90.cuh (Hopper backward) and
// templates/attention/attention_bwd_rows.cuh (the backward's per-row kernels).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "dsl/emit_cuda.h"
#include "flexc/blockmask.h"
#include "flexc/tensor.h"
#include "jit/kernels.h"
#include "templates/attention/attention_params.cuh"

namespace flexc::detail {

struct TileConfig {
  int block_m = 0, block_n = 0, threads = 0, stages = 0;
  size_t smem_bytes = 0;  // dynamic shared memory per CTA
  // A BlockMask's q tiles must be multiples of this; 0: block_m (a CTA walks one BlockMask row).
  // 128 for the Hopper forward kernel: its 192-row tiles span at most two BlockMask rows.
  int mask_rows = 0;
};

// The portable kernel's configuration for q / k head dim `head_dim` and v / output head dim
// `v_head_dim`. Throws flexc::Error for a head dim it does not support.
TileConfig fwd_config(int head_dim, int v_head_dim);
// The Hopper kernel's, with q tiles of `block_m` rows (0: the head dims' default, 192 at D 64
// and 128 otherwise; 128 always fits). Throws flexc::Error for a head dim it does not support.
// With `wide`, the kv tiles are fwd_sm90_wide_n's (O staged over Q); throws flexc::Error where
// there are none.
TileConfig fwd_config_sm90(int head_dim, int v_head_dim, int block_m = 0, bool wide = false);
// The Hopper forward kernel's wide kv tile width, FlashAttention-3's: 176 at D 128, 112 at D 192,
// 80 at D 256; 0 for other head dims. It does not divide a BlockMask's 128-key tiles: a call
// takes it without a BlockMask or over one of wider tiles (KvStraddle, attention_tile.cuh).
int fwd_sm90_wide_n(int head_dim, int v_head_dim);
// The q tile rows a Hopper forward call asks fwd_config_sm90 for (0: the head dims' default):
// 128 where D 64's default 192-row tiles lose, short sequences under a BlockMask of a mask_mod
// not always true.
int fwd_sm90_block_m(int head_dim, int v_head_dim, int64_t kv_len, bool mask_always_true,
                     bool block_mask);
// What a forward kernel of configuration `c` adds to its shared memory for score_mod's data
// (dsl::LaunchFacts): 256-word tables per relative term, two for the portable kernel's CTA and on
// Hopper one per consumer in each stage, and on Hopper per stage a word per key and column load
// (the staged column loads). At most 16 KiB (kMostLaunchFacts at 192-row tiles), which every
// configuration above leaves room for (templates/attention/attention_fwd_sm90.cuh asserts it).
size_t fwd_hook_bytes(const dsl::LaunchFacts& facts, const TileConfig& c, bool hopper);

// How much the Hopper forward kernel's shared memory grows when score_mod's tile load comes by
// TMA (templates/attention/attention_fwd_sm90.cuh, kTileTma): a block_m x block_n tile of 16-bit
// values and two barriers per stage, less O's own staging (O goes over Q then). May be negative.
int64_t fwd_sm90_tile_tma_bytes(const TileConfig& c, int head_dim, int v_head_dim);
// score_mod's tile load from capture `t` as the 2-D TMA map the Hopper forward kernel takes
// (kTileTma): the capture seen as rows of its q dim's stride (`q_dim`), the keys along its
// `kv_dim`, boxes of 64 keys by `rows` queries. Empty where the layout does not allow that (the
// kv dim strided, a row pitch not a multiple of 16 bytes or shorter than a row, another dim's
// stride not a multiple of the pitch, an unaligned base): the consumers then load the tile's
// words themselves.
std::optional<FlexcTensorMap> tile_map(const TensorView& t, int kv_dim, int q_dim, uint32_t rows);

// Whether the Hopper forward kernel of configuration `c` runs persistent (a CTA per SM looping
// over the `items` work items) rather than a CTA per item: short sequences at 128-row tiles,
// where a CTA's prologue and epilogue weigh.
bool fwd_sm90_persistent(const TileConfig& c, int head_dim, int v_head_dim, int64_t kv_len,
                         int64_t items, int sms);
// How many 16-column chunks of a consumer warp's Q rows the Hopper forward kernel of
// configuration `c` keeps in registers (Q.K^T then reads only K from shared memory for them;
// Q's and K's reads together saturate its bandwidth with 64-wide kv tiles): with 64-wide kv
// tiles as many as fit beside O (all of Q but at D 256, half there), with 128-wide ones all of
// Q at D 96, none otherwise (nor at D 64's 192-row tiles). A variant whose hooks then
// spill runs the build with `smem_q` (jit::KernelConfig).
int fwd_sm90_q_chunks(const TileConfig& c, int head_dim, int v_head_dim);
// Whether the Hopper forward kernel has a configuration for this head dim.
bool fwd_sm90_supports(int head_dim);

// The backward kernel's (templates/attention/attention_bwd.cuh); throws flexc::Error for a head dim
// it does not support.
TileConfig bwd_config(int head_dim);
// Shared memory of the deterministic mode's dQ kernel (flexc_attention_bwd_dq_rows).
size_t bwd_dq_rows_smem(int head_dim);
// The Hopper backward kernel's (templates/attention/attention_bwd_sm90.cuh); throws flexc::Error
// for a head dim it does not support (64 and 128 only).
TileConfig bwd_config_sm90(int head_dim);

// The decode kernel's (templates/attention/attention_decode.cuh) for head dims D / Dv and `rows`
// query rows per kv head (Q_LEN x Hq / Hkv): 16 x mt rows per CTA, `stages` K / V stages.
struct DecodeConfig {
  int mt = 1, rows = 16, stages = 3, block_n = 64;
  size_t smem_bytes = 0;
};
DecodeConfig decode_config(int head_dim, int v_head_dim, int64_t rows);

// Whether the Hopper kernels can load `t` with TMA: a nonzero stride below 2^39 elements on every
// dim longer than 1.
bool tma_fits(const TensorView& t);
// The TMA descriptor of a [B, H, S, D] bf16 / fp16 tensor for the Hopper kernels: boxes of 64
// columns (one 128-byte swizzle panel) x `rows` rows of one head; rows past S read as zeros.
FlexcTensorMap tensor_map(const TensorView& t, uint32_t rows);
// Why a Hopper kernel (`kernel`: "Hopper kernel", "Hopper backward kernel"; `config` its
// configuration for the call's head dims, throwing for a head dim it lacks) cannot take a call
// with these TMA-loaded tensors and BlockMask; empty when it can.
std::string hopper_misfit(std::string_view kernel, const std::function<TileConfig()>& config,
                          const BlockMask* bm,
                          std::initializer_list<std::pair<const char*, const TensorView*>> tensors);

}  // namespace flexc::detail

namespace flexc::jit {

// templates/attention/attention_fwd.cuh for cfg.dtype and cfg.head_dim:
//   flexc_attention_fwd(FlexcAttentionParams p, FlexcArgs args, FlexcBlockMask bm)
KernelSpec attention_fwd_spec(const KernelConfig& cfg);
// templates/attention/attention_fwd_sm90.cuh, same arguments, built for sm_90a (cfg.arch empty,
// sm_90 or sm_90a; anything else is an error).
KernelSpec attention_fwd_sm90_spec(const KernelConfig& cfg);
// templates/attention/attention_bwd.cuh, entry flexc_attention_bwd:
//   (FlexcAttentionBwdParams p, FlexcArgs args, FlexcBlockMask bm)
// The deterministic build leaves dQ out and holds flexc_attention_bwd_dq_rows (the same
// arguments), which computes it.
KernelSpec attention_bwd_spec(const KernelConfig& cfg);
KernelSpec attention_bwd_deterministic_spec(const KernelConfig& cfg);
// templates/attention/attention_bwd_sm90.cuh (sm_90a), entry flexc_attention_bwd_sm90: the main
// kernel's arguments, then the TMA descriptors of q, dout, k and v. The deterministic build leaves
// dQ to attention_bwd_deterministic_spec's flexc_attention_bwd_dq_rows.
KernelSpec attention_bwd_sm90_spec(const KernelConfig& cfg);
KernelSpec attention_bwd_sm90_deterministic_spec(const KernelConfig& cfg);
// templates/attention/attention_bwd_rows.cuh, entry flexc_attention_bwd_prep (delta; the dQ
// accumulator zeroed), and in the same compile flexc_attention_bwd_dq (dQ from the accumulator):
// both take the FlexcAttentionBwdParams alone. No hook: the unit is the same for every variant
// (cfg's dtype, head dim and float32 outputs only).
KernelSpec attention_bwd_rows_spec(const KernelConfig& cfg);

// templates/attention/attention_decode.cuh: flexc_attention_decode(FlexcDecodeParams p, FlexcArgs
// args) with `mt` 16-row tiles of query rows per CTA (1 or 2; the plain spec: 1). The same compile
// holds flexc_attention_combine(FlexcCombineParams), which merges the kv splits.
KernelSpec attention_decode_spec(const KernelConfig& cfg, int mt);
KernelSpec attention_decode_spec(const KernelConfig& cfg);

// Throws flexc::Error (naming `kernel`) unless cfg.dtype is bf16 or fp16.
void check_dtype(std::string_view kernel, const KernelConfig& cfg);
// Throws flexc::Error unless cfg.arch is empty, sm_90 or sm_90a (wgmma needs sm_90a).
void check_sm90_arch(std::string_view kernel, const KernelConfig& cfg);

}  // namespace flexc::jit
