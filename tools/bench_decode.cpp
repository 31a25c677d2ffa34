// bench_decode: flexc::decode bandwidth on issue 12's shapes: Hq 32, Hkv 8, D 128, one query per
// sequence, B 8 x 4k and 32k keys, B 1 x 128k, B 64 x 2k; no mod over contiguous and paged caches
// (pages of 16 and 128 keys through a shuffled page table), alibi, softcap (30), causal and a
// sliding window of 1024 on the same cache, and Q_LEN 4 (speculative decoding).
//
//   bench_decode [--cases NAME,...] [--reps 20] [--inner 10] [--splits N] [--json]
//
// Bytes = K and V read once where the mask keeps them (the sliding window's last 1024 keys, the
// whole sequence otherwise); GB/s = bytes / time. Time: CUDA events around one flexc::decode call
// (decode kernel and, with splits, the combine): --inner calls back to back between two events
// (as decode steps run; the GPU never waits for the host), their mean per call, median of --reps
// such runs after 5 warm-ups (the first compiles). tools/bench_decode_peers.py runs this with --json beside SDPA, cuDNN and Flex.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "bench_util.h"
#include "flexc/decode.h"
#include "flexc/device.h"
#include "flexc/error.h"
#include "flexc/variant.h"

using namespace flexc;
using flexc_bench::median;

namespace {

constexpr int64_t kHq = 32, kHkv = 8, kD = 128, kWindow = 1024;

struct Case {
  std::string name;
  std::string variant;  // catalogue name
  int64_t b, kv, q_len = 1, page = 0;  // page: 0 = contiguous
};

std::vector<Case> all_cases() {
  std::vector<Case> c;
  for (auto [b, kv] : {std::pair<int64_t, int64_t>{8, 4096}, {8, 32768}, {1, 131072}, {64, 2048}}) {
    const std::string shape = fmt::format("b{}_kv{}", b, kv >= 1024 ? fmt::format("{}k", kv / 1024) : std::to_string(kv));
    c.push_back({"noop_" + shape, "noop", b, kv});
    c.push_back({"noop_" + shape + "_page16", "noop", b, kv, 1, 16});
    c.push_back({"noop_" + shape + "_page128", "noop", b, kv, 1, 128});
  }
  for (const char* v : {"causal", "alibi", "softcap", "sliding_window"})
    c.push_back({fmt::format("{}_b8_kv32k", v), v, 8, 32768});
  c.push_back({"noop_b8_kv32k_q4", "noop", 8, 32768, 4});
  c.push_back({"causal_b8_kv32k_q4_page16", "causal", 8, 32768, 4, 16});
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"flexc::decode bandwidth on issue 12's shapes"};
  std::vector<std::string> only;
  int reps = 20, inner = 10, splits = 0;
  bool json = false;
  app.add_option("--cases", only, "case names (default: all)")->delimiter(',');
  app.add_option("--reps", reps, "timed repetitions (median)")->check(CLI::Range(1, 100000));
  app.add_option("--inner", inner, "calls per timed run")->check(CLI::Range(1, 10000));
  app.add_option("--splits", splits, "force this many KV splits (default: the split rule)")
      ->check(CLI::Range(1, 256));
  app.add_flag("--json", json, "one JSON object per case");
  CLI11_PARSE(app, argc, argv);
  try {
    std::vector<Case> cases = all_cases();
    for (const std::string& n : only)
      if (std::none_of(cases.begin(), cases.end(), [&](const Case& c) { return c.name == n; }))
        throw Error(fmt::format("--cases: no case '{}'", n));
    std::mt19937_64 rng(12);
    for (const Case& c : cases) {
      if (!only.empty() && std::find(only.begin(), only.end(), c.name) == only.end()) continue;
      const Variant v = Variant::from_catalogue(c.variant);
      const int64_t pages_per_seq = c.page ? (c.kv + c.page - 1) / c.page : 0;
      const int64_t pages = c.b * pages_per_seq;
      const int64_t kv_elems = c.b * kHkv * c.kv * kD;  // pages * Hkv * page * D when paged
      DeviceBuffer k(kv_elems * 2), vv(kv_elems * 2), q(c.b * kHq * c.q_len * kD * 2),
          out(c.b * kHq * c.q_len * kD * 2);
      k.fill(0x3c), vv.fill(0x3b), q.fill(0x3c);  // small finite bf16 values
      std::vector<int32_t> lens(c.b, int32_t(c.kv)), table(std::max<int64_t>(pages, 1));
      std::iota(table.begin(), table.end(), 0);
      std::shuffle(table.begin(), table.end(), rng);
      const DeviceBuffer dlens = DeviceBuffer::from<int32_t>(lens);
      const DeviceBuffer dtable = DeviceBuffer::from<int32_t>(table);
      KvCache cache;
      const std::vector<int64_t> kv_shape =
          c.page ? std::vector<int64_t>{pages, kHkv, c.page, kD} : std::vector<int64_t>{c.b, kHkv, c.kv, kD};
      cache.k = TensorView{k.get(), DType::BF16, kv_shape, {}};
      cache.v = TensorView{vv.get(), DType::BF16, kv_shape, {}};
      cache.kv_lens = TensorView{dlens.get(), DType::I32, {c.b}, {}};
      if (c.page) cache.page_table = TensorView{dtable.get(), DType::I32, {c.b, pages_per_seq}, {}};
      DecodeOptions o;
      o.num_splits = splits;
      std::vector<float> slopes(kHq);
      for (int64_t h = 0; h < kHq; ++h) slopes[h] = std::exp2(-8.f * float(h + 1) / kHq);
      const DeviceBuffer dslopes = DeviceBuffer::from<float>(slopes);
      if (c.variant == "alibi") o.captures["slope"] = TensorView{dslopes.get(), DType::F32, {kHq}, {}};
      if (c.variant == "softcap") o.params["cap"] = 30;
      if (c.variant == "sliding_window") o.params["window"] = double(kWindow);
      const TensorView qv{q.get(), DType::BF16, {c.b, kHq, c.q_len, kD}, {}};
      const TensorView ov{out.get(), DType::BF16, {c.b, kHq, c.q_len, kD}, {}};
      Stream stream;
      o.stream = stream.get();
      for (int i = 0; i < 5; ++i) decode(qv, cache, ov, v, o);
      stream.synchronize();
      std::vector<double> ms;
      EventTimer t;
      for (int i = 0; i < reps; ++i) {
        t.start(o.stream);
        for (int j = 0; j < inner; ++j) decode(qv, cache, ov, v, o);
        t.stop(o.stream);
        ms.push_back(t.elapsed_ms() / inner);
      }
      const double m = median(ms);
      const int64_t keys = c.variant == "sliding_window" ? std::min(c.kv, kWindow + c.q_len - 1) : c.kv;
      const double bytes = double(c.b) * kHkv * keys * kD * 2 * 2;
      const double gbs = bytes / (m / 1e3) / 1e9;
      const int n_splits = splits ? splits : decode_splits(c.b, kHkv, 1, c.kv, 132);
      if (json) {
        fmt::print("{{\"case\": \"{}\", \"variant\": \"{}\", \"b\": {}, \"hq\": {}, \"hkv\": {}, "
                   "\"kv\": {}, \"q_len\": {}, \"d\": {}, \"page\": {}, \"window\": {}, \"ms\": {:.5f}, "
                   "\"bytes\": {:.0f}, \"gbs\": {:.1f}}}\n",
                   c.name, c.variant, c.b, kHq, kHkv, c.kv, c.q_len, kD, c.page,
                   c.variant == "sliding_window" ? kWindow : 0, m, bytes, gbs);
      } else {
        fmt::print("{:<28} {:8.4f} ms {:7.0f} GB/s  ({:.3f} GB, splits on 132 SMs: {})\n", c.name,
                   m, gbs, bytes / 1e9, n_splits);
      }
      std::fflush(stdout);
    }
  } catch (const Error& e) {
    fmt::print(stderr, "bench_decode: {}\n", e.what());
    return 1;
  }
  return 0;
}
