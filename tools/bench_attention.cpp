// bench_attention: forward (or, with --backward, backward) attention TFLOP/s on the anchors' shapes
// (../shared/anchors.md): 16k tokens per batch, H * D = 2048, S = 1k / 4k / 16k, D = 64 / 128 for
// noop and causal; the catalogue's alibi, softcap (30), sliding_window (1024), prefix_lm (2048),
// document (six equal documents) and t5_bias at S = 16k, B = 1, H = 16, D = 128. The backward adds
// learnable biases, each with and without its gradient: alibi / alibi_dslope, rel_bias /
// rel_bias_dbias (a [H, 256] table indexed by the clamped relative position). With --gallery
// tools/gallery.json, the gallery's variants instead (issue 11's broader sample: transcendental
// score_mods, learned biases, integer-heavy mods, capture-based and 2-D masks, combinations), at S
// = 8k and 16k (or --seqs), D = 64 and 128, with the same shape rule. With --head-dims, the other
// head dims instead: noop and causal at S = 4k and 16k, softcap at 16k, D = 96, 192 and 256, and
// noop_dv128 / causal_dv128 with q / k head dim 192 and v's 128 (MLA's shapes), 16k tokens per
// batch, H = 16.
//
//   bench_attention [--cases noop,causal,...] [--gallery FILE | --head-dims] [--reps 20]
//                   [--seqs 1024,2048,4096]  (S of noop and causal, default 1k, 4k, 16k; or the
//                   gallery's)
//                   [--dtype bf16|fp16]
//                   [--backward [--atomic-dq | --deterministic]] [--precision fast,exact,approx]
//                   [--packed]  (each case also as packed sequences, FlashAttention's varlen)
//                   [--json]
//
// FLOPs = 4 * B * H * S * S * D * density (2 * B * H * S * S * (D + Dv) * density when v's head
// dim Dv differs; backward: 2.5 times that, the peers' convention),
// density = the exact fraction of (q, kv) pairs the mask keeps (tools/bench_peers.py uses the same,
// so the peers' TFLOP/s compare directly). Time: CUDA events around one call (BlockMask built
// beforehand, kernel compiled by the warm-ups), median of --reps after 3 warm-ups.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "flexc/attention.h"
#include "flexc/blockmask.h"
#include "flexc/device.h"
#include "flexc/error.h"
#include "bench_util.h"
#include "flexc/variant.h"

using namespace flexc;
using flexc_bench::median;
using flexc_bench::random_bits;

namespace {

constexpr int64_t kTokens = 16384, kHidden = 2048;

// A variant at one shape, with how its captures are filled (capture name -> fill, below) and
// whether the backward computes the gradient of its float captures.
struct Case {
  std::string name;
  int64_t s, d;
  Variant variant;
  std::map<std::string, std::string> fills;
  bool learn = false;
  int64_t h = 0;   // heads; 0: kHidden / d
  int64_t dv = 0;  // v's head dim; 0: d
};

// Backward only: a learnable bias with and without its gradient (the bias-gradient overhead).
constexpr const char* kRelBias = "score + bias[h, clamp(kv_idx - q_idx, -128, 127) + 128]";
const std::vector<CaptureSpec> kRelBiasCaptures{{"bias", "float32", {"H", "256"}}};

std::vector<Case> all_cases(bool backward, const std::vector<int64_t>& seqs) {
  std::vector<Case> cases;
  const auto cat = [](const char* n) { return Variant::from_catalogue(n); };
  for (int64_t d : {64, 128})
    for (int64_t s : seqs)
      for (const char* name : {"noop", "causal"}) cases.push_back({name, s, d, cat(name), {}});
  cases.push_back({"alibi", 16384, 128, cat("alibi"), {{"slope", "slopes"}}});
  for (const char* name : {"softcap", "sliding_window", "prefix_lm"})
    cases.push_back({name, 16384, 128, cat(name), {}});
  cases.push_back({"document", 16384, 128, cat("document"), {{"doc", "docs"}}});
  cases.push_back({"t5_bias", 16384, 128, cat("t5_bias"), {{"bias", "ramp"}}});
  if (backward) {
    cases.push_back({"alibi_dslope", 16384, 128, cat("alibi"), {{"slope", "slopes"}}, true});
    const Variant rel = Variant::from_strings(kRelBias, "true", kRelBiasCaptures, {}, "rel_bias");
    cases.push_back({"rel_bias", 16384, 128, rel, {{"bias", "ramp"}}});
    cases.push_back({"rel_bias_dbias", 16384, 128, rel, {{"bias", "ramp"}}, true});
  }
  return cases;
}

// Head dims beyond 64 and 128 (the same cases in tools/bench_peers.py --head-dims).
std::vector<Case> head_dim_cases() {
  std::vector<Case> cases;
  for (int64_t d : {96, 192, 256}) {
    for (int64_t s : {4096, 16384})
      for (const char* name : {"noop", "causal"})
        cases.push_back({name, s, d, Variant::from_catalogue(name), {}, false, 16});
    cases.push_back({"softcap", 16384, d, Variant::from_catalogue("softcap"), {}, false, 16});
  }
  for (int64_t s : {4096, 16384})
    for (const char* name : {"noop", "causal"})
      cases.push_back({fmt::format("{}_dv128", name), s, 192, Variant::from_catalogue(name), {},
                       false, 16, 128});
  return cases;
}

// The gallery (tools/gallery.json): each entry a variant config plus its fills and its torch
// form (for tools/bench_peers.py), run at the lengths seqs (8k and 16k unless --seqs), D = 64 and
// 128.
std::vector<Case> gallery_cases(const std::string& path, const std::vector<int64_t>& seqs) {
  std::ifstream in(path);
  if (!in) throw Error(fmt::format("--gallery {}: cannot read it", path));
  const nlohmann::json g = nlohmann::json::parse(in, nullptr, true, true);
  std::vector<Case> cases;
  for (const nlohmann::json& e : g.at("variants")) {
    nlohmann::json config = e;
    config.erase("torch");
    config.erase("fills");
    const Variant v = Variant::from_json(config.dump(), fmt::format("{}: {}", path, e.at("name")));
    const auto fills = e.value("fills", std::map<std::string, std::string>{});
    for (int64_t d : {64, 128})
      for (int64_t s : seqs) cases.push_back({v.name(), s, d, v, fills});
  }
  return cases;
}

// A capture's contents, deterministic so that tools/bench_peers.py builds the same: "slopes":
// 2^(-8 (i + 1) / n) along the last dim of n; "ramp": 0.01 * (i % 97) - 0.5 over the flat index;
// "docs": 6 i / n (six equal documents) along the last dim. As float32, bf16 or int32 bytes.
std::vector<uint8_t> fill_capture(const CaptureSpec& c, const std::vector<int64_t>& shape,
                                  const std::string& fill) {
  int64_t count = 1;
  for (int64_t x : shape) count *= x;
  const int64_t n = shape.back();
  const DType t = parse_dtype(c.dtype);
  const size_t bytes = dtype_size(t);
  std::vector<uint8_t> out(static_cast<size_t>(count) * bytes);
  for (int64_t i = 0; i < count; ++i) {
    double x;
    if (fill == "slopes")
      x = std::exp2(-8.0 * double(i % n + 1) / double(n));
    else if (fill == "ramp")
      x = 0.01 * double(i % 97) - 0.5;
    else if (fill == "docs")
      x = double(i % n * 6 / n);
    else
      throw Error(fmt::format("capture {}: unknown fill '{}' (slopes, ramp, docs)", c.name, fill));
    uint8_t* at = out.data() + i * bytes;
    if (t == DType::I32) {
      const int32_t v = static_cast<int32_t>(x);
      std::memcpy(at, &v, 4);
    } else if (t == DType::F32) {
      const float v = static_cast<float>(x);
      std::memcpy(at, &v, 4);
    } else if (t == DType::BF16 || t == DType::F16) {
      const uint16_t v = t == DType::BF16 ? float_to_bf16(float(x)) : float_to_fp16(float(x));
      std::memcpy(at, &v, 2);
    } else {
      *at = x != 0;
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"flexc forward attention benchmark (TFLOP/s)"};
  std::vector<std::string> only;
  int reps = 20;
  std::string dtype_name_arg = "bf16";
  bool json = false, backward = false, atomic_dq = false, deterministic = false;
  std::vector<std::string> kernel_names{"auto"}, precision_names{"fast"};
  std::string gallery;
  bool head_dims = false, packed = false;
  std::vector<int64_t> seqs{1024, 4096, 16384};
  app.add_option("--cases", only, "case names to run (default: all)")->delimiter(',');
  app.add_option("--gallery", gallery,
                 "run the variants of this gallery (tools/gallery.json) at S = 8k / 16k (or "
                 "--seqs), D = 64 / 128 instead of the anchors' cases");
  app.add_flag("--head-dims", head_dims,
               "run noop, causal and softcap at D = 96, 192 and 256 (H = 16) instead");
  const CLI::Validator divides_tokens(
      [](std::string& v) {
        return kTokens % std::stoll(v) == 0 ? "" : v + " does not divide 16384";
      },
      "divisor of 16384");
  app.add_option("--seqs", seqs,
                 "sequence lengths of the noop and causal cases (or of the gallery's), "
                 "comma-separated divisors of 16384 (B = 16384 / S)")
      ->delimiter(',')
      ->check(CLI::Range(int64_t(1), kTokens) & divides_tokens);
  app.add_option("--kernel", kernel_names,
                 "kernels to time (forward, or backward with --backward), comma-separated: auto, "
                 "portable, hopper")
      ->delimiter(',');
  app.add_option("--precision", precision_names,
                 "score_mod float math to time, comma-separated: fast, exact, approx (rows of "
                 "exact and approx are named KERNEL_exact, KERNEL_approx)")
      ->delimiter(',')
      ->check(CLI::IsMember({"fast", "exact", "approx"}));
  app.add_option("--reps", reps, "timed repetitions (median reported)")->check(CLI::PositiveNumber);
  app.add_option("--dtype", dtype_name_arg, "bf16 or fp16")->check(CLI::IsMember({"bf16", "fp16"}));
  app.add_flag("--backward", backward,
               "time flexc::attention_backward (after one forward for out and LSE) instead");
  app.add_flag("--atomic-dq", atomic_dq,
               "with --backward: BackwardOptions::deterministic = false (default: unset, the "
               "faster for the kernel)");
  app.add_flag("--deterministic", deterministic,
               "with --backward: BackwardOptions::deterministic = true");
  app.add_flag("--packed", packed,
               "forward: also time each case as B packed sequences of S tokens "
               "(AttentionOptions::packed; rows KERNEL_packed), with q, k, v and out in the "
               "[B, S, H, D] layout for both");
  app.add_flag("--json", json, "also print one JSON object per case (for tools/bench_peers.py)");
  CLI11_PARSE(app, argc, argv);
  if (packed && backward) {
    std::fprintf(stderr, "bench_attention: --packed times the forward\n");
    return 2;
  }
  if (atomic_dq && deterministic) {
    std::fprintf(stderr, "bench_attention: --atomic-dq and --deterministic exclude each other\n");
    return 2;
  }
  try {
    if (!flexc::gpu_available()) {
      std::fprintf(stderr, "bench_attention: no GPU\n");
      return 1;
    }
    const DType dtype = parse_dtype(dtype_name_arg);
    std::vector<FwdKernel> kernels;
    for (const std::string& name : kernel_names) kernels.push_back(parse_fwd_kernel(name));
    flexc::Stream stream;
    fmt::print(
        "| case | kernel | S | D | B | H | density | ms | TFLOP/s |\n"
        "|---|---|---|---|---|---|---|---|---|\n");
    const std::vector<int64_t> gallery_seqs =
        app.count("--seqs") ? seqs : std::vector<int64_t>{8192, 16384};
    const std::vector<Case> cases = !gallery.empty() ? gallery_cases(gallery, gallery_seqs)
                                    : head_dims      ? head_dim_cases()
                                                     : all_cases(backward, seqs);
    for (const Case& c : cases) {
      if (!only.empty() && std::find(only.begin(), only.end(), c.name) == only.end()) continue;
      const int64_t dv = c.dv ? c.dv : c.d;
      if (backward && dv != c.d) continue;  // the backward takes one head dim
      const int64_t B = kTokens / c.s, H = c.h ? c.h : kHidden / c.d;
      const int64_t n = B * H * c.s * std::max(c.d, dv);  // elements per tensor buffer
      const Variant& base = c.variant;
      // q, k, v, and dout for the backward; then out, dq, dk, dv.
      std::vector<uint16_t> host = random_bits(4 * n, dtype, std::random_device{}());
      flexc::DeviceBuffer buf(host.size() * 2);
      buf.upload(host.data(), host.size() * 2);
      flexc::DeviceBuffer out(n * 2), grads(backward ? 3 * n * 2 : 2);
      flexc::DeviceBuffer lse(B * H * c.s * 4);
      // [B, S, H, D] strides with --packed (the packed sequences' layout), else contiguous.
      const auto layout = [&](int64_t d) {
        return packed ? std::vector<int64_t>{c.s * H * d, d, H * d, 1} : std::vector<int64_t>{};
      };
      const TensorView out_view{out.get(), dtype, {B, H, c.s, dv}, layout(dv)};
      const TensorView lse_view{lse.get(), DType::F32, {B, H, c.s}, {}};
      const auto grad = [&](int64_t i) {
        return TensorView{static_cast<uint16_t*>(grads.get()) + i * n, dtype, {B, H, c.s, c.d}, {}};
      };
      // q, k, v (v's head dim), dout.
      const auto at = [&](int64_t i) {
        return TensorView{static_cast<uint16_t*>(buf.get()) + i * n,
                          dtype,
                          {B, H, c.s, i == 2 ? dv : c.d},
                          layout(i == 2 ? dv : c.d)};
      };
      // --packed: the same tensors as B sequences of S tokens, [B * S, H, D].
      std::vector<int32_t> cu(size_t(B) + 1);
      for (int64_t b = 0; b <= B; ++b) cu[size_t(b)] = int32_t(b * c.s);
      const flexc::DeviceBuffer cu_dev = flexc::DeviceBuffer::from<int32_t>(cu);
      const auto rows = [&](const TensorView& t) {
        return TensorView{t.data, dtype, {B * c.s, H, t.shape[3]}, {H * t.shape[3], t.shape[3], 1}};
      };
      AttentionOptions opts;
      opts.stream = stream.get();
      BlockMaskOptions bmo;
      // The captures (deterministic contents), and with c.learn the float ones' gradients (the
      // kernel adds into them over the repetitions).
      std::vector<std::vector<uint8_t>> cap_host;
      std::vector<flexc::DeviceBuffer> cap_dev;
      std::map<std::string, TensorView, std::less<>> cap_grads;
      cap_host.reserve(2 * base.captures().size());
      cap_dev.reserve(2 * base.captures().size());
      for (const CaptureSpec& spec : base.captures()) {
        std::vector<int64_t> shape;
        for (const std::string& dim : spec.dims)
          shape.push_back(dim == "B" ? B : dim == "H" ? H : dim == "Q_LEN" || dim == "KV_LEN" ? c.s
                                                                                 : std::stoll(dim));
        const auto fill = c.fills.find(spec.name);
        if (fill == c.fills.end())
          throw Error(fmt::format("case {}: no fill for capture '{}'", c.name, spec.name));
        cap_host.push_back(fill_capture(spec, shape, fill->second));
        cap_dev.emplace_back(cap_host.back().size());
        cap_dev.back().upload(cap_host.back().data(), cap_host.back().size());
        const DType t = parse_dtype(spec.dtype);
        opts.captures[spec.name] = TensorView{cap_dev.back().get(), t, shape, {}};
        bmo.captures[spec.name] = CaptureData{cap_host.back().data(), cap_dev.back().get(), shape, {}};
        if (c.learn && t == DType::F32) {
          cap_dev.emplace_back(cap_host.back().size());
          cap_dev.back().fill(0);
          cap_grads[spec.name] = TensorView{cap_dev.back().get(), DType::F32, shape, {}};
        }
      }
      std::optional<BlockMask> bm;
      double dens = 1;
      if (!base.mask_always_true()) {
        bm = create_block_mask(base, B, H, c.s, c.s, bmo, stream.get());
        opts.block_mask = &*bm;
        dens = mask_density(base, *bm, B, H, bmo);
      }
      // The same inputs and BlockMask for each precision and kernel.
      for (const std::string& precision : precision_names) {
        const Variant v = base.with_precision(parse_precision(precision, "--precision"));
        BackwardOptions bopts;
        if (backward) {
          opts.kernel = FwdKernel::Auto;
          opts.lse = lse_view;
          attention(at(0), at(1), at(2), out_view, v, opts);
          bopts.block_mask = opts.block_mask;
          bopts.captures = opts.captures;
          bopts.stream = stream.get();
          if (atomic_dq || deterministic) bopts.deterministic = deterministic;
        }
        // One row of the table (and JSON): `suffix` marks the packed sequences' call.
        const auto report = [&](FwdKernel kernel, double t, std::string_view suffix) {
          const double tflops = (backward ? 2.5 : 1.0) * 2.0 * double(B * H) * double(c.s) *
                                double(c.s) * double(c.d + dv) * dens / t * 1e-9;
          const std::string kname =
              (backward ? fmt::format(
                              "bwd{}{}",
                              atomic_dq       ? "_atomic"
                              : deterministic ? "_det"
                                              : "",
                              kernel == FwdKernel::Auto ? "" : "_" + std::string(to_string(kernel)))
                        : std::string(to_string(kernel))) +
              (precision == "fast" ? "" : "_" + precision) + std::string(suffix);
          fmt::print("| {} | {} | {} | {} | {} | {} | {:.4f} | {:.3f} | {:.1f} |\n", c.name, kname,
                     c.s, c.d, B, H, dens, t, tflops);
          if (json)
            fmt::print(
                "{{\"case\": \"{}\", \"kernel\": \"{}\", \"s\": {}, \"d\": {}, \"density\": "
                "{:.6f}, \"ms\": {:.6f}, \"tflops\": {:.2f}}}\n",
                c.name, kname, c.s, c.d, dens, t, tflops);
          std::fflush(stdout);
        };
        // The median time of `call` over reps, after 3 warm-up calls.
        const auto time_calls = [&](const auto& call) {
          std::vector<double> ms;
          for (int r = 0; r < reps + 3; ++r) {
            flexc::EventTimer t;
            t.start(stream.get());
            call();
            t.stop(stream.get());
            if (r >= 3) ms.push_back(t.elapsed_ms());
          }
          return median(ms);
        };
        for (FwdKernel kernel : kernels) {
          opts.kernel = kernel;
          bopts.kernel = kernel;  // (the backward's forward ran once above, with the default)
          report(kernel, time_calls([&] {
                   if (backward)
                     attention_backward(at(0), at(1), at(2), out_view, lse_view, at(3),
                                        {grad(0), grad(1), grad(2), cap_grads}, v, bopts);
                   else
                     attention(at(0), at(1), at(2), out_view, v, opts);
                 }),
                 "");
          if (packed) {
            AttentionOptions po = opts;
            po.packed = PackedSequences{{cu_dev.get(), DType::I32, {B + 1}, {}},
                                        {cu_dev.get(), DType::I32, {B + 1}, {}},
                                        c.s,
                                        c.s};
            po.lse = TensorView{lse.get(), DType::F32, {H, B * c.s}, {}};
            report(kernel, time_calls([&] {
                     attention(rows(at(0)), rows(at(1)), rows(at(2)), rows(out_view), v, po);
                   }),
                   "_packed");
          }
        }
      }
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "bench_attention: %s\n", e.what());
    return 2;
  }
  return 0;
}
