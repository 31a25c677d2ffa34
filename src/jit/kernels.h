// The kernel templates flexc can build, each with the function that turns a compile-time config
// into its KernelSpec. `flexc compile --kernel` and the catalogue tests iterate this table; a new
// kernel joins it with one line in kernels.cpp.
#pragma once

#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "jit.h"

namespace flexc::jit {

struct KernelConfig {
  std::string arch;            // empty: the current device's
  std::string dtype = "bf16";  // "bf16" or "fp16": the attention kernels' input type
  int head_dim = 128;
  int v_head_dim = 0;  // v's and the output's (the forward kernels); 0: head_dim
  int block_m = 0;     // the Hopper forward kernel's q tile rows; 0: the head dims' default
  bool persistent = false;  // the Hopper forward kernel: a CTA per SM looping over work items
  // The Hopper forward kernel: score_mod's [Q_LEN, KV_LEN] tile load comes by TMA (its launch
  // passes the capture's map, detail::tile_map).
  bool tile_tma = false;
  // The Hopper forward kernel: Q.K^T reads Q from shared memory even where the head dims' default
  // keeps it in registers (detail::fwd_sm90_q_chunks): for hooks that would spill beside it.
  bool smem_q = false;
  // The Hopper forward kernel: the head dims' wide kv tiles (detail::fwd_sm90_wide_n), for hooks
  // that stage nothing per tile; over a BlockMask a tile may straddle two of its tiles.
  bool wide_kv = false;
  // The attention kernels (forward, backward): rows at any positions, the sequence's lengths
  // given (FlexcAttentionParams; templates/tile/attention_tile.cuh, kPositions).
  bool positions = false;
  // The attention kernels' outputs (forward: O; backward: dQ, dK, dV) in float32, unrounded
  // (templates/tile/attention_tile.cuh, kF32Out); with f32_out, `accumulate` adds the backward's
  // into them and merges the forward's into O and its LSE (kAddOut): ring attention's blocks.
  bool f32_out = false, accumulate = false;
  // The forward kernels: packed sequences (FlexcAttentionParams::cu_seqlens_q; templates/tile/
  // attention_tile.cuh, kVarlen); the Hopper one then takes no tile TMA. The backward kernels
  // throw; the others ignore it.
  bool varlen = false;
};

struct KnownKernel {
  std::string_view name;  // "mods_eval", "attention_fwd", ...
  std::string_view description;
  KernelSpec (*spec)(const KernelConfig&);
  std::string_view only_arch = {};  // "sm_90a": built for that arch alone; empty: any sm_80+
};

std::span<const KnownKernel> known_kernels();
// Throws flexc::Error naming the known kernels.
const KnownKernel& find_kernel(std::string_view name);
// The known kernels that build for `arch` (what "all" means for a target; "sm_90" admits an
// "sm_90a" kernel: same GPUs).
std::vector<const KnownKernel*> kernels_for_arch(std::string_view arch);

// templates/mods_eval.cuh: evaluates the variant's hooks over a grid of indices (tests).
//   flexc_mods_eval(FlexcArgs a, int B, int H, int q0, int nq, int kv0, int nkv, int q_len,
//                   int kv_len, const float* score_in, float* score_out, float* grad_out,
//                   unsigned char* mask_out, float grad_score)
// Point i = ((b * H + h) * nq + (q - q0)) * nkv + (kv - kv0) reads score_in[i] and writes
// score_mod, score_mod_grad and mask_mod there; accumulate_capture_grads adds grad_score * d/dx
// into each float capture's `grad` (when non-null).
KernelSpec mods_eval_spec(const KernelConfig& cfg);
KernelSpec blockmask_classify_spec(const KernelConfig& cfg);

// The attention kernels' builds (forward and backward alike, templates/tile/attention_tile.cuh):
// FLEXC_POSITIONS (cfg.positions), FLEXC_F32_OUT and, where cfg.varlen, FLEXC_VARLEN, appended to
// `defines`.
void add_build_defines(const KernelConfig& cfg,
                       std::vector<std::pair<std::string, std::string>>& defines);
// FLEXC_F32_OUT alone (templates/tile/attention_layout.cuh; 0: outputs in the input type; 1:
// float32, cfg.f32_out; 2: float32 added / merged into, cfg.accumulate), for kernels that read no
// position.
void add_f32_out_define(const KernelConfig& cfg,
                        std::vector<std::pair<std::string, std::string>>& defines);

}  // namespace flexc::jit
