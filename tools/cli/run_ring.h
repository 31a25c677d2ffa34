// `flexc run --ranks N`: ring attention over this machine's first N GPUs (a thread and an NCCL
// communicator per rank), on the whole sequence's q, k and v; the shards' outputs and LSE (and,
// with a dout, the gradients) gathered back into the whole sequence's (docs/ring.md).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "cli/inputs.h"
#include "flexc/npy.h"
#include "flexc/ring.h"

namespace flexc::cli {

struct RingRunArgs {
  const Variant* variant = nullptr;
  RingShape shape;
  std::map<std::string, double, std::less<>> params;
  int64_t send_cost_bytes = RingPlanOptions{}.send_cost_bytes;
  std::map<std::string, const npy::Array*> captures;  // whole-sequence host arrays, by name
  const Input *q = nullptr, *k = nullptr, *v = nullptr;  // the whole sequence
  std::optional<double> scale;
  FwdKernel kernel = FwdKernel::Auto;
  // The backward too, given the whole sequence's dout: gradients of sum(out * dout), float
  // captures' gradients summed over the ranks.
  const Input* dout = nullptr;
  std::optional<bool> deterministic;
};

struct RingRunResult {
  std::vector<float> out, lse;     // the whole sequence's, as one GPU would give them
  double first_ms = 0;             // the first call, construction included (plans, masks, JIT)
  double ms = 0;                   // a warm call: the slowest rank's time between its events
  std::vector<RingStats> stats;    // by rank (the last call: the backward's with a dout)
  RingPlan plan;
  // With a dout: dq, dk, dv of the whole sequence, float captures' gradients by name, and the
  // backward's first and warm times as above.
  std::vector<float> dq, dk, dv;
  std::map<std::string, std::vector<float>, std::less<>> capture_grads;
  double bwd_first_ms = 0, bwd_ms = 0;
};

RingRunResult run_ring(const RingRunArgs& a);

}  // namespace flexc::cli
