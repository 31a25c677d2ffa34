// bench_call_overhead: the host time of one flexc::attention call with its kernel cached: a tiny
// problem (B 1, H 1, 128 x 128, D 64, causal with a BlockMask, LSE written) whose kernel takes
// less GPU time than the call takes host time, so calls back to back measure the call itself
// (argument checks, the JIT cache lookup, the launch). tools/bench_python_overhead.py compares it
// with the Python entry points. Then the same for prepare_attention of the prepared shape (the
// call less its launch).
//
//   bench_call_overhead [--calls 500] [--reps 41] [--json]
//
// Each run times --calls calls (fewer than the launch queue holds: the host never waits for the
// GPU) and then synchronizes; the median run is reported.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <vector>

#include "flexc/attention.h"
#include "flexc/device.h"
#include "flexc/variant.h"

using namespace flexc;

int main(int argc, char** argv) {
  CLI::App app{"host time of a cached flexc::attention call"};
  int calls = 500, reps = 41;
  bool json = false;
  app.add_option("--calls", calls, "calls per timed run")->check(CLI::PositiveNumber);
  app.add_option("--reps", reps, "timed runs (the median is reported)")->check(CLI::PositiveNumber);
  app.add_flag("--json", json, "one JSON line");
  CLI11_PARSE(app, argc, argv);

  constexpr int64_t L = 128, D = 64;
  const Variant causal = Variant::from_catalogue("causal");
  DeviceBuffer q(L * D * 2), k(L * D * 2), v(L * D * 2), out(L * D * 2), lse(L * 4);
  for (DeviceBuffer* b : {&q, &k, &v}) b->fill(0);
  const BlockMask mask = create_block_mask(causal, 1, 1, L, L);
  const Stream stream;
  AttentionOptions o;
  o.block_mask = &mask;
  o.lse = TensorView{lse.get(), DType::F32, {1, 1, L}, {}};
  o.stream = stream.get();
  const auto view = [&](const DeviceBuffer& b) { return TensorView{b.get(), DType::BF16, {1, 1, L, D}, {}}; };
  const TensorView tq = view(q), tk = view(k), tv = view(v), to = view(out);
  for (int i = 0; i < 100; ++i) attention(tq, tk, tv, to, causal, o);  // compile, warm up
  stream.synchronize();
  // The median over runs of the host time per call of `call`.
  const auto time = [&](auto call) {
    std::vector<double> us;
    for (int r = 0; r < reps; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < calls; ++i) call(tq, tk, tv, to, causal, o);
      const auto t1 = std::chrono::steady_clock::now();
      stream.synchronize();
      us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / calls);
    }
    std::sort(us.begin(), us.end());
    return us[us.size() / 2];
  };
  const double call_us = time(attention);
  // prepare_attention of a shape already prepared: what a server pays to check each request.
  const double prepare_us = time(prepare_attention);
  if (json) {
    fmt::print("{{\"cpp_attention_us\": {:.3f}, \"cpp_prepare_attention_us\": {:.3f}}}\n", call_us,
               prepare_us);
  } else {
    fmt::print(
        "flexc::attention, cached, host time per call: {:.2f} us (median of {} x {} calls)\n",
        call_us, reps, calls);
    fmt::print("flexc::prepare_attention, prepared, host time per call: {:.2f} us\n", prepare_us);
  }
}
