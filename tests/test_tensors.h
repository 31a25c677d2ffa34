// Random 16-bit test tensors, shared by the attention tests: values exact in bf16 / fp16, drawn
// from the replayable generator of test_random.h.
#pragma once

#include <random>
#include <vector>

#include "flexc/tensor.h"
#include "test_random.h"

namespace flexc::testing {

inline float round16(DType d, float x) {
  return d == DType::BF16 ? bf16_to_float(float_to_bf16(x)) : fp16_to_float(float_to_fp16(x));
}

// n normal values (standard deviation sd), each rounded to `d`.
inline std::vector<float> normal(size_t n, DType d, float sd = 1.f) {
  std::normal_distribution<float> nd(0.f, sd);
  std::vector<float> v(n);
  for (float& x : v) x = round16(d, nd(rng()));
  return v;
}

}  // namespace flexc::testing
