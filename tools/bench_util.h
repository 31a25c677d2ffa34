// Helpers the benchmarks share: the median of timings and random 16-bit inputs.
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <thread>
#include <vector>

#include "flexc/tensor.h"

namespace flexc_bench {

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

// n random 16-bit values of `dtype`, uniform in [-2, 2) (never all zeros), made on all threads.
inline std::vector<uint16_t> random_bits(size_t n, flexc::DType dtype, uint64_t seed) {
  std::vector<uint16_t> out(n);
  const unsigned nt = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < nt; ++t)
    threads.emplace_back([&, t] {
      std::mt19937 g(static_cast<uint32_t>(seed + t));
      std::uniform_real_distribution<float> u(-2.f, 2.f);
      for (size_t i = t; i < n; i += nt)
        out[i] = dtype == flexc::DType::BF16 ? flexc::float_to_bf16(u(g)) : flexc::float_to_fp16(u(g));
    });
  for (auto& th : threads) th.join();
  return out;
}

}  // namespace flexc_bench
