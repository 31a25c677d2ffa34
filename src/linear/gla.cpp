// flexc::linear_attention and flexc::linear_attention_step: validation, configuration and launch
// of templates/linear/gla.cuh.
#include "gla.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "attention/attention_checks.h"
#include "flexc/error.h"
#include "flexc/linear.h"
#include "templates/linear/gla_params.cuh"

static_assert(offsetof(FlexcGlaParams, q_stride) == 96 && offsetof(FlexcGlaParams, batch) == 224 &&
              sizeof(FlexcGlaParams) == 248);
static_assert(offsetof(FlexcGlaBwdParams, dout_stride) == 336 &&
              offsetof(FlexcGlaBwdParams, dg_sum_dims) == 468 && sizeof(FlexcGlaBwdParams) == 472);

namespace flexc {

namespace detail {

jit::KernelSpec gla_spec(const GlaConfig& c) {
  for (int d : {c.dk, c.dv})
    if (d != 64 && d != 128)
      throw Error(fmt::format("linear attention: head dim {} is not supported (64 or 128)", d));
  if (c.dtype != DType::BF16 && c.dtype != DType::F16)
    throw Error(fmt::format("linear attention: dtype {} is not supported (bf16 or fp16)",
                            dtype_name(c.dtype)));
  return {c.backward ? "gla_backward.cuh" : "gla.cuh",
          c.backward ? "flexc_gla_backward" : "flexc_gla_output",
          {{"FLEXC_GLA_DK", std::to_string(c.dk)},
           {"FLEXC_GLA_DV", std::to_string(c.dv)},
           {"FLEXC_BF16", c.dtype == DType::BF16 ? "1" : "0"},
           {"FLEXC_GLA_GATE", std::to_string(static_cast<int>(c.gate))},
           {"FLEXC_GLA_SCALAR", c.scalar_gate || c.gate == GateType::None ? "1" : "0"}},
          c.arch};
}

size_t gla_output_smem(int dk, int dv, bool scalar_gate) {
  // q, k: 64 x dk; the chunk state dk x dv and v 64 x dv (per key dim gates: the state, then in
  // its place Khat 64 x dk and v), all 16-bit; gc: 64 floats, or per key dim 64 x (dk + 8) floats
  // and the steep-dim masks of the four diagonal blocks (in 128 bytes).
  const size_t region =
      scalar_gate ? size_t(dk * dv + 64 * dv) : std::max<size_t>(dk * dv, 64 * (dk + dv));
  const size_t tiles = (size_t(2 * 64 * dk) + region) * 2;
  return tiles + (scalar_gate ? 64 * 4 : size_t(64 * (dk + 8)) * 4 + 128);
}

size_t gla_backward_smem(int dk, int dv, bool scalar_gate) {
  // Four 64 x dk tiles (Qcheck, Kcheck, Qhat, Khat), v and dO (64 x dv), the chunk's state and
  // state gradient (dk x dv), A and dA (64 x 64), all 16-bit; gc (64 floats, or 64 x (dk + 8)),
  // 14 rows of dk column factors, the steep masks (128 bytes) and dk float sums.
  const size_t tiles = size_t(4 * 64 * dk + 2 * 64 * dv + 2 * dk * dv + 2 * 64 * 64) * 2;
  return tiles + (scalar_gate ? 64 : 64 * size_t(dk + 8)) * 4 + 14 * size_t(dk) * 4 + 128 +
         size_t(dk) * 4;
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
                  const TensorView& v, const TensorView& out, const char* out_name = "out") {
  const auto fail = [&](const std::string& m) { throw Error(fmt::format("{}: {}", what, m)); };
  for (auto [name, t] : {std::pair{"q", &q}, {"k", &k}, {"v", &v}, {out_name, &out}})
    detail::check_qkv(what, name, *t, q.dtype);
  Shapes s{q.shape[0], q.shape[1], k.shape[1], q.shape[2], q.shape[3], v.shape[3]};
  if (k.shape[0] != s.B || k.shape[2] != s.T || k.shape[3] != s.DK)
    fail(fmt::format("k must be [B, Hk, T, DK] = [{}, *, {}, {}] as q; got {}", s.B, s.T, s.DK,
                     k.describe()));
  if (v.shape[0] != s.B || v.shape[1] != s.Hk || v.shape[2] != s.T)
    fail(fmt::format("v must be [B, Hk, T, DV] = [{}, {}, {}, *] as k; got {}", s.B, s.Hk, s.T,
                     v.describe()));
  if (out.shape != std::vector<int64_t>{s.B, s.H, s.T, s.DV})
    fail(fmt::format("{} must be [B, H, T, DV] = [{}, {}, {}, {}]; got {}", out_name, s.B, s.H,
                     s.T, s.DV, out.describe()));
  if (s.Hk < 1 || s.H % s.Hk != 0)
    fail(fmt::format("k's and v's head count {} must divide q's {}", s.Hk, s.H));
  for (auto [name, d] : {std::pair{"q's head dim DK", s.DK}, {"v's head dim DV", s.DV}})
    if (d != 64 && d != 128) fail(fmt::format("{} is {}; 64 or 128 expected", name, d));
  if (s.B > 65535 || s.H > 65535)
    fail(fmt::format("B = {} and H = {} must each be at most 65535", s.B, s.H));
  if (s.T > kMaxInt - 64) fail(fmt::format("T = {} is too long (at most 2^31 - 65)", s.T));
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

// The temporaries of one call, carved from one buffer (each piece 256-byte aligned).
struct Workspace {
  std::vector<size_t> sizes;
  size_t add(size_t bytes) {
    sizes.push_back((bytes + 255) / 256 * 256);
    return sizes.size() - 1;
  }
  size_t bytes() const {
    size_t total = 256;
    for (size_t b : sizes) total += b;
    return total;
  }
  char* at(char* base, size_t piece) const {
    for (size_t i = 0; i < piece; ++i) base += sizes[i];
    return base;
  }
  // linear_attention's: the chunk start states, Khat, the decays and gc (pieces 0 to 3).
  void forward(const Shapes& s, const FlexcGlaParams& p, const Gates& gates) {
    const size_t heads = size_t(s.B * s.H), chunks = size_t(p.chunks);
    add(heads * chunks * size_t(s.DK * s.DV) * 2);
    add(heads * chunks * 64 * size_t(s.DK) * 2);
    add(heads * chunks * size_t(s.DK) * 4);
    add(heads * chunks * 64 * size_t(gates.scalar ? 1 : s.DK) * 4);
  }
  void place_forward(char* base, FlexcGlaParams& p) const {
    p.states = at(base, 0), p.khat = at(base, 1);
    p.decay = reinterpret_cast<float*>(at(base, 2));
    p.gcum = reinterpret_cast<float*>(at(base, 3));
  }
};

const jit::Kernel& kernel_for(const TensorView& q, const Shapes& s, const Gates& gates,
                              const char* entry, std::string_view what, bool backward = false) {
  const detail::DeviceLimits dev = detail::device_limits();
  if (dev.major < 8)
    throw Error(fmt::format("{}: needs a GPU of compute capability 8.0 or newer; this one is "
                            "{}.{}",
                            what, dev.major, dev.minor));
  jit::KernelSpec spec =
      detail::gla_spec({"", q.dtype, int(s.DK), int(s.DV), gates.type, gates.scalar, backward});
  spec.entry = entry;
  return jit::get_kernel(detail::gla_variant(), spec);
}

}  // namespace

// Outputs: each with its own memory, apart from every input.
using Named = std::pair<const char*, const TensorView*>;  // null: an unset optional
void check_outputs(std::string_view what, const std::vector<Named>& outputs,
                   const std::vector<Named>& inputs) {
  for (size_t i = 0; i < outputs.size(); ++i) {
    const auto [name, t] = outputs[i];
    if (!t) continue;
    if (detail::self_overlaps(*t))
      throw Error(fmt::format("{}: {} has elements that share memory; {}", what, name,
                              t->describe()));
    for (auto [other, u] : inputs)
      if (u && detail::overlap(*t, *u))
        throw Error(fmt::format("{}: {} overlaps {}", what, name, other));
    for (size_t j = 0; j < i; ++j)
      if (outputs[j].second && detail::overlap(*t, *outputs[j].second))
        throw Error(fmt::format("{}: {} overlaps {}", what, name, outputs[j].first));
  }
}

const TensorView* ptr(const std::optional<TensorView>& t) { return t ? &*t : nullptr; }

// What the kernels read as q and k: with a feature map phi(q) and phi(k), contiguous in one
// stream-ordered buffer (freed after the call's kernels); without one, q and k themselves.
class FeatureInputs {
 public:
  FeatureInputs(const std::optional<FeatureMap>& fm, const TensorView& q, const TensorView& k,
                CUstream_st* stream, const WorkspaceAllocator& alloc, std::string_view what)
      : q_(q), k_(k) {
    const size_t qn = size_t(q.numel()) * 2, kn = size_t(k.numel()) * 2;
    if (!fm || qn + kn == 0) return;
    const size_t k_at = (qn + 255) / 256 * 256;
    buf_.emplace(k_at + kn, stream, alloc, what);
    char* base = static_cast<char*>(buf_->get());
    q_ = TensorView::contiguous(base, q.dtype, q.shape);
    k_ = TensorView::contiguous(base + k_at, k.dtype, k.shape);
    detail::run_feature_map(*fm, q, q_, false, stream);
    detail::run_feature_map(*fm, k, k_, false, stream);
  }
  const TensorView& q() const { return q_; }
  const TensorView& k() const { return k_; }

 private:
  TensorView q_, k_;
  std::optional<detail::StreamBuffer> buf_;
};

void linear_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                      const TensorView& out, const LinearOptions& opts) {
  constexpr std::string_view what = "flexc::linear_attention";
  const Shapes s = check_qkvo(what, q, k, v, out);
  const Gates gates = check_gates(what, opts.g, s);
  if (opts.initial_state) check_state(what, "initial_state", *opts.initial_state, s);
  if (opts.final_state) check_state(what, "final_state", *opts.final_state, s);
  check_outputs(what, {{"out", &out}, {"final_state", ptr(opts.final_state)}},
                {{"q", &q}, {"k", &k}, {"v", &v}});
  const double scale = check_scale(what, opts.scale, s.DK);
  if (s.B == 0 || s.H == 0) return;

  const FeatureInputs in(opts.feature_map, q, k, opts.stream, opts.workspace, what);
  FlexcGlaParams p = make_params(in.q(), in.k(), v, out, opts.g, gates, s, scale);
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

  Workspace layout;
  layout.forward(s, p, gates);
  detail::StreamBuffer work(layout.bytes(), opts.stream, opts.workspace, what);
  layout.place_forward(static_cast<char*>(work.get()), p);
  void* args[] = {&p};
  if (p.chunks > 0)
    prepare.launch(unsigned(p.chunks), unsigned(s.H), unsigned(s.B), unsigned(4 * s.DK), 0,
                   opts.stream, args);
  states.launch(unsigned(s.DK / 64 * (s.DV / kFlexcGlaStateCols)), unsigned(s.H),
                unsigned(s.B), 128, detail::gla_states_smem(), opts.stream, args);
  if (p.chunks > 0)
    output.launch(unsigned(p.chunks), unsigned(s.H), unsigned(s.B), 256, smem, opts.stream, args);
}

void linear_attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                               const TensorView& dout, const LinearGradients& grads,
                               const LinearBackwardOptions& opts) {
  constexpr std::string_view what = "flexc::linear_attention_backward";
  const Shapes s = check_qkvo(what, q, k, v, dout, "dout");
  for (auto [name, grad, like] : {std::tuple{"dq", &grads.dq, &q}, {"dk", &grads.dk, &k},
                                  {"dv", &grads.dv, &v}}) {
    detail::check_qkv(what, name, *grad, q.dtype);
    if (grad->shape != like->shape)
      throw Error(fmt::format("{}: {} must have the shape of {}; got {}", what, name,
                              name + 1, grad->describe()));
  }
  const Gates gates = check_gates(what, opts.g, s);
  if (opts.g.has_value() != grads.dg.has_value())
    throw Error(fmt::format("{}: grads.dg must be set exactly when opts.g is ({})", what,
                            opts.g ? "g is set, dg is not" : "dg is set without g"));
  int dg_type = 0;
  long long dg_strides[4] = {};
  if (grads.dg) {
    const TensorView& dg = *grads.dg;
    if (dg.shape != opts.g->shape || (!dg.strides.empty() && dg.strides.size() != dg.rank()))
      throw Error(fmt::format("{}: dg must have g's shape {}; got {}", what,
                              opts.g->describe(), dg.describe()));
    switch (dg.dtype) {
      case DType::F32: dg_type = 1; break;
      case DType::BF16: dg_type = 2; break;
      case DType::F16: dg_type = 3; break;
      default:
        throw Error(fmt::format("{}: dg is {}; float32, bf16 or fp16 expected", what,
                                dtype_name(dg.dtype)));
    }
    for (size_t i = 0; i < dg.rank(); ++i) {
      if (dg.stride(i) < 0) throw Error(fmt::format("{}: dg: negative stride ({})", what, dg.describe()));
      dg_strides[i] = dg.stride(i);
    }
    if ((dg.data == nullptr && !detail::is_empty(dg)) ||
        reinterpret_cast<uintptr_t>(dg.data) % dtype_size(dg.dtype) != 0)
      throw Error(fmt::format("{}: dg's data must be set and aligned to its elements", what));
  }
  if (opts.initial_state) check_state(what, "initial_state", *opts.initial_state, s);
  if (opts.d_final_state) check_state(what, "d_final_state", *opts.d_final_state, s);
  if (grads.d_initial_state) check_state(what, "d_initial_state", *grads.d_initial_state, s);
  check_outputs(what,
                {{"dq", &grads.dq}, {"dk", &grads.dk}, {"dv", &grads.dv},
                 {"dg", ptr(grads.dg)}, {"d_initial_state", ptr(grads.d_initial_state)}},
                {{"q", &q}, {"k", &k}, {"v", &v}, {"dout", &dout}, {"g", ptr(opts.g)},
                 {"initial_state", ptr(opts.initial_state)},
                 {"d_final_state", ptr(opts.d_final_state)}});
  const double scale = check_scale(what, opts.scale, s.DK);
  if (s.B == 0 || s.H == 0) return;

  const FeatureInputs in(opts.feature_map, q, k, opts.stream, opts.workspace, what);
  FlexcGlaBwdParams bp{};
  FlexcGlaParams& p = bp.f;
  p = make_params(in.q(), in.k(), v, dout, opts.g, gates, s, scale);
  p.o = nullptr;
  p.h0 = opts.initial_state ? static_cast<const float*>(opts.initial_state->data) : nullptr;
  bp.dout = dout.data;
  bp.dq = grads.dq.data, bp.dk = grads.dk.data, bp.dv = grads.dv.data;
  bp.dg = grads.dg ? grads.dg->data : nullptr;
  bp.dht = opts.d_final_state ? static_cast<const float*>(opts.d_final_state->data) : nullptr;
  for (int i = 0; i < 3; ++i) {
    bp.dout_stride[i] = dout.stride(i), bp.dq_stride[i] = grads.dq.stride(i);
    bp.dk_stride[i] = grads.dk.stride(i), bp.dv_stride[i] = grads.dv.stride(i);
  }
  for (int i = 0; i < 4; ++i) bp.dg_stride[i] = dg_strides[i];
  bp.dg_type = dg_type;
  // One gate per step given as [B, H, T]: its gradient sums the key dims' (a [B, H, T, DK] view
  // with key-dim stride 0 gets each dim's own).
  bp.dg_sum_dims = opts.g && opts.g->rank() == 3;
  float* dh0 = grads.d_initial_state ? static_cast<float*>(grads.d_initial_state->data) : nullptr;
  if (s.T == 0 && !dh0) return;

  const bool grouped = s.Hk != s.H;
  const size_t heads = size_t(s.B * s.H), chunks = size_t(p.chunks), rows = chunks * 64;
  Workspace layout;
  layout.forward(s, p, gates);
  const size_t qexp = layout.add(heads * rows * size_t(s.DK) * 2);
  const size_t dstates = layout.add(heads * chunks * size_t(s.DK * s.DV) * 2);
  const size_t db = layout.add(opts.g ? heads * rows * size_t(s.DK) * 4 : 0);
  const size_t db_sums = layout.add(opts.g ? heads * chunks * size_t(s.DK) * 4 : 0);
  const size_t final_state = layout.add(opts.g && bp.dht ? heads * size_t(s.DK * s.DV) * 4 : 0);
  const size_t dk32 = layout.add(grouped ? heads * size_t(s.T * s.DK) * 4 : 0);
  const size_t dv32 = layout.add(grouped ? heads * size_t(s.T * s.DV) * 4 : 0);
  detail::StreamBuffer work(layout.bytes(), opts.stream, opts.workspace, what);
  char* base = static_cast<char*>(work.get());
  layout.place_forward(base, p);
  p.qexp = layout.at(base, qexp);
  bp.dstates = layout.at(base, dstates);
  bp.db = reinterpret_cast<float*>(layout.at(base, db));
  bp.db_sums = reinterpret_cast<float*>(layout.at(base, db_sums));
  // The final state (for the gates' final-state term) only when both exist.
  p.ht = opts.g && bp.dht ? reinterpret_cast<float*>(layout.at(base, final_state)) : nullptr;
  bp.dk32 = reinterpret_cast<float*>(layout.at(base, dk32));
  bp.dv32 = reinterpret_cast<float*>(layout.at(base, dv32));

  const jit::Kernel& prepare = kernel_for(q, s, gates, "flexc_gla_prepare", what, true);
  const jit::Kernel& states = kernel_for(q, s, gates, "flexc_gla_states", what, true);
  const jit::Kernel& dstates_pass = kernel_for(q, s, gates, "flexc_gla_dstates", what, true);
  const jit::Kernel& chunk = kernel_for(q, s, gates, "flexc_gla_backward", what, true);
  const size_t smem = detail::gla_backward_smem(int(s.DK), int(s.DV), gates.scalar);
  if (smem > detail::device_limits().max_smem)
    throw Error(fmt::format("{}: head dims {} / {} need {} KiB of shared memory per block; this "
                            "GPU allows {} KiB",
                            what, s.DK, s.DV, smem / 1024, detail::device_limits().max_smem / 1024));
  const unsigned states_grid = unsigned(s.DK / 64 * (s.DV / kFlexcGlaStateCols));
  void* args[] = {&p};
  void* bwd_args[] = {&bp};
  if (p.chunks > 0) {
    prepare.launch(unsigned(p.chunks), unsigned(s.H), unsigned(s.B), unsigned(4 * s.DK), 0,
                   opts.stream, args);
    states.launch(states_grid, unsigned(s.H), unsigned(s.B), 128, detail::gla_states_smem(),
                  opts.stream, args);
  }
  // The state gradients: the same pass backwards over Qexp and dO (templates/linear/gla_chunk.cuh).
  FlexcGlaParams rp = p;
  rp.khat = p.qexp, rp.v = dout.data, rp.k_heads = p.heads;
  for (int i = 0; i < 3; ++i) rp.v_stride[i] = dout.stride(i);
  rp.h0 = bp.dht, rp.states = bp.dstates, rp.ht = dh0;
  void* rargs[] = {&rp};
  dstates_pass.launch(states_grid, unsigned(s.H), unsigned(s.B), 128, detail::gla_states_smem(),
                      opts.stream, rargs);
  if (p.chunks == 0) return;
  chunk.launch(unsigned(p.chunks), unsigned(s.H), unsigned(s.B), 512, smem, opts.stream,
               bwd_args);
  if (opts.g) {
    kernel_for(q, s, gates, "flexc_gla_dg_scan", what, true)
        .launch(unsigned(s.H), unsigned(s.B), 1, unsigned(s.DK), 0, opts.stream, bwd_args);
    kernel_for(q, s, gates, "flexc_gla_dg", what, true)
        .launch(unsigned(p.chunks), unsigned(s.H), unsigned(s.B), unsigned(s.DK), 0, opts.stream,
                bwd_args);
  }
  if (grouped)
    kernel_for(q, s, gates, "flexc_gla_reduce", what, true)
        .launch(unsigned(s.T), unsigned(s.Hk), unsigned(s.B), 128, 0, opts.stream, bwd_args);
  // The gradients so far are phi(q)'s and phi(k)'s: through phi'.
  if (opts.feature_map) {
    detail::run_feature_map(*opts.feature_map, q, grads.dq, true, opts.stream);
    detail::run_feature_map(*opts.feature_map, k, grads.dk, true, opts.stream);
  }
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
  check_outputs(what, {{"out", &out}}, {{"q", &q}, {"k", &k}, {"v", &v}});
  const double scale = check_scale(what, opts.scale, s.DK);
  if (s.B == 0 || s.H == 0 || s.T == 0) return;

  const FeatureInputs in(opts.feature_map, q, k, opts.stream, opts.workspace, what);
  FlexcGlaParams p = make_params(in.q(), in.k(), v, out, opts.g, gates, s, scale);
  p.ht = static_cast<float*>(state.data);
  const jit::Kernel& step = kernel_for(q, s, gates, "flexc_gla_step", what);
  void* args[] = {&p};
  step.launch(unsigned(s.DV / 64), unsigned(s.H), unsigned(s.B), 256, 0, opts.stream, args);
}

}  // namespace flexc
