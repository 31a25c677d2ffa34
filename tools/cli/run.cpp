// `flexc run CONFIG.json --q q.npy --k k.npy --v v.npy [--capture NAME=FILE.npy] [--param
// NAME=VALUE] [--dtype bf16|fp16] [--out o.npy] [--lse lse.npy] [--check] [--backward [--dout
// dout.npy] [--dq dq.npy] [--dk dk.npy] [--dv dv.npy] [--capture-grad NAME=FILE.npy]]`: forward
// (and backward) attention of a variant on the GPU, end to end, from and to .npy files (or
// --random inputs); --check compares with the float64 CPU reference under the tolerance rule
// (docs/attention.md) and exits 1 on failure. With --kv-lens it runs flexc::decode instead: K / V
// are the cache (KV_LEN its capacity), contiguous or, with --page-size, paged through a shuffled
// page table. A linear-attention config runs flexc::linear_attention (run_linear.cpp).
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
#include "cli/inputs.h"
#include "cli/run_linear.h"
#include "cli/run_ring.h"
#include "flexc/attention.h"
#include "flexc/blockmask.h"
#include "flexc/decode.h"
#include "flexc/device.h"
#include "flexc/error.h"
#include "flexc/linear.h"
#include "flexc/npy.h"
#include "flexc/reference.h"
#include "flexc/variant.h"

namespace flexc::cli {
namespace {

struct Options {
  std::string config, q, k, v, out, lse, random, dtype = "bf16", precision;
  std::string g;  // linear-attention configs: the log gates
  std::vector<std::string> captures, params;  // NAME=VALUE
  bool backward = false, atomic_dq = false, deterministic = false;
  std::string dout, dq, dk, dv;
  std::vector<std::string> capture_grads;  // NAME=FILE
  std::optional<double> scale;
  uint64_t seed = std::random_device{}();
  bool check = false, dense = false;
  int64_t check_rows = 4096;
  std::string kernel = "auto";
  std::string kv_lens, q_offsets;  // decode: comma lists, one value or one per batch
  int64_t page_size = 0, splits = 0;
  int64_t kv_offset = 0;  // a block of a longer sequence, with --seq-lens Q,KV
  std::string seq_lens;
  int ranks = 0;  // ring attention over this many GPUs
  std::string sharding = "zigzag";
  int64_t send_cost_bytes = RingPlanOptions{}.send_cost_bytes;
};

// A --kv-lens / --q-offsets list: one value for every batch, or one per batch.
std::vector<int64_t> parse_list(const std::string& text, const char* option, int64_t lo) {
  std::vector<int64_t> out;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');)
    out.push_back(parse_int(item, fmt::format("{} '{}'", option, printable(text)), lo, kMaxInt32));
  if (out.empty() || std::count(text.begin(), text.end(), ',') + 1 != static_cast<long>(out.size()))
    throw Error(fmt::format("{} '{}': expected one integer or one per batch, comma-separated",
                            option, printable(text)));
  return out;
}
std::vector<int64_t> per_batch(std::vector<int64_t> values, int64_t B, const char* option) {
  if (values.size() == 1) values.assign(B, values[0]);
  if (static_cast<int64_t>(values.size()) != B)
    throw Error(fmt::format("{}: {} values for B = {} (give one, or one per batch)", option,
                            values.size(), B));
  return values;
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

// --check --backward computes every gradient in float64 on the CPU: B * HQ * Q_LEN * KV_LEN
// score elements, each of D multiply-adds several times over. Past this it would take minutes.
constexpr int64_t kMaxBackwardCheckElements = int64_t{1} << 26;

// --check: a random sample of at most --check-rows rows against the float64 reference; exits 1
// when the tolerance rule fails.
void check_rows(const Options& o, const Variant& variant, const ReferenceProblem& ref,
                const std::vector<float>& out, const std::vector<float>& lse,
                std::mt19937_64& rng) {
  const int64_t rows = ref.batch * ref.q_heads * ref.q_len, Dv = ref.v_head_dim;
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

// --check --backward: every gradient against the float64 reference's, from the kernels' out and
// LSE; exits 1 when the tolerance rule fails.
void check_backward(const Options& o, const Variant& variant, const ReferenceProblem& ref,
                    const std::vector<float>& dout, const std::vector<float>& out,
                    const std::vector<float>& lse, const std::vector<float>& dq,
                    const std::vector<float>& dk, const std::vector<float>& dv,
                    const std::map<std::string, std::vector<float>, std::less<>>& capture_grads) {
  const int64_t elements = ref.batch * ref.q_heads * ref.q_len * ref.kv_len;
  if (elements > kMaxBackwardCheckElements)
    throw Error(fmt::format("--check --backward computes every gradient on the CPU in float64; "
                            "B * HQ * Q_LEN * KV_LEN = {} is over {}: check smaller sizes",
                            elements, kMaxBackwardCheckElements));
  ReferenceBackwardProblem bp;
  bp.forward = ref;
  bp.dout = dout, bp.out = out, bp.lse = lse;
  const ReferenceBackward rb = reference_attention_backward(variant, bp);
  std::map<std::string, std::span<const float>, std::less<>> checked;
  for (const auto& [name, g] : rb.captures) checked[name] = capture_grads.at(name);
  const BackwardAccuracy acc = check_gradients(rb, dq, dk, dv, checked);
  fmt::print("check backward (seed {}): {}\n", o.seed, acc.summary());
  if (!acc.pass) throw CLI::RuntimeError(1);
}

// The gradients to their --dq / --dk / --dv / --capture-grad files.
void write_grads(const Options& o, const Input& q, const Input& k, const Input& v,
                 const std::vector<float>& dq, const std::vector<float>& dk,
                 const std::vector<float>& dv,
                 const std::map<std::string, std::string>& capture_grad_files,
                 const std::map<std::string, std::vector<int64_t>>& capture_shapes,
                 const std::map<std::string, std::vector<float>, std::less<>>& capture_grads) {
  if (!o.dq.empty()) npy::write(o.dq, npy::from_float(q.shape, dq));
  if (!o.dk.empty()) npy::write(o.dk, npy::from_float(k.shape, dk));
  if (!o.dv.empty()) npy::write(o.dv, npy::from_float(v.shape, dv));
  for (const auto& [name, file] : capture_grad_files)
    npy::write(file, npy::from_float(capture_shapes.at(name), capture_grads.at(name)));
}

// --kv-lens: flexc::decode on K / V as the cache (KV_LEN its capacity), paged with --page-size
// through a shuffled page table, so that no page follows its predecessor in memory.
void run_decode(const Options& o, const Variant& variant, DType dtype, const Input& q,
                const Input& k, const Input& v, const AttentionOptions& opts, ReferenceProblem ref,
                std::mt19937_64& rng) {
  const int64_t B = q.shape[0], Hq = q.shape[1], Lq = q.shape[2], D = q.shape[3];
  const int64_t Hkv = k.shape[1], cap = k.shape[2], Dv = v.shape[3];
  const std::vector<int64_t> lens = per_batch(parse_list(o.kv_lens, "--kv-lens", 0), B, "--kv-lens");
  for (int64_t b = 0; b < B; ++b)
    if (lens[b] > cap)
      throw Error(fmt::format("--kv-lens: {} for batch {} is above the cache's KV_LEN {}", lens[b],
                              b, cap));
  std::vector<int64_t> offsets;
  if (!o.q_offsets.empty())
    offsets = per_batch(parse_list(o.q_offsets, "--q-offsets", 0), B, "--q-offsets");
  const int64_t ps = o.page_size;
  // Pages: a random permutation of B x pages-per-sequence pages.
  const int64_t pages_per_seq = ps ? (cap + ps - 1) / ps : 0, num_pages = B * pages_per_seq;
  std::vector<int32_t> table(num_pages);
  for (int64_t i = 0; i < num_pages; ++i) table[i] = static_cast<int32_t>(i);
  std::shuffle(table.begin(), table.end(), rng);
  // K / V in the cache's layout: contiguous as given, or [NUM_PAGES, Hkv, PAGE_SIZE, D].
  auto layout = [&](const Input& in, int64_t d) {
    if (!ps) return in.bits;
    checked_bytes({num_pages, Hkv, ps, d}, 2, "--page-size (the paged cache)");
    std::vector<uint16_t> paged(num_pages * Hkv * ps * d, 0);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < Hkv; ++h)
        for (int64_t j = 0; j < cap; ++j) {
          const int64_t page = table[b * pages_per_seq + j / ps];
          std::copy_n(in.bits.begin() + ((b * Hkv + h) * cap + j) * d, d,
                      paged.begin() + ((page * Hkv + h) * ps + j % ps) * d);
        }
    return paged;
  };
  const std::vector<uint16_t> k_bits = layout(k, D), v_bits = layout(v, Dv);
  const std::vector<int64_t> k_shape = ps ? std::vector<int64_t>{num_pages, Hkv, ps, D} : k.shape;
  const std::vector<int64_t> v_shape = ps ? std::vector<int64_t>{num_pages, Hkv, ps, Dv} : v.shape;
  std::vector<int32_t> lens32(lens.begin(), lens.end()), offsets32(offsets.begin(), offsets.end());

  flexc::DeviceBuffer q_dev = upload(q.bits.data(), q.bits.size() * 2);
  flexc::DeviceBuffer k_dev = upload(k_bits.data(), k_bits.size() * 2);
  flexc::DeviceBuffer v_dev = upload(v_bits.data(), v_bits.size() * 2);
  flexc::DeviceBuffer lens_dev = upload(lens32.data(), lens32.size() * 4);
  flexc::DeviceBuffer offsets_dev = upload(offsets32.data(), offsets32.size() * 4);
  flexc::DeviceBuffer table_dev = upload(table.data(), table.size() * 4);
  const std::vector<int64_t> out_shape{B, Hq, Lq, Dv};
  flexc::DeviceBuffer out_dev(std::max<size_t>(B * Hq * Lq * Dv * 2, 16));
  flexc::DeviceBuffer lse_dev(std::max<size_t>(B * Hq * Lq * 4, 16));
  out_dev.fill(0xff);  // NaN: an element the kernel missed cannot pass for a result
  lse_dev.fill(0xff);

  KvCache cache;
  cache.k = TensorView{k_dev.get(), dtype, k_shape, {}};
  cache.v = TensorView{v_dev.get(), dtype, v_shape, {}};
  cache.kv_lens = TensorView{lens_dev.get(), DType::I32, {B}, {}};
  if (ps) cache.page_table = TensorView{table_dev.get(), DType::I32, {B, pages_per_seq}, {}};
  if (!offsets.empty()) cache.q_offsets = TensorView{offsets_dev.get(), DType::I32, {B}, {}};
  DecodeOptions dopts;
  dopts.captures = opts.captures;
  dopts.params = opts.params;
  dopts.scale = o.scale;
  dopts.lse = TensorView{lse_dev.get(), DType::F32, {B, Hq, Lq}, {}};
  dopts.num_splits = static_cast<int>(o.splits);
  dopts.check_device_args = true;  // the CLI checks what it was given; then times without it
  const TensorView qv{q_dev.get(), dtype, q.shape, {}}, ov{out_dev.get(), dtype, out_shape, {}};
  const auto t0 = std::chrono::steady_clock::now();
  decode(qv, cache, ov, variant, dopts);
  flexc::synchronize_device();
  const double first_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  dopts.check_device_args = false;
  flexc::EventTimer timer;
  timer.start(dopts.stream);
  decode(qv, cache, ov, variant, dopts);
  timer.stop(dopts.stream);
  const double ms = timer.elapsed_ms();
  int64_t keys = 0;
  for (int64_t len : lens) keys += len;
  const double gb = double(keys) * Hkv * (D + Dv) * 2 / 1e9;
  fmt::print("{} {} decode: B {} Hq {} Hkv {} Q_LEN {} capacity {} D {}{}, {}: first call {:.1f} "
             "ms (compile or cache), kernels {:.3f} ms ({:.0f} GB/s on {:.3f} GB of K and V)\n",
             variant.name(), o.dtype, B, Hq, Hkv, Lq, cap, D, Dv != D ? fmt::format(" Dv {}", Dv) : "",
             ps ? fmt::format("{} pages of {}", num_pages, ps) : std::string("contiguous"), first_ms,
             ms, gb / (ms / 1e3), gb);
  const std::vector<float> out = download_16bit(out_dev, B * Hq * Lq * Dv, dtype);
  const std::vector<float> lse = lse_dev.to_vector<float>(B * Hq * Lq);
  if (!o.out.empty()) npy::write(o.out, npy::from_float(out_shape, out));
  if (!o.lse.empty()) npy::write(o.lse, npy::from_float({B, Hq, Lq}, lse));
  if (!o.check) return;
  ref.kv_lens = lens;
  ref.q_offsets = offsets;
  check_rows(o, variant, ref, out, lse, rng);
}

void run(const Options& o) {
  if (LinearVariant::is_linear_config(o.config)) {
    const std::pair<const char*, bool> attention_only[] = {
        {"--capture", !o.captures.empty()},      {"--param", !o.params.empty()},
        {"--lse", !o.lse.empty()},               {"--capture-grad", !o.capture_grads.empty()},
        {"--kv-lens", !o.kv_lens.empty()},       {"--q-offsets", !o.q_offsets.empty()},
        {"--page-size", o.page_size != 0},       {"--splits", o.splits != 0},
        {"--atomic-dq", o.atomic_dq},            {"--deterministic", o.deterministic},
        {"--dense", o.dense},                    {"--kernel", o.kernel != "auto"},
        {"--precision", !o.precision.empty()}};
    for (const auto& [flag, given] : attention_only)
      if (given)
        throw Error(fmt::format("{}: an option of attention variants; '{}' is a linear-attention "
                                "config",
                                flag, o.config));
    return run_linear({o.config, o.q, o.k, o.v, o.g, o.random, o.dtype, o.out, o.dout, o.dq, o.dk,
                       o.dv, o.scale, o.seed, o.check, o.backward});
  }
  if (!o.g.empty()) throw Error("--g: the gates of a linear-attention config; this is not one");
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
  if (o.kv_lens.empty() && (o.page_size || o.splits))
    throw Error(fmt::format("{} needs --kv-lens (the decode path)",
                            o.page_size ? "--page-size" : "--splits"));
  int64_t q_offset = 0;  // the forward's (chunked prefill): one value
  if (o.kv_lens.empty() && !o.q_offsets.empty()) {
    const std::vector<int64_t> offs = parse_list(o.q_offsets, "--q-offsets", 0);
    if (offs.size() != 1)
      throw Error("--q-offsets: the forward (without --kv-lens) takes one offset for every batch");
    q_offset = offs[0];
  }
  if (!o.kv_lens.empty()) {
    parse_list(o.kv_lens, "--kv-lens", 0);
    if (!o.q_offsets.empty()) parse_list(o.q_offsets, "--q-offsets", 0);
    if (o.backward) throw Error("--backward is not part of the decode path (--kv-lens)");
    if (o.page_size & (o.page_size - 1))
      throw Error(fmt::format("--page-size {} must be a power of two", o.page_size));
  }
  // A block of a longer sequence: keys at --kv-offset, the mods seeing --seq-lens.
  int64_t seq_q_len = 0, seq_kv_len = 0;
  if (!o.seq_lens.empty()) {
    const std::vector<int64_t> lens = parse_list(o.seq_lens, "--seq-lens", 1);
    if (lens.size() != 2) throw Error("--seq-lens: expected Q,KV, the sequence's two lengths");
    seq_q_len = lens[0], seq_kv_len = lens[1];
  }
  if (o.ranks > 0) {
    const std::pair<const char*, bool> not_ring[] = {
        {"--kv-lens", !o.kv_lens.empty()}, {"--q-offsets", !o.q_offsets.empty()},
        {"--kv-offset", o.kv_offset != 0}, {"--seq-lens", !o.seq_lens.empty()},
        {"--dense", o.dense}};
    for (const auto& [flag, given] : not_ring)
      if (given) throw Error(fmt::format("{} is not part of ring attention (--ranks)", flag));
  }
  if (o.sharding != "zigzag" && o.sharding != "contiguous")
    throw Error(fmt::format("--sharding '{}': zigzag or contiguous", o.sharding));
  if (!o.kv_lens.empty() && (o.kv_offset != 0 || !o.seq_lens.empty()))
    throw Error(fmt::format("{} is for a block of a longer sequence, not the decode path "
                            "(--kv-lens)",
                            o.kv_offset != 0 ? "--kv-offset" : "--seq-lens"));
  std::vector<int64_t> sizes;
  if (!o.random.empty()) sizes = parse_sizes(o.random);
  if (!flexc::gpu_available())
    throw Error("flexc run needs a GPU (no CUDA driver or device found)");

  std::mt19937_64 rng(o.seed);
  const std::vector<int64_t>& s = sizes;
  const std::vector<std::vector<int64_t>> shapes =
      sizes.empty() ? std::vector<std::vector<int64_t>>{}
                    : std::vector<std::vector<int64_t>>{{s[0], s[1], s[3], s[5]},
                                                        {s[0], s[2], s[4], s[5]},
                                                        {s[0], s[2], s[4], s[6]}};
  const auto [q, k, v] = qkv_inputs(o.random, shapes, o.q, o.k, o.v, rng, dtype,
                                    "--random B,HQ,HKV,Q_LEN,KV_LEN,D");
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
  opts.q_offset = bmo.q_offset = ref.q_offset = q_offset;
  opts.kv_offset = bmo.kv_offset = ref.kv_offset = o.kv_offset;
  opts.seq_q_len = bmo.seq_q_len = ref.seq_q_len = seq_q_len;
  opts.seq_kv_len = bmo.seq_kv_len = ref.seq_kv_len = seq_kv_len;
  ref.q = q.values, ref.k = k.values, ref.v = v.values;
  ref.batch = B, ref.q_heads = Hq, ref.kv_heads = Hkv, ref.q_len = Lq, ref.kv_len = Lkv;
  ref.head_dim = D, ref.v_head_dim = Dv, ref.scale = o.scale, ref.params = opts.params;
  ref.dtype = dtype;
  if (!o.kv_lens.empty()) return run_decode(o, variant, dtype, q, k, v, opts, ref, rng);
  // The backward's dout, read or generated from a generator of its own (a seed gives the same
  // inputs, dout and check sample with and without --backward, on one GPU or a ring).
  const auto backward_dout = [&] {
    if (Dv != D)
      throw Error(fmt::format("--backward: v's head dim {} differs from q's {}; the backward "
                              "kernels need them equal (the forward takes any pair)",
                              Dv, D));
    std::mt19937_64 dout_rng(o.seed ^ 0x9e3779b97f4a7c15ull);
    Input dout_in = o.dout.empty() ? random_input(q.shape, dout_rng, dtype)
                                   : read_input(o.dout, "dout", dtype, "[B, H, SEQ, D]", "");
    if (dout_in.shape != q.shape)
      throw Error(fmt::format("--dout {}: shape [{}] must be q's [{}]", o.dout,
                              fmt::join(dout_in.shape, ", "), fmt::join(q.shape, ", ")));
    return dout_in;
  };
  std::map<std::string, std::vector<int64_t>> capture_shapes;
  for (size_t i = 0; i < host_caps.size(); ++i)
    capture_shapes[std::next(captures.begin(), long(i))->first] = host_caps[i].shape;
  if (o.ranks > 0) {
    if (Lq != Lkv)
      throw Error(fmt::format("--ranks: ring attention is self-attention over one sequence; Q_LEN "
                              "{} and KV_LEN {} differ",
                              Lq, Lkv));
    RingRunArgs ra;
    ra.variant = &variant;
    ra.shape = {.ranks = o.ranks, .seq_len = Lq, .batch = B, .q_heads = Hq, .kv_heads = Hkv,
                .head_dim = D, .v_head_dim = Dv, .dtype = dtype,
                .sharding = o.sharding == "zigzag" ? Sharding::Zigzag : Sharding::Contiguous};
    ra.params = opts.params;
    ra.send_cost_bytes = o.send_cost_bytes;
    size_t i = 0;
    for (const auto& entry : captures) ra.captures[entry.first] = &host_caps[i++];
    ra.q = &q, ra.k = &k, ra.v = &v;
    ra.scale = o.scale;
    ra.kernel = kernel;
    std::optional<Input> dout_in;
    if (o.backward) {
      dout_in = backward_dout();
      ra.dout = &*dout_in;
      if (o.atomic_dq || o.deterministic) ra.deterministic = o.deterministic;
    }
    const RingRunResult rr = run_ring(ra);
    int64_t computed = 0, skipped = 0, sends = 0, unsent = 0, grad_sends = 0;
    for (const RingStats& st : rr.stats)
      computed += st.blocks_computed, skipped += st.blocks_skipped, sends += st.sends,
          unsent += st.sends_skipped, grad_sends += st.grad_sends;
    fmt::print("{} {}: ring of {} GPUs ({}), B {} Hq {} Hkv {} S {} D {}{}: first call {:.1f} ms "
               "(plan, BlockMasks, compile or cache), forward {:.3f} ms (the slowest rank); "
               "blocks computed {} skipped {}, K/V sends {} skipped {}\n",
               variant.name(), o.dtype, o.ranks, o.sharding, B, Hq, Hkv, Lq, D,
               Dv != D ? fmt::format(" Dv {}", Dv) : "", rr.first_ms, rr.ms, computed, skipped,
               sends, unsent);
    if (o.backward)
      fmt::print("backward: first call {:.1f} ms (compile or cache), {:.3f} ms (the slowest "
                 "rank); dK/dV sends {}\n",
                 rr.bwd_first_ms, rr.bwd_ms, grad_sends);
    if (!o.out.empty()) npy::write(o.out, npy::from_float(out_shape, rr.out));
    if (!o.lse.empty()) npy::write(o.lse, npy::from_float({B, Hq, Lq}, rr.lse));
    if (o.backward)
      write_grads(o, q, k, v, rr.dq, rr.dk, rr.dv, capture_grads, capture_shapes,
                  rr.capture_grads);
    if (!o.check) return;
    check_rows(o, variant, ref, rr.out, rr.lse, rng);
    if (o.backward)
      check_backward(o, variant, ref, dout_in->values, rr.out, rr.lse, rr.dq, rr.dk, rr.dv,
                     rr.capture_grads);
    return;
  }

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

  const std::vector<float> out = download_16bit(out_dev, out_numel, dtype);
  const std::vector<float> lse = lse_dev.to_vector<float>(B * Hq * Lq);
  if (!o.out.empty()) npy::write(o.out, npy::from_float(out_shape, out));
  if (!o.lse.empty()) npy::write(o.lse, npy::from_float({B, Hq, Lq}, lse));
  fmt::print("{} {}: B {} Hq {} Hkv {} Q_LEN {} KV_LEN {} D {}{}{}: first call {:.1f} ms (build, "
             "compile or cache), kernel {:.3f} ms\n",
             variant.name(), o.dtype, B, Hq, Hkv, Lq, Lkv, D,
             Dv != D ? fmt::format(" Dv {}", Dv) : "",
             bm ? fmt::format(", BlockMask sparsity {:.1f}%", bm->sparsity()) : "", first_ms,
             kernel_ms);
  if (o.check) check_rows(o, variant, ref, out, lse, rng);
  if (!o.backward) return;

  // ---- backward: gradients into poisoned buffers (capture gradients start at 0: the kernel
  // adds into them)
  const Input dout_in = backward_dout();
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
  bo.q_offset = opts.q_offset, bo.kv_offset = opts.kv_offset;
  bo.seq_q_len = opts.seq_q_len, bo.seq_kv_len = opts.seq_kv_len;
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
  const std::vector<float> gdq = download_16bit(dq_dev, q.bits.size(), dtype),
                           gdk = download_16bit(dk_dev, k.bits.size(), dtype),
                           gdv = download_16bit(dv_dev, v.bits.size(), dtype);
  std::map<std::string, std::vector<float>, std::less<>> gcap;
  for (size_t i = 0; i < grad_names.size(); ++i)
    gcap[grad_names[i]] = dev_grads[i].to_vector<float>(grads.captures[grad_names[i]].numel());
  write_grads(o, q, k, v, gdq, gdk, gdv, capture_grads, capture_shapes, gcap);
  fmt::print("backward ({}, kernel {}): first call {:.1f} ms (compile or cache), kernels {:.3f} ms\n",
             o.atomic_dq ? "dq by atomics" : o.deterministic ? "deterministic" : "dq mode auto",
             to_string(kernel), bwd_first_ms,
             bwd_ms);
  if (o.check) check_backward(o, variant, ref, dout_in.values, out, lse, gdq, gdk, gdv, gcap);
}

const Register reg("run", [](CLI::App& app) {
  auto o = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand(
      "run",
      "Run a variant's forward (and with --backward, backward) attention on the GPU: q, k, v "
      "from float32 .npy files [B, H, SEQ, D] (or --random), output, LSE and gradients to float32 "
      ".npy files. --check compares with the float64 CPU reference and exits 1 when the "
      "tolerance rule fails. A linear-attention config (\"kind\": \"linear\") runs gated linear "
      "attention: --random B,H,HK,T,DK[,DV], --g for its gates (docs/linear.md).");
  cmd->add_option("config", o->config,
                  "JSON variant config (attention or linear attention), or @name from the "
                  "catalogues")
      ->required();
  cmd->add_option("--q", o->q, "queries, float32 .npy [B, HQ, Q_LEN, D]");
  cmd->add_option("--k", o->k, "keys, float32 .npy [B, HKV, KV_LEN, D]");
  cmd->add_option("--v", o->v, "values, float32 .npy [B, HKV, KV_LEN, DV] (DV may differ from D)");
  cmd->add_option("--random", o->random,
                  "generate normal random q, k, v of sizes B,HQ,HKV,Q_LEN,KV_LEN,D[,DV] instead "
                  "(DV: v's and the output's head dim, default D)");
  cmd->add_option("--seed", o->seed, "seed for --random and the --check row sample");
  cmd->add_option("--g", o->g,
                  "linear-attention configs: log gates, float32 .npy [B, H, T, DK] (per_dim) or "
                  "[B, H, T] (per_step); default: random, logsigmoid(x) / 16");
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
  cmd->add_option("--kv-lens", o->kv_lens,
                  "decode (flexc::decode): K / V are a cache of capacity KV_LEN and sequence b "
                  "holds this many keys; one value, or one per batch (L0,L1,...)");
  cmd->add_option("--q-offsets", o->q_offsets,
                  "the position of each sequence's first query: with --kv-lens one value or one "
                  "per batch (default: kv_len - Q_LEN, the sequence's last tokens); without, one "
                  "value, the position of the first query (chunked prefill; default 0)");
  cmd->add_option("--kv-offset", o->kv_offset,
                  "the position of the first key: a block of a longer sequence (forward and "
                  "backward; default 0)")
      ->check(int_range(0, kMaxInt32));
  cmd->add_option("--seq-lens", o->seq_lens,
                  "Q,KV: the lengths of the sequence the block belongs to, which the mods and the "
                  "captures' Q_LEN / KV_LEN dims see (default: the queries' and the keys' ends)");
  cmd->add_option("--ranks", o->ranks,
                  "ring attention over this many GPUs of this machine (a thread and an NCCL "
                  "communicator each): the sequence of --random B,HQ,HKV,S,S,D split into shards, "
                  "K/V passed around the ring (with --backward, dK / dV too); --check compares "
                  "the gathered output and gradients with the reference on the whole sequence")
      ->check(int_range(1, 1024));
  cmd->add_option("--sharding", o->sharding,
                  "with --ranks: zigzag (rank r holds chunks r and 2N-1-r; the default) or "
                  "contiguous")
      ->capture_default_str();
  cmd->add_option("--send-cost-bytes", o->send_cost_bytes,
                  "with --ranks: what one more NCCL send costs in bytes of link; a shard's rows go "
                  "as a send per (batch, head) where that leaves out more (default 2 MiB; 0: "
                  "whenever fewer rows, which --check then covers)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--page-size", o->page_size,
                  "with --kv-lens: a paged cache of this many keys per page (a power of two), "
                  "through a shuffled page table")
      ->check(int_range(1, int64_t{1} << 20));
  cmd->add_option("--splits", o->splits, "with --kv-lens: force this many KV splits (default: "
                                         "chosen to fill the GPU)")
      ->check(int_range(1, 256));
  cmd->callback([o] { run(*o); });
});

}  // namespace
}  // namespace flexc::cli
