// Fresh random inputs on every run, replayable: each seed is printed, and FLEXC_TEST_SEED=N makes
// every seed of the run N.
#pragma once

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>

namespace flexc::testing {

inline uint64_t fresh_seed() {
  const char* fixed = std::getenv("FLEXC_TEST_SEED");
  const uint64_t seed = fixed ? std::stoull(fixed) : std::random_device{}();
  WARN("random seed " << seed << " (replay with FLEXC_TEST_SEED=" << seed << ")");
  return seed;
}

// One generator per test binary, seeded once.
inline std::mt19937_64& rng() {
  static std::mt19937_64 r(fresh_seed());
  return r;
}

}  // namespace flexc::testing
