// The forward attention kernel's compile-time configuration (templates/attention_fwd.cuh), chosen
// per head dim, and its KernelSpec for the JIT.
#pragma once

#include <cstddef>

#include "jit/kernels.h"

namespace flexc::detail {

struct FwdConfig {
  int block_m, block_n, warps, stages;
  size_t smem_bytes;  // dynamic shared memory per CTA
  int threads() const { return warps * 32; }
};

// Throws flexc::Error for a head dim the kernel does not support.
FwdConfig fwd_config(int head_dim);

}  // namespace flexc::detail

namespace flexc::jit {

// templates/attention_fwd.cuh for cfg.dtype and cfg.head_dim:
//   flexc_attention_fwd(FlexcAttentionParams p, FlexcArgs args, FlexcBlockMask bm)
KernelSpec attention_fwd_spec(const KernelConfig& cfg);

}  // namespace flexc::jit
