// `flexc run` for a linear-attention config ("kind": "linear"; docs/linear.md): the chunkwise
// forward (and backward) on the GPU from .npy files or --random inputs, --check against the
// float64 reference.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace flexc::cli {

struct LinearRunArgs {
  std::string config, q, k, v, g, random, dtype, out, dout, dq, dk, dv;
  std::optional<double> scale;
  uint64_t seed = 0;
  bool check = false, backward = false;
};

void run_linear(const LinearRunArgs& a);

}  // namespace flexc::cli
