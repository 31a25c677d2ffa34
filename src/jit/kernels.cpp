#include "kernels.h"

#include <fmt/format.h>

#include "attention/attention_kernel.h"
#include "flexc/error.h"

namespace flexc::jit {

KernelSpec mods_eval_spec(const KernelConfig& cfg) {
  return {"mods_eval.cuh", "flexc_mods_eval", {}, cfg.arch};
}

KernelSpec blockmask_classify_spec(const KernelConfig& cfg) {
  return {"blockmask.cuh", "flexc_blockmask_classify", {}, cfg.arch};
}

void add_f32_out_define(const KernelConfig& cfg,
                        std::vector<std::pair<std::string, std::string>>& defines) {
  defines.emplace_back("FLEXC_F32_OUT", cfg.accumulate ? "2" : cfg.f32_out ? "1" : "0");
}

void add_build_defines(const KernelConfig& cfg,
                       std::vector<std::pair<std::string, std::string>>& defines) {
  defines.emplace_back("FLEXC_POSITIONS", cfg.positions ? "1" : "0");
  add_f32_out_define(cfg, defines);
  if (cfg.varlen) defines.emplace_back("FLEXC_VARLEN", "1");
}

namespace {

constexpr KnownKernel kKernels[] = {
    {"attention_fwd", "forward attention (FlashAttention-2 structure, mma.sync, sm_80+)",
     &attention_fwd_spec},
    {"attention_fwd_sm90", "forward attention for Hopper (wgmma, sm_90a)", &attention_fwd_sm90_spec,
     "sm_90a"},
    {"attention_bwd", "backward attention (FlashAttention-2 structure, mma.sync, sm_80+)",
     &attention_bwd_spec},
    {"attention_bwd_deterministic", "backward attention, dq without atomics (bitwise reproducible)",
     &attention_bwd_deterministic_spec},
    {"attention_bwd_sm90", "backward attention for Hopper (wgmma, sm_90a)",
     &attention_bwd_sm90_spec, "sm_90a"},
    {"attention_bwd_rows",
     "the backward's per-row kernels: delta before the main kernel, dq after it (no hook)",
     &attention_bwd_rows_spec},
    {"attention_bwd_sm90_deterministic",
     "backward attention for Hopper, dq left to attention_bwd_deterministic's dq_rows",
     &attention_bwd_sm90_deterministic_spec, "sm_90a"},
    {"attention_decode", "decode attention over a KV cache (split-KV, paged, mma.sync, sm_80+)",
     &attention_decode_spec},
    {"mods_eval", "the variant's mods over a grid of indices (tests)", &mods_eval_spec},
    {"blockmask_classify", "BlockMask: mask_mod over the tiles the analysis left undecided",
     &blockmask_classify_spec},
};

bool builds_for(const KnownKernel& k, std::string_view arch) {
  return k.only_arch.empty() || arch == k.only_arch ||
         (arch.size() + 1 == k.only_arch.size() && k.only_arch.starts_with(arch));
}

}  // namespace

std::span<const KnownKernel> known_kernels() { return kKernels; }

std::vector<const KnownKernel*> kernels_for_arch(std::string_view arch) {
  std::vector<const KnownKernel*> out;
  for (const KnownKernel& k : kKernels)
    if (builds_for(k, arch)) out.push_back(&k);
  return out;
}

const KnownKernel& find_kernel(std::string_view name) {
  std::string names;
  for (const KnownKernel& k : kKernels) {
    if (k.name == name) return k;
    names += fmt::format("{}{}", names.empty() ? "" : ", ", k.name);
  }
  throw Error(fmt::format("unknown kernel '{}' (kernels: {})", name, names));
}

}  // namespace flexc::jit
