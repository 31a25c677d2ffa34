// flexc::linear_attention and flexc::linear_attention_step: validation, configuration and launch
// of templates/gla.cuh.
#include "gla.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "../../templates/gla_params.cuh"
#include "attention_checks.h"
#include "flexc/error.h"
#include "flexc/linear.h"

static_assert(offsetof(FlexcGlaParams, q_stride) == 88 && offsetof(FlexcGlaParams, batch) == 216 &&
              sizeof(FlexcGlaParams) == 240);

namespace flexc {

namespace detail {

jit::KernelSpec gla_spec(const GlaConfig& c) {
  for (int d : {c.dk, c.dv})
    if (d != 64 && d != 128)
      throw Error(fmt::format("linear attention: head dim {} is not supported (64 or 128)", d));
  if (c.dtype != DType::BF16 && c.dtype != DType::F16)
    throw Error(fmt::format("linear attention: dtype {} is not supported (bf16 or fp16)",
                            dtype_name(c.dtype)));
  return {"gla.cuh",
          "flexc_gla_output",
          {{"FLEXC_GLA_DK", std::to_string(c.dk)},
           {"FLEXC_GLA_DV", std::to_string(c.dv)},
           {"FLEXC_BF16", c.dtype == DType::BF16 ? "1" : "0"},
           {"FLEXC_GLA_GATE", std::to_string(static_cast<int>(c.gate))},
           {"FLEXC_GLA_SCALAR", c.scalar_gate || c.gate == GateType::None ? "1" : "0"}},
          c.arch};
}

size_t gla_output_smem(int dk, int dv, bool scalar_gate) {
  // q, k: 64 x dk; v: 64 x dv; the chunk state dk x dv, all 16-bit; gc: 64 floats, or per key
  // dim 64 x (dk + 8) floats, the steep-dim masks of the four diagonal blocks (in 128 bytes) and
  // Khat (64 x dk, 16-bit).
  const size_t tiles = size_t(2 * 64 * dk + 64 * dv + dk * dv) * 2;
  return tiles + (scalar_gate ? 64 * 4 : size_t(64 * (dk + 8)) * 4 + 128 + size_t(64 * dk) * 2);
}

size_t gla_states_smem() {
  // Stages of Khat (64 x 64), V (64 x kFlexcGlaStateCols), 16-bit, and a 64-float decay slice.
  return kFlexcGlaStatesStages * ((64 * 64 + 64 * kFlexcGlaStateCols) * 2 + 64 * 4);
}

const Variant& gla_variant() {
  static const Variant v = Variant::from_strings("score", "true", {}, {}, "linear");
  return v;
}

}  // namespace detail

namespace {

constexpr int64_t kMaxInt = std::numeric_limits<int32_t>::max();

struct Shapes {
  int64_t B = 0, H = 0, Hk = 0, T = 0, DK = 0, DV = 0;
};

// q, k, v, out: ranks, dtypes, layouts and sizes against each other.
Shapes check_qkvo(std::string_view what, const TensorView& q, const TensorView& k,
                  const TensorView& v, const TensorView& out) {
  const auto fail = [&](const std::string& m) { throw Error(fmt::format("{}: {}", what, m)); };
  for (auto [name, t] : {std::pair{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}})
    detail::check_qkv(what, name, *t, q.dtype);
  Shapes s{q.shape[0], q.shape[1], k.shape[1], q.shape[2], q.shape[3], v.shape[3]};
  if (k.shape[0] != s.B || k.shape[2] != s.T || k.shape[3] != s.DK)
    fail(fmt::format("k must be [B, Hk, T, DK] = [{}, *, {}, {}] as q; got {}", s.B, s.T, s.DK,
                     k.describe()));
  if (v.shape[0] != s.B || v.shape[1] != s.Hk || v.shape[2] != s.T)
    fail(fmt::format("v must be [B, Hk, T, DV] = [{}, {}, {}, *] as k; got {}", s.B, s.Hk, s.T,
                     v.describe()));
  if (out.shape != std::vector<int64_t>{s.B, s.H, s.T, s.DV})
    fail(fmt::format("out must be [B, H, T, DV] = [{}, {}, {}, {}]; got {}", s.B, s.H, s.T, s.DV,
                     out.describe()));
  if (s.Hk < 1 || s.H % s.Hk != 0)
    fail(fmt::format("k's and v's head count {} must divide q's {}", s.Hk, s.H));
  for (auto [name, d] : {std::pair{"q's head dim DK", s.DK}, {"v's head dim DV", s.DV}})
    if (d != 64 && d != 128) fail(fmt::format("{} is {}; 64 or 128 expected", name, d));
  if (s.B > 65535 || s.H > 65535)
    fail(fmt::format("B = {} and H = {} must each be at most 65535", s.B, s.H));
  if (s.T > kMaxInt - 64) fail(fmt::format("T = {} is too long (at most 2^31 - 65)", s.T));
  if (detail::self_overlaps(out))
    fail(fmt::format("out has elements that share memory; {}", out.describe()));
  for (auto [name, in] : {std::pair{"q", &q}, {"k", &k}, {"v", &v}})
    if (detail::overlap(out, *in)) fail(fmt::format("out overlaps {}", name));
  return s;
}

struct Gates {
  detail::GateType type = detail::GateType::None;
  bool scalar = true;          // one per step (key-dim stride 0), or none
  long long strides[4] = {};  // batch, head, token, key dim
};

// The gates: [B, H, T, DK] or [B, H, T], float32 / bf16 / fp16, any non-negative strides.
Gates check_gates(std::string_view what, const std::optional<TensorView>& g, const Shapes& s) {
  const auto fail = [&](const std::string& m) { throw Error(fmt::format("{}: {}", what, m)); };
  Gates out;
  if (!g) return out;
  long long(&strides)[4] = out.strides;
  const TensorView& t = *g;
  const bool per_dim = t.rank() == 4;
  if ((t.rank() != 3 && t.rank() != 4) || t.shape[0] != s.B || t.shape[1] != s.H ||
      t.shape[2] != s.T || (per_dim && t.shape[3] != s.DK))
    fail(fmt::format("g must be [B, H, T, DK] = [{}, {}, {}, {}] or [B, H, T]; got {}", s.B, s.H,
                     s.T, s.DK, t.describe()));
  if (!t.strides.empty() && t.strides.size() != t.rank())
    fail(fmt::format("g: {} strides for rank {}", t.strides.size(), t.rank()));
  switch (t.dtype) {
    case DType::F32: out.type = detail::GateType::F32; break;
    case DType::BF16: out.type = detail::GateType::BF16; break;
    case DType::F16: out.type = detail::GateType::F16; break;
    default: fail(fmt::format("g is {}; float32, bf16 or fp16 expected", dtype_name(t.dtype)));
  }
  for (size_t i = 0; i < t.rank(); ++i) {
    if (t.stride(i) < 0) fail(fmt::format("g: negative stride ({})", t.describe()));
    strides[i] = t.stride(i);
  }
  if (!per_dim) strides[3] = 0;
  if (t.data == nullptr && !detail::is_empty(t)) fail("g has no data");
  if (reinterpret_cast<uintptr_t>(t.data) % dtype_size(t.dtype) != 0)
    fail(fmt::format("g's data must be aligned to its {}-byte elements", dtype_size(t.dtype)));
  out.scalar = strides[3] == 0;
  return out;
}

// A float32 [B, H, DK, DV] contiguous state.
void check_state(std::string_view what, const char* name, const TensorView& t, const Shapes& s) {
  const std::vector<int64_t> shape{s.B, s.H, s.DK, s.DV};
  bool contiguous = t.strides.empty();
  if (!contiguous && t.strides.size() == 4)
    contiguous = t.strides == std::vector<int64_t>{s.H * s.DK * s.DV, s.DK * s.DV, s.DV, 1};
  if (t.dtype != DType::F32 || t.shape != shape || !contiguous || t.data == nullptr ||
      reinterpret_cast<uintptr_t>(t.data) % 16 != 0)
    throw Error(fmt::format("{}: {} must be contiguous float32 [B, H, DK, DV] = [{}, {}, {}, {}], "
                            "16-byte aligned; got {}",
                            what, name, s.B, s.H, s.DK, s.DV, t.describe()));
}

double check_scale(std::string_view what, const std::optional<double>& scale, int64_t dk) {
  const double v = scale.value_or(1.0 / std::sqrt(static_cast<double>(dk)));
  if (!(std::isfinite(v) && v > 0))
    throw Error(fmt::format("{}: scale must be finite and > 0; got {}", what, v));
  return v;
}

FlexcGlaParams make_params(const TensorView& q, const TensorView& k, const TensorView& v,
                           const TensorView& out, const std::optional<TensorView>& g,
                           const Gates& gates, const Shapes& s, double scale) {
  FlexcGlaParams p{};
  p.q = q.data, p.k = k.data, p.v = v.data, p.o = out.data;
  p.g = g ? g->data : nullptr;
  for (int i = 0; i < 3; ++i) {
    p.q_stride[i] = q.stride(i), p.k_stride[i] = k.stride(i), p.v_stride[i] = v.stride(i);
    p.o_stride[i] = out.stride(i);
  }
  for (int i = 0; i < 4; ++i) p.g_stride[i] = gates.strides[i];
  p.batch = int(s.B), p.heads = int(s.H), p.k_heads = int(s.Hk);
  p.seq_len = int(s.T), p.chunks = int((s.T + 63) / 64);
  p.scale = static_cast<float>(scale);
  return p;
}

const jit::Kernel& kernel_for(const TensorView& q, const Shapes& s, const Gates& gates,
                              const char* entry, std::string_view what) {
  const detail::DeviceLimits dev = detail::device_limits();
  if (dev.major < 8)
    throw Error(fmt::format("{}: needs a GPU of compute capability 8.0 or newer; this one is "
                            "{}.{}",
                            what, dev.major, dev.minor));
  jit::KernelSpec spec =
      detail::gla_spec({"", q.dtype, int(s.DK), int(s.DV), gates.type, gates.scalar});
  spec.entry = entry;
  return jit::get_kernel(detail::gla_variant(), spec);
}

}  // namespace

void linear_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                      const TensorView& out, const LinearOptions& opts) {
  constexpr std::string_view what = "flexc::linear_attention";
  const Shapes s = check_qkvo(what, q, k, v, out);
  const Gates gates = check_gates(what, opts.g, s);
  if (opts.initial_state) check_state(what, "initial_state", *opts.initial_state, s);
  if (opts.final_state) {
    check_state(what, "final_state", *opts.final_state, s);
    for (auto [name, t] : {std::pair{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}})
      if (detail::overlap(*opts.final_state, *t))
        throw Error(fmt::format("{}: final_state overlaps {}", what, name));
  }
  const double scale = check_scale(what, opts.scale, s.DK);
  if (s.B == 0 || s.H == 0) return;

  FlexcGlaParams p = make_params(q, k, v, out, opts.g, gates, s, scale);
  p.h0 = opts.initial_state ? static_cast<const float*>(opts.initial_state->data) : nullptr;
  p.ht = opts.final_state ? static_cast<float*>(opts.final_state->data) : nullptr;
  if (s.T == 0 && !p.ht) return;
  const jit::Kernel& prepare = kernel_for(q, s, gates, "flexc_gla_prepare", what);
  const jit::Kernel& states = kernel_for(q, s, gates, "flexc_gla_states", what);
  const jit::Kernel& output = kernel_for(q, s, gates, "flexc_gla_output", what);
  const size_t smem = detail::gla_output_smem(int(s.DK), int(s.DV), gates.scalar);
  if (smem > detail::device_limits().max_smem)
    throw Error(fmt::format("{}: head dims {} / {} need {} KiB of shared memory per block; this "
                            "GPU allows {} KiB",
                            what, s.DK, s.DV, smem / 1024, detail::device_limits().max_smem / 1024));

  // Workspace: the chunk states, Khat, the decays and gc (each 256-byte aligned).
  const size_t heads = size_t(s.B * s.H), chunks = size_t(p.chunks);
  const auto aligned = [](size_t bytes) { return (bytes + 255) / 256 * 256; };
  const size_t states_bytes = aligned(heads * chunks * size_t(s.DK * s.DV) * 2);
  const size_t khat_bytes = aligned(heads * chunks * 64 * size_t(s.DK) * 2);
  const size_t decay_bytes = aligned(heads * chunks * size_t(s.DK) * 4);
  const size_t gcum_bytes = aligned(heads * chunks * 64 * size_t(gates.scalar ? 1 : s.DK) * 4);
  detail::StreamBuffer work(
      std::max<size_t>(states_bytes + khat_bytes + decay_bytes + gcum_bytes, 256), opts.stream,
      opts.workspace, what);
  char* w = static_cast<char*>(work.get());
  p.states = w, p.khat = w + states_bytes;
  p.decay = reinterpret_cast<float*>(w + states_bytes + khat_bytes);
  p.gcum = reinterpret_cast<float*>(w + states_bytes + khat_bytes + decay_bytes);
  void* args[] = {&p};
  if (p.chunks > 0)
    prepare.launch(unsigned(p.chunks), unsigned(s.H), unsigned(s.B), unsigned(4 * s.DK), 0,
                   opts.stream, args);
  states.launch(unsigned(s.DK / 64 * (s.DV / kFlexcGlaStateCols)), unsigned(s.H),
                unsigned(s.B), 128, detail::gla_states_smem(), opts.stream, args);
  if (p.chunks > 0)
    output.launch(unsigned(p.chunks), unsigned(s.H), unsigned(s.B), 256, smem, opts.stream, args);
}

void linear_attention_step(const TensorView& q, const TensorView& k, const TensorView& v,
                           const TensorView& state, const TensorView& out,
                           const LinearOptions& opts) {
  constexpr std::string_view what = "flexc::linear_attention_step";
  const Shapes s = check_qkvo(what, q, k, v, out);
  const Gates gates = check_gates(what, opts.g, s);
  if (opts.initial_state || opts.final_state)
    throw Error(fmt::format("{}: the state is the `state` argument, updated in place; "
                            "initial_state and final_state must be unset",
                            what));
  check_state(what, "state", state, s);
  for (auto [name, t] : {std::pair{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}})
    if (detail::overlap(state, *t)) throw Error(fmt::format("{}: state overlaps {}", what, name));
  const double scale = check_scale(what, opts.scale, s.DK);
  if (s.B == 0 || s.H == 0 || s.T == 0) return;

  FlexcGlaParams p = make_params(q, k, v, out, opts.g, gates, s, scale);
  p.ht = static_cast<float*>(state.data);
  const jit::Kernel& step = kernel_for(q, s, gates, "flexc_gla_step", what);
  void* args[] = {&p};
  step.launch(unsigned(s.DV / 64), unsigned(s.H), unsigned(s.B), 256, 0, opts.stream, args);
}

}  // namespace flexc
