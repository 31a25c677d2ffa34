// bench_linear: flexc::linear_attention (chunkwise forward) and flexc::linear_attention_step on
// issue 15's shapes: (B, T, H, D) = (1, 8192, 16, 128), (8, 2048, 16, 128), (1, 32768, 16, 128),
// bf16, with GLA's float32 gates per key dim, one gate per step, or none; the step at B x H =
// 256 and 1024 (one token against a 128 x 128 float32 state per head); and fwd_b8_t2k_none_elu,
// the no-gate case through @linear_elu's feature map (its cost beside fwd_b8_t2k_none; no peer).
//
//   bench_linear [--cases NAME,...] [--reps 20] [--inner 5] [--backward] [--json]
//
// Time: CUDA events around --inner calls back to back, their mean per call, median of --reps
// runs after 3 warm-ups (the first compiles). GB/s: the forward's essential traffic (q, k, v and
// the gates read once, the output written once) / time; the step's: the state read and written
// once / time. With --backward the chunkwise cases also time flexc::linear_attention_backward
// alone (a random dout; dq, dk, dv and, with gates, dg; no initial or final state, as in the
// forward) and the forward and backward back to back: "bwd_ms" and "fwdbwd_ms" in the JSON. The
// step has no backward. tools/bench_linear_peers.py runs this with --json beside
// flash-linear-attention's chunk_gla, SDPA (FlashAttention-2, cuDNN) causal and a device copy.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <functional>
#include <optional>
#include <random>
#include <vector>

#include "bench_util.h"
#include "flexc/device.h"
#include "flexc/error.h"
#include "flexc/linear.h"

using namespace flexc;
using flexc_bench::median;

namespace {

struct Case {
  std::string name;
  int64_t b, t, h, d;
  std::string gates;  // "dim", "step", "none"
  bool step = false;  // linear_attention_step over one token
  bool elu = false;   // the feature map elu(x) + 1 on q and k (@linear_elu's)
};

std::vector<Case> all_cases() {
  std::vector<Case> c;
  for (auto [b, t] : {std::pair<int64_t, int64_t>{1, 8192}, {8, 2048}, {1, 32768}})
    for (const char* g : {"dim", "step", "none"})
      c.push_back({fmt::format("fwd_b{}_t{}k_{}", b, t / 1024, g), b, t, 16, 128, g});
  for (int64_t b : {16, 64}) c.push_back({fmt::format("step_b{}_h16", b), b, 1, 16, 128, "dim", true});
  // A feature map's own cost: the no-gate case with and without it.
  c.push_back({"fwd_b8_t2k_none_elu", 8, 2048, 16, 128, "none", false, true});
  return c;
}

// bf16 bits of normal values, and float32 gates logsigmoid(x) / 16 (GLA's).
std::vector<uint16_t> normal_bf16(size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = float_to_bf16(nd(rng));
  return v;
}
std::vector<float> gates(size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> v(n);
  for (auto& x : v) x = -std::log1p(std::exp(-nd(rng))) / 16.f;
  return v;
}

// Median over `reps` runs of the mean time of `inner` back-to-back calls of fn, after 3 warm-ups
// (the first compiles).
double time_ms(const std::function<void()>& fn, const Stream& stream, int reps, int inner) {
  for (int i = 0; i < 3; ++i) fn();
  stream.synchronize();
  std::vector<double> ms;
  EventTimer timer;
  for (int i = 0; i < reps; ++i) {
    timer.start(stream.get());
    for (int j = 0; j < inner; ++j) fn();
    timer.stop(stream.get());
    ms.push_back(timer.elapsed_ms() / inner);
  }
  return median(ms);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"flexc::linear_attention on issue 15's shapes"};
  std::vector<std::string> only;
  int reps = 20, inner = 5;
  bool json = false, backward = false;
  app.add_option("--cases", only, "case names (default: all)")->delimiter(',');
  app.add_option("--reps", reps, "timed repetitions (median)")->check(CLI::Range(1, 100000));
  app.add_option("--inner", inner, "calls per timed run")->check(CLI::Range(1, 10000));
  app.add_flag("--backward", backward,
               "also time the backward alone and forward + backward (chunkwise cases)");
  app.add_flag("--json", json, "one JSON object per case");
  CLI11_PARSE(app, argc, argv);
  try {
    const std::vector<Case> cases = all_cases();
    for (const std::string& n : only)
      if (std::none_of(cases.begin(), cases.end(), [&](const Case& c) { return c.name == n; }))
        throw Error(fmt::format("--cases: no case '{}'", n));
    // dout has its own generator: the inputs stay the same with and without --backward.
    std::mt19937_64 rng(15), dout_rng(16);
    for (const Case& c : cases) {
      if (!only.empty() && std::find(only.begin(), only.end(), c.name) == only.end()) continue;
      const int64_t n = c.b * c.h * c.t * c.d;
      const DeviceBuffer q = DeviceBuffer::from<uint16_t>(normal_bf16(n, rng));
      const DeviceBuffer k = DeviceBuffer::from<uint16_t>(normal_bf16(n, rng));
      const DeviceBuffer v = DeviceBuffer::from<uint16_t>(normal_bf16(n, rng));
      const int64_t g_n = c.gates == "dim" ? n : c.gates == "step" ? c.b * c.h * c.t : 1;
      const DeviceBuffer g = DeviceBuffer::from<float>(gates(size_t(g_n), rng));
      DeviceBuffer out(n * 2), state(c.b * c.h * c.d * c.d * 4);
      state.fill(0);
      const std::vector<int64_t> shape{c.b, c.h, c.t, c.d};
      const TensorView tq{q.get(), DType::BF16, shape, {}}, tk{k.get(), DType::BF16, shape, {}},
          tv{v.get(), DType::BF16, shape, {}}, tout{out.get(), DType::BF16, shape, {}};
      const TensorView tstate{state.get(), DType::F32, {c.b, c.h, c.d, c.d}, {}};
      LinearOptions o;
      if (c.gates == "dim") o.g = TensorView{g.get(), DType::F32, shape, {}};
      if (c.gates == "step") o.g = TensorView{g.get(), DType::F32, {c.b, c.h, c.t}, {}};
      if (c.elu) o.feature_map = LinearVariant::load("@linear_elu").feature_map();
      Stream stream;
      o.stream = stream.get();
      auto call = [&] {
        if (c.step) {
          linear_attention_step(tq, tk, tv, tstate, tout, o);
        } else {
          linear_attention(tq, tk, tv, tout, o);
        }
      };
      const double m = time_ms(call, stream, reps, inner);
      std::string bwd_json, bwd_text;
      if (backward && !c.step) {
        const DeviceBuffer dout = DeviceBuffer::from<uint16_t>(normal_bf16(n, dout_rng));
        const DeviceBuffer dq(n * 2), dk(n * 2), dv(n * 2);
        const DeviceBuffer dg = o.g ? DeviceBuffer(g_n * 4) : DeviceBuffer();
        LinearGradients grads;
        grads.dq = {dq.get(), DType::BF16, shape, {}};
        grads.dk = {dk.get(), DType::BF16, shape, {}};
        grads.dv = {dv.get(), DType::BF16, shape, {}};
        if (o.g) grads.dg = TensorView{dg.get(), DType::F32, o.g->shape, {}};
        LinearBackwardOptions bo;
        bo.g = o.g;
        bo.feature_map = o.feature_map;
        bo.stream = o.stream;
        const TensorView tdout{dout.get(), DType::BF16, shape, {}};
        auto bwd = [&] { linear_attention_backward(tq, tk, tv, tdout, grads, bo); };
        const double bwd_ms = time_ms(bwd, stream, reps, inner);
        const double fwdbwd_ms = time_ms(
            [&] {
              call();
              bwd();
            },
            stream, reps, inner);
        bwd_json = fmt::format(", \"bwd_ms\": {:.5f}, \"fwdbwd_ms\": {:.5f}", bwd_ms, fwdbwd_ms);
        bwd_text = fmt::format(" {:9.4f} ms bwd {:9.4f} ms fwd+bwd", bwd_ms, fwdbwd_ms);
      }
      const double bytes = c.step ? 2.0 * c.b * c.h * c.d * c.d * 4
                                  : 4.0 * n * 2 + (c.gates == "none" ? 0 : g_n * 4.0);
      const double gbs = bytes / (m / 1e3) / 1e9;
      if (json) {
        fmt::print(
            "{{\"case\": \"{}\", \"b\": {}, \"t\": {}, \"h\": {}, \"d\": {}, \"gates\": "
            "\"{}\", \"step\": {}, \"feature_map\": {}, \"ms\": {:.5f}, \"bytes\": {:.0f}, "
            "\"gbs\": {:.1f}{}}}\n",
            c.name, c.b, c.t, c.h, c.d, c.gates, c.step ? "true" : "false",
            c.elu ? "true" : "false", m, bytes, gbs,
            bwd_json);
      } else {
        fmt::print("{:<22} {:9.4f} ms {:7.0f} GB/s{}\n", c.name, m, gbs, bwd_text);
      }
      std::fflush(stdout);
    }
  } catch (const Error& e) {
    fmt::print(stderr, "bench_linear: {}\n", e.what());
    return 1;
  }
  return 0;
}
