// `flexc run CONFIG.json --q q.npy --k k.npy --v v.npy [--capture NAME=FILE.npy] [--param
// NAME=VALUE] [--dtype bf16|fp16] [--out o.npy] [--lse lse.npy] [--check] [--backward [--dout
// dout.npy] [--dq dq.npy] [--dk dk.npy] [--dv dv.npy] [--capture-grad NAME=FILE.npy]]`: forward
// (and backward) attention of a variant on the GPU, end to end, from and to .npy files (or
// --random inputs); --check compares with the float64 CPU reference under the tolerance rule
// (docs/attention.md) and exits 1 on failure.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fmt/format.h>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cli/args.h"
#include "cli/command.h"
#include "flexc/attention.h"
#include "flexc/blockmask.h"
#include "flexc/device.h"
#include "flexc/error.h"
#include "flexc/npy.h"
#include "flexc/reference.h"
#include "flexc/variant.h"

namespace flexc::cli {
namespace {

struct Options {
  std::string config, q, k, v, out, lse, random, dtype = "bf16", precision;
  std::vector<std::string> captures, params;  // NAME=VALUE
  bool backward = false, atomic_dq = false, deterministic = false;
  std::string dout, dq, dk, dv;
  std::vector<std::string> capture_grads;  // NAME=FILE
  std::optional<double> scale;
  uint64_t seed = std::random_device{}();
  bool check = false, dense = false;
  int64_t check_rows = 4096;
  std::string kernel = "auto";
};

// A [B, H, S, D] input on the host: the values the kernel sees (rounded to its dtype) and their
// 16-bit encoding.
struct Input {
  std::vector<int64_t> shape;
  std::vector<float> values;
  std::vector<uint16_t> bits;
};

Input encode(std::vector<int64_t> shape, std::vector<float> values, DType dtype) {
  Input in{std::move(shape), std::move(values), {}};
  in.bits.resize(in.values.size());
  for (size_t i = 0; i < in.values.size(); ++i) {
    in.bits[i] = dtype == DType::BF16 ? float_to_bf16(in.values[i]) : float_to_fp16(in.values[i]);
    in.values[i] = dtype == DType::BF16 ? bf16_to_float(in.bits[i]) : fp16_to_float(in.bits[i]);
  }
  return in;
}

Input read_input(const std::string& path, const char* name, DType dtype) {
  if (path.empty())
    throw Error(fmt::format("--{} FILE.npy is required (or --random B,HQ,HKV,Q_LEN,KV_LEN,D)", name));
  const npy::Array a = npy::read(path);
  if (a.shape.size() != 4)
    throw Error(fmt::format("--{} {}: expected a [B, H, SEQ, D] array, got rank {}", name, path,
                            a.shape.size()));
  return encode(a.shape, a.as(DType::F32, fmt::format("--{} {}", name, path)).to_float(), dtype);
}

std::vector<int64_t> parse_sizes(const std::string& s) {
  std::vector<int64_t> out;
  std::stringstream ss(s);
  const char* names[] = {"B", "HQ", "HKV", "Q_LEN", "KV_LEN", "D", "DV"};
  for (std::string item; std::getline(ss, item, ',');) {
    if (out.size() == 7) break;
    out.push_back(parse_int(item, fmt::format("--random {}", names[out.size()]), 1,
                            out.size() >= 5 ? 256 : kMaxInt32));
  }
  const auto commas = std::count(s.begin(), s.end(), ',');
  if (out.size() < 6 || commas + 1 != static_cast<long>(out.size()))
    throw Error(fmt::format("--random '{}': expected B,HQ,HKV,Q_LEN,KV_LEN,D[,DV]", printable(s)));
  if (out.size() == 6) out.push_back(out[5]);  // v's head dim: q's unless given
  // q, k and v on the host: a float and a 16-bit copy of each element.
  checked_bytes({out[0], out[1], out[3], out[5]}, 6, "--random (q)");
  checked_bytes({out[0], out[2], out[4], std::max(out[5], out[6])}, 6, "--random (k, v)");
  return out;
}

Input random_input(std::vector<int64_t> shape, std::mt19937_64& rng, DType dtype) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> v(n);
  for (float& x : v) x = nd(rng);
  return encode(std::move(shape), std::move(v), dtype);
}

// --check --backward computes every gradient in float64 on the CPU: B * HQ * Q_LEN * KV_LEN
// score elements, each of D multiply-adds several times over. Past this it would take minutes.
constexpr int64_t kMaxBackwardCheckElements = int64_t{1} << 26;

std::vector<float> decode(const flexc::DeviceBuffer& b, size_t n, DType dtype) {
  const std::vector<uint16_t> bits = b.to_vector<uint16_t>(n);
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i)
    out[i] = dtype == DType::BF16 ? bf16_to_float(bits[i]) : fp16_to_float(bits[i]);
  return out;
}

flexc::DeviceBuffer upload(const void* data, size_t bytes) {
  flexc::DeviceBuffer b(std::max<size_t>(bytes, 16));
  b.upload(data, bytes);
  return b;
}

void run(const Options& o) {
  // Every argument is checked before any slow work, and before looking for a GPU.
  const FwdKernel kernel = parse_fwd_kernel(o.kernel);
  const Variant variant = load_variant(o.config, o.precision);
  const DType dtype = parse_dtype(o.dtype);
  const std::map<std::string, std::string> captures = assignments(o.captures, "--capture");
  const std::map<std::string, std::string> params = assignments(o.params, "--param");
  const std::map<std::string, std::string> capture_grads =
      assignments(o.capture_grads, "--capture-grad");
  if (!o.backward)
    for (const auto& [flag, value] : {std::pair{"--dout", &o.dout}, {"--dq", &o.dq},
                                      {"--dk", &o.dk}, {"--dv", &o.dv}})
      if (!value->empty()) throw Error(fmt::format("{} needs --backward", flag));
  if (!o.backward && (!capture_grads.empty() || o.atomic_dq || o.deterministic))
    throw Error(fmt::format("{} needs --backward", o.atomic_dq       ? "--atomic-dq"
                                                   : o.deterministic ? "--deterministic"
                                                                     : "--capture-grad"));
  if (o.atomic_dq && o.deterministic)
    throw Error("--atomic-dq and --deterministic exclude each other");
  for (const auto& [name, file] : capture_grads) {
    auto spec = std::find_if(variant.captures().begin(), variant.captures().end(),
                             [&](const CaptureSpec& c) { return c.name == name; });
    if (spec == variant.captures().end())
      throw Error(fmt::format("--capture-grad {}: '{}' declares no such capture", name, variant.name()));
    if (spec->dtype != "float32")
      throw Error(fmt::format("--capture-grad {}: the capture is {}, which has no gradient", name,
                              spec->dtype));
    if (!captures.contains(name))
      throw Error(fmt::format("--capture-grad {}: pass the capture too (--capture {}=FILE.npy)",
                              name, name));
  }
  std::vector<int64_t> sizes;
  if (!o.random.empty()) sizes = parse_sizes(o.random);
  if (!flexc::gpu_available())
    throw Error("flexc run needs a GPU (no CUDA driver or device found)");

  std::mt19937_64 rng(o.seed);
  Input q, k, v;
  if (!o.random.empty()) {
    if (!o.q.empty() || !o.k.empty() || !o.v.empty())
      throw Error("--random generates q, k and v: give it or --q/--k/--v, not both");
    const std::vector<int64_t>& s = sizes;
    q = random_input({s[0], s[1], s[3], s[5]}, rng, dtype);
    k = random_input({s[0], s[2], s[4], s[5]}, rng, dtype);
    v = random_input({s[0], s[2], s[4], s[6]}, rng, dtype);
  } else {
    q = read_input(o.q, "q", dtype);
    k = read_input(o.k, "k", dtype);
    v = read_input(o.v, "v", dtype);
  }
  const int64_t B = q.shape[0], Hq = q.shape[1], Lq = q.shape[2], D = q.shape[3];
  const int64_t Hkv = k.shape[1], Lkv = k.shape[2], Dv = v.shape[3];
  const std::vector<int64_t> out_shape{B, Hq, Lq, Dv};
  const int64_t out_numel = B * Hq * Lq * Dv;

  // Captures: host arrays in the declared dtype, and their device copies.
  std::vector<npy::Array> host_caps;
  std::vector<flexc::DeviceBuffer> dev_caps;
  host_caps.reserve(o.captures.size());
  AttentionOptions opts;
  ReferenceProblem ref;
  BlockMaskOptions bmo;
  for (const auto& [name, file] : captures) {
    auto spec = std::find_if(variant.captures().begin(), variant.captures().end(),
                             [&](const CaptureSpec& c) { return c.name == name; });
    if (spec == variant.captures().end())
      throw Error(fmt::format("--capture {}: '{}' declares no such capture", name, variant.name()));
    host_caps.push_back(npy::read(file).as(parse_dtype(spec->dtype),
                                           fmt::format("--capture {}={}", name, file)));
    const npy::Array& a = host_caps.back();
    dev_caps.push_back(upload(a.bytes.data(), a.bytes.size()));
    opts.captures[name] = TensorView{dev_caps.back().get(), a.dtype, a.shape, {}};
    ref.captures[name] = a.view();
    bmo.captures[name] = CaptureData{a.bytes.data(), dev_caps.back().get(), a.shape, {}};
  }
  for (const ModDeps& deps : {variant.score_deps(), variant.mask_deps()})
    for (const std::string& c : deps.captures)
      if (!captures.contains(c))
        throw Error(fmt::format("'{}' reads capture '{}': pass --capture {}=FILE.npy",
                                variant.name(), c, c));
  for (const auto& [name, text] : params)
    opts.params[name] = parse_number(text, "--param " + name);
  bmo.params = opts.params;
  opts.scale = o.scale;
  opts.kernel = kernel;

  flexc::DeviceBuffer q_dev = upload(q.bits.data(), q.bits.size() * 2);
  flexc::DeviceBuffer k_dev = upload(k.bits.data(), k.bits.size() * 2);
  flexc::DeviceBuffer v_dev = upload(v.bits.data(), v.bits.size() * 2);
  flexc::DeviceBuffer out_dev(std::max<size_t>(out_numel * 2, 16));
  flexc::DeviceBuffer lse_dev(std::max<size_t>(B * Hq * Lq * 4, 16));
  out_dev.fill(0xff);  // NaN: an element the kernel missed cannot pass for a result
  lse_dev.fill(0xff);
  const auto view = [&](const flexc::DeviceBuffer& b, const std::vector<int64_t>& shape) {
    return TensorView{b.get(), dtype, shape, {}};
  };
  opts.lse = TensorView{lse_dev.get(), DType::F32, {B, Hq, Lq}, {}};

  const auto t0 = std::chrono::steady_clock::now();
  std::optional<BlockMask> bm;
  if (!variant.mask_always_true() && !o.dense) {
    bm = create_block_mask(variant, B, Hq, Lq, Lkv, bmo);
    opts.block_mask = &*bm;
  }
  attention(view(q_dev, q.shape), view(k_dev, k.shape), view(v_dev, v.shape),
            view(out_dev, out_shape), variant, opts);
  flexc::synchronize_device();
  const double first_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  flexc::EventTimer timer;  // a second, warm launch: the kernel's own time
  timer.start(opts.stream);
  attention(view(q_dev, q.shape), view(k_dev, k.shape), view(v_dev, v.shape),
            view(out_dev, out_shape), variant, opts);
  timer.stop(opts.stream);
  const double kernel_ms = timer.elapsed_ms();

  std::vector<uint16_t> out_bits = out_dev.to_vector<uint16_t>(out_numel);
  std::vector<float> out(out_bits.size());
  for (size_t i = 0; i < out.size(); ++i)
    out[i] = dtype == DType::BF16 ? bf16_to_float(out_bits[i]) : fp16_to_float(out_bits[i]);
  const std::vector<float> lse = lse_dev.to_vector<float>(B * Hq * Lq);
  if (!o.out.empty()) npy::write(o.out, npy::from_float(out_shape, out));
  if (!o.lse.empty()) npy::write(o.lse, npy::from_float({B, Hq, Lq}, lse));
  fmt::print("{} {}: B {} Hq {} Hkv {} Q_LEN {} KV_LEN {} D {}{}{}: first call {:.1f} ms (build, "
             "compile or cache), kernel {:.3f} ms\n",
             variant.name(), o.dtype, B, Hq, Hkv, Lq, Lkv, D,
             Dv != D ? fmt::format(" Dv {}", Dv) : "",
             bm ? fmt::format(", BlockMask sparsity {:.1f}%", bm->sparsity()) : "", first_ms,
             kernel_ms);
  ref.q = q.values, ref.k = k.values, ref.v = v.values;
  ref.batch = B, ref.q_heads = Hq, ref.kv_heads = Hkv, ref.q_len = Lq, ref.kv_len = Lkv;
  ref.head_dim = D, ref.v_head_dim = Dv, ref.scale = o.scale, ref.params = opts.params;
  ref.dtype = dtype;
  if (o.check) {
    const int64_t rows = B * Hq * Lq;
    ReferenceProblem sample = ref;
    if (rows > o.check_rows) {  // a random sample of rows, sorted
      std::uniform_int_distribution<int64_t> pick(0, rows - 1);
      for (int64_t i = 0; i < o.check_rows; ++i) sample.rows.push_back(pick(rng));
      std::sort(sample.rows.begin(), sample.rows.end());
      sample.rows.erase(std::unique(sample.rows.begin(), sample.rows.end()), sample.rows.end());
    }
    const ReferenceResult r = reference_attention(variant, sample);
    std::vector<float> out_rows, lse_rows;
    for (int64_t row : r.rows) {
      out_rows.insert(out_rows.end(), out.begin() + row * Dv, out.begin() + (row + 1) * Dv);
      lse_rows.push_back(lse[row]);
    }
    const Accuracy acc = check_accuracy(r, out_rows, lse_rows);
    fmt::print("check ({} of {} rows, seed {}): {}\n", r.rows.size(), rows, o.seed, acc.summary());
    if (!acc.pass) throw CLI::RuntimeError(1);
  }
  if (!o.backward) return;
  if (Dv != D)
    throw Error(fmt::format("--backward: v's head dim {} differs from q's {}; the backward kernels "
                            "need them equal (the forward above takes any pair)",
                            Dv, D));

  // ---- backward: dout read or generated, gradients into poisoned buffers (capture gradients
  // start at 0: the kernel adds into them)
  const Input dout_in = o.dout.empty() ? random_input(q.shape, rng, dtype) : read_input(o.dout, "dout", dtype);
  if (dout_in.shape != q.shape)
    throw Error(fmt::format("--dout {}: shape [{}] must be q's [{}]", o.dout,
                            fmt::join(dout_in.shape, ", "), fmt::join(q.shape, ", ")));
  flexc::DeviceBuffer dout_dev = upload(dout_in.bits.data(), dout_in.bits.size() * 2);
  flexc::DeviceBuffer dq_dev(std::max<size_t>(q.bits.size() * 2, 16)), dk_dev(std::max<size_t>(k.bits.size() * 2, 16)),
      dv_dev(std::max<size_t>(v.bits.size() * 2, 16));
  for (flexc::DeviceBuffer* g : {&dq_dev, &dk_dev, &dv_dev}) g->fill(0xff);
  AttentionGrads grads{view(dq_dev, q.shape), view(dk_dev, k.shape), view(dv_dev, v.shape), {}};
  std::vector<flexc::DeviceBuffer> dev_grads;
  std::vector<std::string> grad_names;
  dev_grads.reserve(host_caps.size());
  for (const npy::Array& a : host_caps) {
    if (a.dtype != DType::F32) continue;
    const std::string& name = std::next(captures.begin(), &a - host_caps.data())->first;
    dev_grads.emplace_back(std::max<size_t>(a.bytes.size(), 16));
    grads.captures[name] = TensorView{dev_grads.back().get(), DType::F32, a.shape, {}};
    grad_names.push_back(name);
  }
  BackwardOptions bo;
  bo.block_mask = opts.block_mask;
  bo.captures = opts.captures;
  bo.params = opts.params;
  bo.scale = o.scale;
  if (o.atomic_dq || o.deterministic) bo.deterministic = o.deterministic;
  bo.kernel = kernel;
  const TensorView out_view = view(out_dev, out_shape), dout_view = view(dout_dev, out_shape);
  // Twice, each from zeroed capture gradients: the first compiles, the second is timed.
  double bwd_first_ms = 0, bwd_ms = 0;
  for (int pass = 0; pass < 2; ++pass) {
    for (flexc::DeviceBuffer& g : dev_grads) g.fill(0);
    flexc::synchronize_device();
    const auto b0 = std::chrono::steady_clock::now();
    flexc::EventTimer bt;
    bt.start(bo.stream);
    attention_backward(view(q_dev, q.shape), view(k_dev, k.shape), view(v_dev, v.shape), out_view, *opts.lse, dout_view,
                       grads, variant, bo);
    bt.stop(bo.stream);
    flexc::synchronize_device();
    (pass == 0 ? bwd_first_ms : bwd_ms) =
        pass == 0 ? std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - b0).count()
                  : bt.elapsed_ms();
  }
  const std::vector<float> gdq = decode(dq_dev, q.bits.size(), dtype), gdk = decode(dk_dev, k.bits.size(), dtype),
                           gdv = decode(dv_dev, v.bits.size(), dtype);
  std::map<std::string, std::vector<float>, std::less<>> gcap;
  for (size_t i = 0; i < grad_names.size(); ++i)
    gcap[grad_names[i]] = dev_grads[i].to_vector<float>(grads.captures[grad_names[i]].numel());
  if (!o.dq.empty()) npy::write(o.dq, npy::from_float(q.shape, gdq));
  if (!o.dk.empty()) npy::write(o.dk, npy::from_float(k.shape, gdk));
  if (!o.dv.empty()) npy::write(o.dv, npy::from_float(v.shape, gdv));
  for (const auto& [name, file] : capture_grads)
    npy::write(file, npy::from_float(grads.captures[name].shape, gcap[name]));
  fmt::print("backward ({}, kernel {}): first call {:.1f} ms (compile or cache), kernels {:.3f} ms\n",
             o.atomic_dq ? "dq by atomics" : o.deterministic ? "deterministic" : "dq mode auto",
             to_string(kernel), bwd_first_ms,
             bwd_ms);
  if (!o.check) return;

  if (B * Hq * Lq * Lkv > kMaxBackwardCheckElements)
    throw Error(fmt::format("--check --backward computes every gradient on the CPU in float64; "
                            "B * HQ * Q_LEN * KV_LEN = {} is over {}: check smaller sizes",
                            B * Hq * Lq * Lkv, kMaxBackwardCheckElements));
  ReferenceBackwardProblem bp;
  bp.forward = ref;
  bp.dout = dout_in.values, bp.out = out, bp.lse = lse;
  const ReferenceBackward rb = reference_attention_backward(variant, bp);
  std::map<std::string, std::span<const float>, std::less<>> checked;
  for (const auto& [name, g] : rb.captures) checked[name] = gcap.at(name);
  const BackwardAccuracy acc = check_gradients(rb, gdq, gdk, gdv, checked);
  fmt::print("check backward (seed {}): {}\n", o.seed, acc.summary());
  if (!acc.pass) throw CLI::RuntimeError(1);
}

const Register reg("run", [](CLI::App& app) {
  auto o = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand(
      "run",
      "Run a variant's forward (and with --backward, backward) attention on the GPU: q, k, v "
      "from float32 .npy files [B, H, SEQ, D] (or --random), output, LSE and gradients to float32 "
      ".npy files. --check compares with the float64 CPU reference and exits 1 when the "
      "tolerance rule fails.");
  cmd->add_option("config", o->config, "JSON variant config, or @name from the catalogue")
      ->required();
  cmd->add_option("--q", o->q, "queries, float32 .npy [B, HQ, Q_LEN, D]");
  cmd->add_option("--k", o->k, "keys, float32 .npy [B, HKV, KV_LEN, D]");
  cmd->add_option("--v", o->v, "values, float32 .npy [B, HKV, KV_LEN, DV] (DV may differ from D)");
  cmd->add_option("--random", o->random,
                  "generate normal random q, k, v of sizes B,HQ,HKV,Q_LEN,KV_LEN,D[,DV] instead "
                  "(DV: v's and the output's head dim, default D)");
  cmd->add_option("--seed", o->seed, "seed for --random and the --check row sample");
  cmd->add_option("--capture", o->captures,
                  "a captured tensor, NAME=FILE.npy in its declared dtype (float32 converts to "
                  "bf16 / fp16) (repeatable)");
  cmd->add_option("--param", o->params, "a runtime param, NAME=VALUE (repeatable)");
  cmd->add_option("--dtype", o->dtype, "the kernel's input type (default bf16)")
      ->check(CLI::IsMember({"bf16", "fp16"}));
  cmd->add_option("--scale", o->scale, "softmax scale (default 1/sqrt(D))")->check(decimal_number());
  cmd->add_option("--out", o->out, "write the output here, float32 .npy [B, HQ, Q_LEN, DV]");
  cmd->add_option("--lse", o->lse, "write the log-sum-exp here, float32 .npy [B, HQ, Q_LEN]");
  cmd->add_flag("--check", o->check, "compare with the float64 CPU reference; exit 1 on failure");
  cmd->add_option("--check-rows", o->check_rows,
                  "check at most this many rows, a random sample (default 4096)")
      ->check(int_range(1, int64_t{1} << 40));
  cmd->add_option("--kernel", o->kernel,
                  "the forward's and the backward's kernel: auto (Hopper on sm_90 where it "
                  "applies), portable or hopper")
      ->capture_default_str();
  add_precision_option(cmd, o->precision);
  cmd->add_flag("--backward", o->backward,
                "run the backward pass too: gradients of sum(out * dout) (--check checks them)");
  cmd->add_option("--dout", o->dout, "with --backward: dL/dout, float32 .npy [B, HQ, Q_LEN, D] "
                                     "(default: normal random, from --seed)");
  cmd->add_option("--dq", o->dq, "with --backward: write dq here, float32 .npy");
  cmd->add_option("--dk", o->dk, "with --backward: write dk here, float32 .npy");
  cmd->add_option("--dv", o->dv, "with --backward: write dv here, float32 .npy");
  cmd->add_option("--capture-grad", o->capture_grads,
                  "with --backward: write a float32 capture's gradient, NAME=FILE.npy (repeatable)");
  cmd->add_flag("--atomic-dq", o->atomic_dq,
                "with --backward: dq added in float32 inside the main kernel (not bitwise "
                "reproducible; default: the faster mode for the kernel)");
  cmd->add_flag("--deterministic", o->deterministic,
                "with --backward: dq without atomics, bitwise reproducible");
  cmd->add_flag("--dense", o->dense, "no BlockMask: visit every tile, mask_mod on each");
  cmd->callback([o] { run(*o); });
});

}  // namespace
}  // namespace flexc::cli
