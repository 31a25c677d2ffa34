// Gated linear attention's kernels (templates/linear/gla.cuh) from the host: their compile-time
// configuration and KernelSpecs. The entry points are in include/flexc/linear.h.
#pragma once

#include <cstddef>
#include <string>

#include "flexc/linear.h"
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
  // templates/linear/gla_backward.cuh (entry flexc_gla_backward; the compile also holds
  // flexc_gla_prepare, _states, _dstates, _dg_scan, _dg and _reduce), else templates/linear/gla.cuh
  // (entry flexc_gla_output; also flexc_gla_prepare, _states and _step).
  bool backward = false;
};

// The KernelSpec for `c`. Throws flexc::Error for a head dim or dtype it lacks.
jit::KernelSpec gla_spec(const GlaConfig& c);
// flexc_gla_output's, flexc_gla_backward's and flexc_gla_states' dynamic shared memory.
size_t gla_output_smem(int dk, int dv, bool scalar_gate);
size_t gla_backward_smem(int dk, int dv, bool scalar_gate);
size_t gla_states_smem();
// The JIT compiles every kernel for a variant; the linear kernels read none of it.
const Variant& gla_variant();

// A feature map's kernels (templates/linear/gla_feature_map.cuh; the variant: feature_map_variant).
jit::KernelSpec feature_map_spec(DType dtype, std::string arch);
// y = phi(x) (grad: y *= phi'(x), y a gradient), x and y [n0, n1, n2, d] in one 16-bit type,
// contiguous rows; enqueued on `stream`.
void run_feature_map(const FeatureMap& fm, const TensorView& x, const TensorView& y, bool grad,
                     CUstream_st* stream);

}  // namespace flexc::detail
