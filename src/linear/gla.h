// Gated linear attention's kernels (templates/gla.cuh) from the host: their compile-time
// configuration and KernelSpecs. The entry points are in include/flexc/linear.h.
#pragma once

#include <cstddef>
#include <string>

#include "flexc/tensor.h"
#include "flexc/variant.h"
#include "jit/jit.h"

namespace flexc::detail {

// How the kernels read the log gates (FLEXC_GLA_GATE).
enum class GateType { None = 0, F32 = 1, BF16 = 2, F16 = 3 };

struct GlaConfig {
  std::string arch;  // empty: the current device's
  DType dtype = DType::BF16;
  int dk = 128, dv = 128;
  GateType gate = GateType::F32;
  bool scalar_gate = false;  // one gate per step, or none (the gates' key-dim stride 0)
};

// templates/gla.cuh for `c`, entry flexc_gla_output; the same compile holds flexc_gla_prepare,
// flexc_gla_states and flexc_gla_step. Throws flexc::Error for a head dim or dtype it lacks.
jit::KernelSpec gla_spec(const GlaConfig& c);
// flexc_gla_output's and flexc_gla_states' dynamic shared memory.
size_t gla_output_smem(int dk, int dv, bool scalar_gate);
size_t gla_states_smem();
// The JIT compiles every kernel for a variant; the linear kernels read none of it.
const Variant& gla_variant();

}  // namespace flexc::detail
