// `flexc run` for linear-attention configs (run_linear.h).
#include "cli/run_linear.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <random>
#include <sstream>
#include <vector>

#include <CLI/CLI.hpp>

#include "cli/args.h"
#include "cli/inputs.h"
#include "flexc/device.h"
#include "flexc/error.h"
#include "flexc/linear.h"
#include "flexc/npy.h"

namespace flexc::cli {
namespace {

// --check computes the recurrence (and its gradients) on the CPU in float64: B * H * T * DK * DV
// multiply-adds, several times over. Past this it would take minutes.
constexpr int64_t kMaxCheckWork = int64_t{1} << 32;

// --random B,H,HK,T,DK[,DV].
std::vector<int64_t> parse_sizes(const std::string& s) {
  std::vector<int64_t> out;
  std::stringstream ss(s);
  const char* names[] = {"B", "H", "HK", "T", "DK", "DV"};
  for (std::string item; std::getline(ss, item, ',');) {
    if (out.size() == 6) break;
    out.push_back(parse_int(item, fmt::format("--random {}", names[out.size()]), 1,
                            out.size() < 3 ? 65535 : out.size() == 3 ? kMaxInt32 : 128));
  }
  if (out.size() < 5 || std::count(s.begin(), s.end(), ',') + 1 != static_cast<long>(out.size()))
    throw Error(fmt::format("--random '{}': expected B,H,HK,T,DK[,DV] for a linear-attention "
                            "config",
                            printable(s)));
  if (out.size() == 5) out.push_back(out[4]);
  checked_bytes({out[0], out[1], out[3], std::max(out[4], out[5])}, 6, "--random (q, out)");
  return out;
}

// Log gates as GLA draws them: logsigmoid(x) / 16, x normal.
std::vector<float> random_gates(size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> g(n);
  for (float& x : g) x = -std::log1p(std::exp(-nd(rng))) / 16.f;
  return g;
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

void run_linear(const LinearRunArgs& a) {
  const LinearVariant lv = LinearVariant::load(a.config);
  const DType dtype = parse_dtype(a.dtype);
  if (!a.backward)
    for (const auto& [flag, value] :
         {std::pair{"--dout", &a.dout}, {"--dq", &a.dq}, {"--dk", &a.dk}, {"--dv", &a.dv}})
      if (!value->empty()) throw Error(fmt::format("{} needs --backward", flag));
  const LinearGate gate = lv.gate();
  if (!a.g.empty() && gate != LinearGate::PerDim && gate != LinearGate::PerStep)
    throw Error(fmt::format("--g: '{}' has a {} gate, which takes no gate tensor", lv.name(),
                            to_string(gate)));
  std::vector<int64_t> sizes;
  if (!a.random.empty()) sizes = parse_sizes(a.random);
  if (!flexc::gpu_available()) throw Error("flexc run needs a GPU (no CUDA driver or device found)");

  std::mt19937_64 rng(a.seed);
  const std::vector<int64_t>& s = sizes;
  const std::vector<std::vector<int64_t>> shapes =
      sizes.empty() ? std::vector<std::vector<int64_t>>{}
                    : std::vector<std::vector<int64_t>>{{s[0], s[1], s[3], s[4]},
                                                        {s[0], s[2], s[3], s[4]},
                                                        {s[0], s[2], s[3], s[5]}};
  const auto [q, k, v] =
      qkv_inputs(a.random, shapes, a.q, a.k, a.v, rng, dtype, "--random B,H,HK,T,DK[,DV]");
  const int64_t B = q.shape[0], H = q.shape[1], T = q.shape[2], DK = q.shape[3];
  const int64_t Hk = k.shape[1], DV = v.shape[3];

  // The gates: float32 on the host in the reference's layout, and the view the kernels read.
  std::vector<float> g_host, g_dev_values;
  std::optional<TensorView> g_view;
  flexc::DeviceBuffer g_dev;
  std::vector<int64_t> g_shape;
  if (gate == LinearGate::PerDim || gate == LinearGate::PerStep) {
    g_shape = {B, H, T};
    if (gate == LinearGate::PerDim) g_shape.push_back(DK);
    if (a.g.empty()) {
      int64_t n = 1;
      for (int64_t d : g_shape) n *= d;
      g_host = random_gates(size_t(n), rng);
    } else {
      const npy::Array arr = npy::read(a.g);
      if (arr.shape != g_shape)
        throw Error(fmt::format("--g {}: shape [{}]; this {} gate needs [{}]", a.g,
                                fmt::join(arr.shape, ", "), to_string(gate),
                                fmt::join(g_shape, ", ")));
      g_host = arr.as(DType::F32, "--g " + a.g).to_float();
    }
    g_dev_values = g_host;
  } else if (gate == LinearGate::PerHead) {
    g_dev_values = lv.head_log_decays(H);  // viewed as [B, H, T] with strides {0, 1, 0}
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h) g_host.insert(g_host.end(), size_t(T), g_dev_values[h]);
    g_shape = {B, H, T};
  }
  if (!g_dev_values.empty()) {
    g_dev = upload(g_dev_values.data(), g_dev_values.size() * 4);
    g_view = gate == LinearGate::PerHead
                 ? TensorView{g_dev.get(), DType::F32, g_shape, {0, 1, 0}}
                 : TensorView{g_dev.get(), DType::F32, g_shape, {}};
  }

  flexc::DeviceBuffer q_dev = upload(q.bits.data(), q.bits.size() * 2),
                      k_dev = upload(k.bits.data(), k.bits.size() * 2),
                      v_dev = upload(v.bits.data(), v.bits.size() * 2);
  const std::vector<int64_t> out_shape{B, H, T, DV}, state_shape{B, H, DK, DV};
  const int64_t out_n = B * H * T * DV, state_n = B * H * DK * DV;
  flexc::DeviceBuffer out_dev(std::max<size_t>(size_t(out_n) * 2, 16)),
      state_dev(std::max<size_t>(size_t(state_n) * 4, 16));
  out_dev.fill(0xff);  // NaN: an element the kernels missed cannot pass for a result
  state_dev.fill(0xff);
  const auto view = [&](const flexc::DeviceBuffer& b, const std::vector<int64_t>& shape) {
    return TensorView{b.get(), dtype, shape, {}};
  };
  LinearOptions opts;
  opts.g = g_view;
  opts.final_state = TensorView{state_dev.get(), DType::F32, state_shape, {}};
  opts.scale = a.scale ? a.scale : lv.scale();
  opts.feature_map = lv.feature_map();
  const auto forward = [&] {
    linear_attention(view(q_dev, q.shape), view(k_dev, k.shape), view(v_dev, v.shape),
                     view(out_dev, out_shape), opts);
  };
  auto t0 = std::chrono::steady_clock::now();
  forward();
  flexc::synchronize_device();
  const double first_ms = ms_since(t0);
  flexc::EventTimer timer;  // a second, warm call: the kernels' own time
  timer.start();
  forward();
  timer.stop();
  const double kernel_ms = timer.elapsed_ms();
  const std::vector<float> out = download_16bit(out_dev, size_t(out_n), dtype);
  const std::vector<float> state = state_dev.to_vector<float>(size_t(state_n));
  if (!a.out.empty()) npy::write(a.out, npy::from_float(out_shape, out));
  fmt::print("{} {}: B {} H {} Hk {} T {} DK {} DV {}, gate {}: first call {:.1f} ms (compile or "
             "cache), kernels {:.3f} ms\n",
             lv.name(), a.dtype, B, H, Hk, T, DK, DV, to_string(gate), first_ms, kernel_ms);

  LinearReferenceProblem ref;
  ref.q = q.values, ref.k = k.values, ref.v = v.values, ref.g = g_host;
  ref.batch = B, ref.heads = H, ref.k_heads = Hk, ref.seq_len = T, ref.dk = DK, ref.dv = DV;
  ref.per_dim_gates = gate == LinearGate::PerDim;
  ref.scale = opts.scale;
  ref.dtype = dtype;
  ref.feature_map = lv.feature_map();
  if (a.check) {
    if (B * H * T * DK * DV > kMaxCheckWork)
      throw Error(fmt::format("--check runs the float64 recurrence on the CPU; B * H * T * DK * DV "
                              "= {} is over {}: check smaller sizes",
                              B * H * T * DK * DV, kMaxCheckWork));
    const LinearAccuracy acc =
        check_linear_accuracy(reference_linear_attention(ref), out, state);
    fmt::print("check (seed {}): {}\n", a.seed, acc.summary());
    if (!acc.pass) throw CLI::RuntimeError(1);
  }
  if (!a.backward) return;

  // ---- backward: dout read or drawn, gradients into poisoned buffers.
  const Input dout = a.dout.empty() ? random_input(out_shape, rng, dtype)
                                    : read_input(a.dout, "dout", dtype, "[B, H, T, DV]", "");
  if (dout.shape != out_shape)
    throw Error(fmt::format("--dout {}: shape [{}] must be the output's [{}]", a.dout,
                            fmt::join(dout.shape, ", "), fmt::join(out_shape, ", ")));
  flexc::DeviceBuffer dout_dev = upload(dout.bits.data(), dout.bits.size() * 2);
  flexc::DeviceBuffer dq_dev(std::max<size_t>(q.bits.size() * 2, 16)),
      dk_dev(std::max<size_t>(k.bits.size() * 2, 16)),
      dv_dev(std::max<size_t>(v.bits.size() * 2, 16)),
      dg_dev(std::max<size_t>(g_host.size() * 4, 16));
  for (flexc::DeviceBuffer* b : {&dq_dev, &dk_dev, &dv_dev, &dg_dev}) b->fill(0xff);
  LinearGradients grads{view(dq_dev, q.shape), view(dk_dev, k.shape), view(dv_dev, v.shape), {},
                        {}};
  if (g_view) grads.dg = TensorView{dg_dev.get(), DType::F32, g_shape, {}};
  LinearBackwardOptions bo;
  bo.g = g_view;
  bo.scale = opts.scale;
  bo.feature_map = lv.feature_map();
  const auto backward = [&] {
    linear_attention_backward(view(q_dev, q.shape), view(k_dev, k.shape), view(v_dev, v.shape),
                              view(dout_dev, out_shape), grads, bo);
  };
  t0 = std::chrono::steady_clock::now();
  backward();
  flexc::synchronize_device();
  const double bwd_first_ms = ms_since(t0);
  timer.start();
  backward();
  timer.stop();
  const double bwd_ms = timer.elapsed_ms();
  const std::vector<float> dq = download_16bit(dq_dev, q.bits.size(), dtype),
                           dk = download_16bit(dk_dev, k.bits.size(), dtype),
                           dv = download_16bit(dv_dev, v.bits.size(), dtype),
                           dg = g_view ? dg_dev.to_vector<float>(g_host.size())
                                       : std::vector<float>{};
  if (!a.dq.empty()) npy::write(a.dq, npy::from_float(q.shape, dq));
  if (!a.dk.empty()) npy::write(a.dk, npy::from_float(k.shape, dk));
  if (!a.dv.empty()) npy::write(a.dv, npy::from_float(v.shape, dv));
  fmt::print("backward: first call {:.1f} ms (compile or cache), kernels {:.3f} ms\n",
             bwd_first_ms, bwd_ms);
  if (!a.check) return;
  const LinearReferenceGradients rg =
      reference_linear_attention_backward(ref, dout.values, std::vector<float>{});
  const BackwardAccuracy acc = check_linear_gradients(rg, dq, dk, dv, dg, {});
  fmt::print("check backward (seed {}): {}\n", a.seed, acc.summary());
  if (!acc.pass) throw CLI::RuntimeError(1);
}

}  // namespace flexc::cli
