// Gated linear attention (flexc/linear.h): the float64 reference against the naive parallel form
// and its own chunkwise algorithm, argument errors, the kernels building, and ([gpu]) the chunkwise
// kernels and the recurrent step against the reference over gate kinds, dtypes, head dims,
// lengths, GQA, initial states, split runs and extreme gates.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <fmt/format.h>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "flexc/device.h"
#include "flexc/error.h"
#include "flexc/linear.h"
#include "flexc/variant.h"
#include "jit/jit.h"
#include "linear/gla.h"
#include "test_tensors.h"

using namespace flexc;
using namespace flexc::testing;
using Catch::Matchers::Contains;

namespace {

#define SKIP_WITHOUT_GPU()       \
  if (!flexc::gpu_available()) { \
    WARN("no GPU: skipped");     \
    return;                      \
  }

// How a case draws its log gates.
enum class Gates { None, PerDim, PerStep, PerHead };
enum class Strength { Typical, Strong, Weak };

const char* name_of(Gates g) {
  switch (g) {
    case Gates::None: return "none";
    case Gates::PerDim: return "per key dim";
    case Gates::PerStep: return "per step";
    case Gates::PerHead: return "per head";
  }
  return "";
}

// A problem on the host. Gates per key dim are float32; per step in q's dtype; per head a float32
// [H] vector the kernels see through a broadcasting view.
struct LinearCase {
  DType dtype = DType::BF16;
  int64_t B = 1, H = 2, Hk = 1, T = 100, DK = 64, DV = 64;
  Gates gates = Gates::PerDim;
  Strength strength = Strength::Typical;
  bool initial = false;
  std::optional<FeatureMap> fmap;     // on q and k
  std::vector<float> q, k, v, g, h0;  // g: per-dim [B,H,T,DK], per-step / per-head [B,H,T]
  std::vector<float> head_gate;        // per head: [H]

  std::string describe() const {
    return fmt::format("{} B {} H {} Hk {} T {} DK {} DV {}, gates {}{}{}", dtype_name(dtype), B, H,
                       Hk, T, DK, DV, name_of(gates),
                       strength == Strength::Strong ? " (strong)"
                       : strength == Strength::Weak ? " (weak)"
                                                    : "",
                       initial ? ", initial state" : "") +
           (fmap ? ", feature map " + fmap->text() : "");
  }
  float draw_gate() const {
    std::normal_distribution<float> nd(0.f, 1.f);
    const float x = nd(rng());
    switch (strength) {
      case Strength::Strong: return -20.f + 0.5f * x;
      case Strength::Weak: return -1e-6f * std::abs(x);
      default: return -std::log1p(std::exp(-x)) / 16.f;  // logsigmoid / 16, as GLA
    }
  }
  void fill() {
    q = normal(B * H * T * DK, dtype);
    k = normal(B * Hk * T * DK, dtype);
    v = normal(B * Hk * T * DV, dtype);
    g.clear(), head_gate.clear(), h0.clear();
    if (gates == Gates::PerDim) {
      g.resize(B * H * T * DK);
      for (float& x : g) x = draw_gate();
    } else if (gates == Gates::PerStep) {
      g.resize(B * H * T);
      for (float& x : g) x = std::min(0.f, round16(dtype, draw_gate()));
    } else if (gates == Gates::PerHead) {
      for (int64_t h = 0; h < H; ++h) head_gate.push_back(std::log(1.f - std::exp2(-5.f - h)));
      g.resize(B * H * T);
      for (int64_t i = 0; i < B * H * T; ++i) g[i] = head_gate[i / T % H];
    }
    if (initial) h0 = normal(B * H * DK * DV, DType::BF16, 0.5f);
  }
  LinearReferenceProblem reference() const {
    LinearReferenceProblem p;
    p.q = q, p.k = k, p.v = v, p.g = g, p.initial_state = h0;
    p.batch = B, p.heads = H, p.k_heads = Hk, p.seq_len = T, p.dk = DK, p.dv = DV;
    p.per_dim_gates = gates == Gates::PerDim;
    p.dtype = dtype;
    p.feature_map = fmap;
    return p;
  }
};

std::vector<uint16_t> bits16(DType d, const std::vector<float>& x) {
  std::vector<uint16_t> b(x.size());
  for (size_t i = 0; i < x.size(); ++i)
    b[i] = d == DType::BF16 ? float_to_bf16(x[i]) : float_to_fp16(x[i]);
  return b;
}
std::vector<float> floats16(DType d, const std::vector<uint16_t>& b) {
  std::vector<float> x(b.size());
  for (size_t i = 0; i < b.size(); ++i)
    x[i] = d == DType::BF16 ? bf16_to_float(b[i]) : fp16_to_float(b[i]);
  return x;
}

// The case's tensors on the device, outputs poisoned (all bits set: NaN).
struct DeviceCase {
  DeviceBuffer q, k, v, g, h0, out, state;
  TensorView tq, tk, tv, tout;
  std::optional<TensorView> tg, th0, tstate;

  explicit DeviceCase(const LinearCase& c) {
    auto up16 = [&](const std::vector<float>& x) {
      return DeviceBuffer::from<uint16_t>(bits16(c.dtype, x));
    };
    q = up16(c.q), k = up16(c.k), v = up16(c.v);
    out = DeviceBuffer(std::max<int64_t>(c.B * c.H * c.T * c.DV * 2, 16));
    out.fill(0xff);
    state = DeviceBuffer(c.B * c.H * c.DK * c.DV * 4);
    state.fill(0xff);
    tq = TensorView::contiguous(q.get(), c.dtype, {c.B, c.H, c.T, c.DK});
    tk = TensorView::contiguous(k.get(), c.dtype, {c.B, c.Hk, c.T, c.DK});
    tv = TensorView::contiguous(v.get(), c.dtype, {c.B, c.Hk, c.T, c.DV});
    tout = TensorView::contiguous(out.get(), c.dtype, {c.B, c.H, c.T, c.DV});
    tstate = TensorView::contiguous(state.get(), DType::F32, {c.B, c.H, c.DK, c.DV});
    if (c.gates == Gates::PerDim) {
      g = DeviceBuffer::from<float>(c.g);
      tg = TensorView::contiguous(g.get(), DType::F32, {c.B, c.H, c.T, c.DK});
    } else if (c.gates == Gates::PerStep) {
      g = up16(c.g);
      tg = TensorView::contiguous(g.get(), c.dtype, {c.B, c.H, c.T});
    } else if (c.gates == Gates::PerHead) {
      g = DeviceBuffer::from<float>(c.head_gate);
      tg = TensorView{g.get(), DType::F32, {c.B, c.H, c.T}, {0, 1, 0}};
    }
    if (c.initial) {
      h0 = DeviceBuffer::from<float>(c.h0);
      th0 = TensorView::contiguous(h0.get(), DType::F32, {c.B, c.H, c.DK, c.DV});
    }
  }
  std::vector<float> output(const LinearCase& c) const {
    return floats16(c.dtype, out.to_vector<uint16_t>(c.B * c.H * c.T * c.DV));
  }
  std::vector<float> final_state(const LinearCase& c) const {
    return state.to_vector<float>(c.B * c.H * c.DK * c.DV);
  }
};

// Options with gates and states (designated initializers would leave members unnamed).
LinearOptions with(std::optional<TensorView> g, std::optional<TensorView> initial = {},
                   std::optional<TensorView> final_state = {}) {
  LinearOptions o;
  o.g = std::move(g), o.initial_state = std::move(initial), o.final_state = std::move(final_state);
  return o;
}

// Tokens [t0, t0 + len) of a [B, H, T, ...] view.
TensorView tokens(const TensorView& t, int64_t t0, int64_t len) {
  TensorView p = t;
  p.data = static_cast<unsigned char*>(t.data) + t0 * t.stride(2) * int64_t(dtype_size(t.dtype));
  p.strides.clear();
  for (size_t i = 0; i < t.rank(); ++i) p.strides.push_back(t.stride(i));
  p.shape[2] = len;
  return p;
}

LinearAccuracy run_chunked(LinearCase& c) {
  c.fill();
  DeviceCase d(c);
  LinearOptions o = with(d.tg, d.th0, d.tstate);
  o.feature_map = c.fmap;
  linear_attention(d.tq, d.tk, d.tv, d.tout, o);
  synchronize_device();
  const LinearReferenceResult r = reference_linear_attention(c.reference());
  return check_linear_accuracy(r, d.output(c), d.final_state(c));
}

// Every gate kind x strength x dtype on a small problem (T 150: two chunks and a part; H heads,
// Hk k / v heads, an initial state), filled, for the reference's own checks.
template <class Fn>
void for_small_cases(int64_t H, int64_t Hk, Fn fn) {
  for (Strength s : {Strength::Typical, Strength::Strong, Strength::Weak})
    for (Gates gates : {Gates::PerDim, Gates::PerStep, Gates::PerHead, Gates::None})
      for (DType dt : {DType::BF16, DType::F16}) {
        LinearCase c;
        c.dtype = dt, c.T = 150, c.DK = 16, c.DV = 8, c.H = H, c.Hk = Hk, c.gates = gates;
        c.strength = s, c.initial = true;
        c.fill();
        fn(c);
      }
}

// Every dtype x head-dim pair x gate kind the kernels build, numbered (i) so that a sweep can vary
// lengths, heads and states across them.
template <class Fn>
void for_kernel_configs(Fn fn) {
  int i = 0;
  for (DType dt : {DType::BF16, DType::F16})
    for (auto [dk, dv] : {std::pair{64, 64}, {128, 128}, {128, 64}})
      for (Gates gates : {Gates::PerDim, Gates::PerStep, Gates::PerHead, Gates::None}) {
        LinearCase c;
        c.dtype = dt, c.DK = dk, c.DV = dv, c.gates = gates;
        fn(c, i++);
      }
}

// Central differences of loss() over every element of x against the gradient dx (float inputs:
// a step of 1e-3 keeps the rounding of the perturbed value far below the difference).
template <class Loss>
void check_finite_differences(const std::string& name, std::vector<float>& x,
                              const std::vector<double>& dx, Loss loss) {
  REQUIRE(dx.size() == x.size());
  double worst = 0, size = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const float x0 = x[i], h = 1e-3f;
    x[i] = x0 + h;
    const double up = loss();
    x[i] = x0 - h;
    const double down = loss();
    x[i] = x0;
    const double fd = (up - down) / (double(x0 + h) - double(x0 - h));
    worst = std::max(worst, std::abs(fd - dx[i]));
    size = std::max(size, std::abs(dx[i]));
  }
  INFO(name << ": worst |fd - grad| " << worst << ", max |grad| " << size);
  CHECK(size > 0);
  CHECK(worst < 2e-4 * std::max(1.0, size));
}

// worst = max(worst, max |x - gold|), size = max(size, max |gold|).
void max_abs(const std::vector<double>& gold, const std::vector<double>& x, double& worst,
             double& size) {
  for (size_t i = 0; i < gold.size(); ++i) {
    worst = std::max(worst, std::abs(x[i] - gold[i]));
    size = std::max(size, std::abs(gold[i]));
  }
}

// The backward on the device against the reference's gradients; dout (and, with `dstate`, the
// final state's gradient) drawn fresh, every output poisoned.
BackwardAccuracy run_backward(LinearCase& c, bool dstate) {
  c.fill();
  DeviceCase d(c);
  const std::vector<float> dout = normal(c.B * c.H * c.T * c.DV, c.dtype);
  const std::vector<float> dht = dstate ? normal(c.B * c.H * c.DK * c.DV, DType::F32) : std::vector<float>{};
  DeviceBuffer ddout = DeviceBuffer::from<uint16_t>(bits16(c.dtype, dout));
  DeviceBuffer ddht = dstate ? DeviceBuffer::from<float>(dht) : DeviceBuffer(16);
  auto poisoned = [](int64_t bytes) {
    DeviceBuffer b(std::max<int64_t>(bytes, 16));
    b.fill(0xff);
    return b;
  };
  const int64_t s16 = dtype_size(c.dtype);
  DeviceBuffer dq = poisoned(c.B * c.H * c.T * c.DK * s16), dk = poisoned(c.B * c.Hk * c.T * c.DK * s16),
               dv = poisoned(c.B * c.Hk * c.T * c.DV * s16), dh0 = poisoned(c.B * c.H * c.DK * c.DV * 4);
  // dg in g's type: float32 per key dim and per head (that one [B, H, T], its own memory), q's
  // type per step.
  const DType gate_type = c.gates == Gates::PerStep ? c.dtype : DType::F32;
  DeviceBuffer dg = poisoned(int64_t(c.g.size()) * dtype_size(gate_type));
  LinearGradients grads{TensorView::contiguous(dq.get(), c.dtype, {c.B, c.H, c.T, c.DK}),
                        TensorView::contiguous(dk.get(), c.dtype, {c.B, c.Hk, c.T, c.DK}),
                        TensorView::contiguous(dv.get(), c.dtype, {c.B, c.Hk, c.T, c.DV}),
                        {}, {}};
  if (d.tg) grads.dg = TensorView::contiguous(dg.get(), gate_type, d.tg->shape);
  if (c.initial)
    grads.d_initial_state = TensorView::contiguous(dh0.get(), DType::F32, {c.B, c.H, c.DK, c.DV});
  LinearBackwardOptions o;
  o.g = d.tg, o.initial_state = d.th0, o.feature_map = c.fmap;
  if (dstate) o.d_final_state = TensorView::contiguous(ddht.get(), DType::F32, {c.B, c.H, c.DK, c.DV});
  linear_attention_backward(d.tq, d.tk, d.tv,
                            TensorView::contiguous(ddout.get(), c.dtype, {c.B, c.H, c.T, c.DV}),
                            grads, o);
  synchronize_device();
  LinearReferenceProblem p = c.reference();
  p.gate_dtype = gate_type;
  const LinearReferenceGradients r = reference_linear_attention_backward(p, dout, dht);
  const auto down16 = [&](const DeviceBuffer& b, size_t n) {
    return floats16(c.dtype, b.to_vector<uint16_t>(n));
  };
  std::vector<float> g;
  if (grads.dg)
    g = gate_type == DType::F32 ? dg.to_vector<float>(c.g.size()) : down16(dg, c.g.size());
  return check_linear_gradients(
      r, down16(dq, r.gold.dq.size()), down16(dk, r.gold.dk.size()), down16(dv, r.gold.dv.size()), g,
      c.initial ? dh0.to_vector<float>(r.gold.dh0.size()) : std::vector<float>{});
}

}  // namespace

// ---- the reference

TEST_CASE("linear reference: the recurrence equals the naive parallel form", "[linear]") {
  LinearCase c;
  c.dtype = DType::BF16, c.B = 2, c.H = 4, c.Hk = 2, c.T = 37, c.DK = 5, c.DV = 3, c.initial = true;
  for (Gates gates : {Gates::PerDim, Gates::PerStep, Gates::None}) {
    c.gates = gates;
    c.fill();
    LinearReferenceProblem p = c.reference();
    p.scale = 0.7;
    const LinearReferenceResult r = reference_linear_attention(p);
    double worst = 0;
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t h = 0; h < c.H; ++h)
        for (int64_t i = 0; i < c.T; ++i)
          for (int64_t e = 0; e < c.DV; ++e) {
            // o_i = scale (q_i * exp(G_i)) S_0 + scale sum_{j<=i} sum_d q_i k_j exp(G_i - G_j) v_j,
            // G the gates' prefix sums.
            const int64_t row = (b * c.H + h) * c.T, krow = (b * c.Hk + h / 2) * c.T;
            auto gate = [&](int64_t t, int64_t d) -> double {
              if (gates == Gates::None) return 0;
              return gates == Gates::PerDim ? c.g[(row + t) * c.DK + d] : c.g[row + t];
            };
            auto G = [&](int64_t t, int64_t d) {
              double s = 0;
              for (int64_t u = 0; u <= t; ++u) s += gate(u, d);
              return s;
            };
            double o = 0;
            for (int64_t d = 0; d < c.DK; ++d) {
              const double qd = c.q[(row + i) * c.DK + d];
              o += qd * std::exp(G(i, d)) * c.h0[((b * c.H + h) * c.DK + d) * c.DV + e];
              for (int64_t j = 0; j <= i; ++j)
                o += qd * c.k[(krow + j) * c.DK + d] * std::exp(G(i, d) - G(j, d)) *
                     c.v[(krow + j) * c.DV + e];
            }
            o *= 0.7;
            worst = std::max(worst, std::abs(o - r.gold_out[(row + i) * c.DV + e]));
          }
    INFO(name_of(gates));
    CHECK(worst < 1e-9);
  }
}

TEST_CASE("linear reference: the chunkwise algorithm without rounding equals the recurrence",
          "[linear]") {
  for_small_cases(2, 2, [](LinearCase& c) {
    const DType dt = c.dtype;
    LinearReferenceProblem p = c.reference();
    p.exact_ref = true;
    const LinearReferenceResult r = reference_linear_attention(p);
    double worst = 0, size = 0, state_size = 0;
    max_abs(r.gold_out, r.ref_out, worst, size);
    max_abs(r.gold_state, r.ref_state, worst, state_size);
    INFO(c.describe());
    CHECK(size > 0.1);
    CHECK(worst < 1e-9 * std::max(1.0, size));
    // With the kernels' roundings the error is that of the input type, not more.
    p.exact_ref = false;
    const LinearReferenceResult rr = reference_linear_attention(p);
    const LinearAccuracy a =
        check_linear_accuracy(rr, std::vector<float>(rr.ref_out.begin(), rr.ref_out.end()),
                              std::vector<float>(rr.ref_state.begin(), rr.ref_state.end()));
    INFO(a.summary());
    CHECK(a.pass);
    CHECK(a.out_ref_rmse > 0);
    CHECK(a.out_ref_rmse < (dt == DType::BF16 ? 2e-2 : 4e-3) * size);
  });
}

TEST_CASE("linear reference: the gradients equal finite differences", "[linear]") {
  for (Gates gates : {Gates::PerDim, Gates::PerStep, Gates::None}) {
    LinearCase c;
    c.B = 2, c.H = 4, c.Hk = 2, c.T = 11, c.DK = 3, c.DV = 2, c.gates = gates, c.initial = true;
    c.fill();
    for (float& x : c.g) x = std::min(x, -0.01f);  // stays <= 0 when perturbed
    const std::vector<float> dout = normal(c.B * c.H * c.T * c.DV, DType::BF16);
    const std::vector<float> dstate = normal(c.B * c.H * c.DK * c.DV, DType::BF16);
    const LinearReferenceGradients grad =
        reference_linear_attention_backward(c.reference(), dout, dstate);
    auto loss = [&] {
      const LinearReferenceResult r = reference_linear_attention(c.reference());
      double l = 0;
      for (size_t i = 0; i < dout.size(); ++i) l += r.gold_out[i] * dout[i];
      for (size_t i = 0; i < dstate.size(); ++i) l += r.gold_state[i] * dstate[i];
      return l;
    };
    auto check = [&](const char* name, std::vector<float>& x, const std::vector<double>& dx) {
      check_finite_differences(fmt::format("{} {}", name_of(gates), name), x, dx, loss);
    };
    check("dq", c.q, grad.gold.dq);
    check("dk", c.k, grad.gold.dk);
    check("dv", c.v, grad.gold.dv);
    check("dh0", c.h0, grad.gold.dh0);
    if (gates != Gates::None) check("dg", c.g, grad.gold.dg);
    CHECK(grad.gold.dg.size() == c.g.size());
  }
}

TEST_CASE("linear reference: the chunkwise backward without rounding equals the recurrence's",
          "[linear]") {
  for_small_cases(4, 2, [](LinearCase& c) {
    const DType dt = c.dtype;
    const Gates gates = c.gates;
    if (gates == Gates::PerDim) c.g[5] = -2e4f;  // clamped: no gradient
    const std::vector<float> dout = normal(c.B * c.H * c.T * c.DV, dt);
    const std::vector<float> dstate = normal(c.B * c.H * c.DK * c.DV, DType::F32);
    LinearReferenceProblem p = c.reference();
    p.exact_ref = true;
    const LinearReferenceGradients r = reference_linear_attention_backward(p, dout, dstate);
    INFO(c.describe());
    auto same = [&](const char* name, const std::vector<double>& gold,
                    const std::vector<double>& ref) {
      REQUIRE(gold.size() == ref.size());
      double worst = 0, size = 0;
      max_abs(gold, ref, worst, size);
      INFO(name << ": worst " << worst << ", max |gold| " << size);
      CHECK(size > 0);
      CHECK(worst < 1e-9 * std::max(1.0, size));
    };
    same("dq", r.gold.dq, r.ref.dq);
    same("dk", r.gold.dk, r.ref.dk);
    same("dv", r.gold.dv, r.ref.dv);
    same("dh0", r.gold.dh0, r.ref.dh0);
    if (gates != Gates::None) same("dg", r.gold.dg, r.ref.dg);
    if (gates == Gates::PerDim) CHECK(r.ref.dg[5] == 0);
    // Rounded, the reference passes its own rule, and its error is the input type's.
    p.exact_ref = false;
    const LinearReferenceGradients rr = reference_linear_attention_backward(p, dout, dstate);
    const auto f = [](const std::vector<double>& x) { return std::vector<float>(x.begin(), x.end()); };
    const BackwardAccuracy a = check_linear_gradients(
        rr, f(rr.ref.dq), f(rr.ref.dk), f(rr.ref.dv), f(rr.ref.dg), f(rr.ref.dh0));
    INFO(a.summary());
    CHECK(a.pass);
    // (dh0 can be exact: without gates and with scale 1/4 nothing it sums is rounded.)
    for (const GradientAccuracy& g : a.grads)
      if (g.name != "dh0") CHECK(g.ref_rmse > 0);
    // dg in g's type (here float32): float32's values, not a 16-bit grid (a float32 dg rounded
    // to fp16 had made ref's error a draw, failing T = 1 now and then).
    if (gates != Gates::None) {
      bool off_fp16 = false;
      for (double x : rr.ref.dg) {
        CHECK(double(float(x)) == x);
        off_fp16 = off_fp16 || double(fp16_to_float(float_to_fp16(float(x)))) != x;
      }
      CHECK(off_fp16);
    }
  });
}

TEST_CASE("feature maps: an expression of x, its values and derivative, errors named",
          "[linear]") {
  const FeatureMap elu = FeatureMap::parse("where(x > 0, x + 1, exp(x))");
  CHECK(elu.text() == "x > 0.0 ? x + 1.0 : exp(x)");
  for (double x : {-3.0, -0.5, 0.25, 2.0}) {
    CHECK(elu(x) == (x > 0 ? x + 1 : std::exp(x)));
    CHECK(elu.derivative(x) == (x > 0 ? 1.0 : std::exp(x)));
  }
  const FeatureMap sq = FeatureMap::parse("let y = x * x; y + 0.5 * x");
  CHECK(sq(3.0) == 10.5);
  CHECK(sq.derivative(3.0) == 6.5);
  CHECK_THROWS_WITH(FeatureMap::parse("x + h", "cfg: feature_map"),
                    Contains("cfg: feature_map:1:5") && Contains("an expression of x alone"));
  CHECK_THROWS_WITH(FeatureMap::parse("score * 2"), Contains("an expression of x alone"));
  CHECK_THROWS_WITH(FeatureMap::parse("x > 0"), Contains("a feature map must be float"));
  CHECK_THROWS_WITH(FeatureMap::parse("exp(xx)"), Contains("unknown name 'xx'") &&
                                                     Contains("did you mean 'x'?"));
  // In a config, and what it builds without a GPU: the feature map's module beside the others.
  const LinearVariant v = LinearVariant::load("@linear_elu");
  REQUIRE(v.feature_map());
  CHECK(v.feature_map()->text() == elu.text());
  CHECK_FALSE(LinearVariant::load("@gla").feature_map());
  CHECK_THROWS_WITH(LinearVariant::from_json(R"({"name": "x", "kind": "linear", "gate": "none",
                                                 "feature_map": "x + q_idx"})", "f.json"),
                    Contains("f.json: feature_map:1:5"));
  const std::vector<CompiledKernel> k = compile_linear_kernels(v, "sm_90", "bf16", 128, 128);
  REQUIRE(k.size() == 3);
  CHECK(k[2].ptx.find(".entry flexc_feature_map(") != std::string::npos);
  CHECK(k[2].ptx.find(".entry flexc_feature_map_grad(") != std::string::npos);
}

TEST_CASE("linear reference: gradients through a feature map equal finite differences",
          "[linear]") {
  LinearCase c;
  c.B = 1, c.H = 2, c.Hk = 1, c.T = 9, c.DK = 3, c.DV = 2, c.gates = Gates::PerStep;
  c.fmap = FeatureMap::parse("where(x > 0, x + 1, exp(x))");
  c.fill();
  for (float& x : c.g) x = std::min(x, -0.01f);
  const std::vector<float> dout = normal(c.B * c.H * c.T * c.DV, DType::BF16);
  LinearReferenceProblem p = c.reference();
  p.exact_ref = true;  // phi unrounded: a perturbation of x moves phi(x)
  const LinearReferenceGradients grad = reference_linear_attention_backward(p, dout, {});
  auto loss = [&] {
    LinearReferenceProblem lp = c.reference();
    lp.exact_ref = true;
    const LinearReferenceResult r = reference_linear_attention(lp);
    double l = 0;
    for (size_t i = 0; i < dout.size(); ++i) l += r.gold_out[i] * dout[i];
    return l;
  };
  check_finite_differences("dq", c.q, grad.gold.dq, loss);
  check_finite_differences("dk", c.k, grad.gold.dk, loss);
}

TEST_CASE("linear reference: sizes and positive gates are errors", "[linear]") {
  LinearCase c;
  c.fill();
  LinearReferenceProblem p = c.reference();
  p.k = std::span<const float>(c.k).first(c.k.size() - 1);
  CHECK_THROWS_WITH(reference_linear_attention(p), Contains("k has"));
  std::vector<float> g = c.g;
  g[7] = 0.25f;
  p = c.reference();
  p.g = g;
  CHECK_THROWS_WITH(reference_linear_attention(p), Contains("g[7] = 0.25") && Contains("<= 0"));
}

// ---- arguments (checked before any GPU work: fake device pointers)

TEST_CASE("linear attention arguments are checked and named before any GPU work", "[linear]") {
  alignas(256) static unsigned char mem[1 << 16];
  auto t16 = [&](size_t at, std::vector<int64_t> shape) {
    return TensorView::contiguous(mem + at, DType::BF16, std::move(shape));
  };
  const TensorView q = t16(0, {2, 4, 10, 64}), k = t16(0, {2, 2, 10, 64}),
                   v = t16(0, {2, 2, 10, 128}), out = t16(32768, {2, 4, 10, 128});
  auto err = [&](const TensorView& qq, const TensorView& kk, const TensorView& vv,
                 const TensorView& oo, const LinearOptions& o) {
    try {
      linear_attention(qq, kk, vv, oo, o);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK_THAT(err(t16(0, {2, 4, 10, 96}), t16(0, {2, 2, 10, 96}), v, out, {}),
             Contains("q's head dim DK is 96; 64 or 128 expected"));
  CHECK_THAT(err(q, t16(0, {2, 3, 10, 64}), t16(0, {2, 3, 10, 128}), out, {}),
             Contains("k's and v's head count 3 must divide q's 4"));
  CHECK_THAT(err(q, t16(0, {2, 2, 11, 64}), v, out, {}), Contains("k must be [B, Hk, T, DK]"));
  CHECK_THAT(err(q, k, v, t16(32768, {2, 4, 10, 64}), {}),
             Contains("out must be [B, H, T, DV] = [2, 4, 10, 128]"));
  CHECK_THAT(err(q, k, v, t16(0, {2, 4, 10, 128}), {}), Contains("out overlaps q"));
  LinearOptions o;
  o.g = TensorView::contiguous(mem, DType::F32, {2, 4, 10, 32});
  CHECK_THAT(err(q, k, v, out, o), Contains("g must be [B, H, T, DK] = [2, 4, 10, 64] or [B, H, T]"));
  o.g = TensorView::contiguous(mem, DType::I32, {2, 4, 10});
  CHECK_THAT(err(q, k, v, out, o), Contains("g is int32; float32, bf16 or fp16 expected"));
  o.g.reset();
  o.final_state = TensorView::contiguous(mem, DType::F16, {2, 4, 64, 128});
  CHECK_THAT(err(q, k, v, out, o),
             Contains("final_state must be contiguous float32 [B, H, DK, DV] = [2, 4, 64, 128]"));
  o.final_state.reset();
  o.scale = -1;
  CHECK_THAT(err(q, k, v, out, o), Contains("scale must be finite and > 0"));
  // The step: its state argument, no initial / final state.
  const TensorView state = TensorView::contiguous(mem, DType::F32, {2, 4, 64, 128});
  CHECK_THROWS_WITH(linear_attention_step(q, k, v, state, out, {}), Contains("state overlaps q"));
  LinearOptions o2;
  o2.initial_state = state;
  CHECK_THROWS_WITH(linear_attention_step(q, k, v, state, out, o2),
                    Contains("initial_state and final_state must be unset"));

  // The backward: its gradients' shapes, dg exactly with g, outputs apart from the inputs.
  alignas(256) static unsigned char grad_mem[1 << 17];
  auto g16 = [&](size_t at, std::vector<int64_t> shape) {
    return TensorView::contiguous(grad_mem + at, DType::BF16, std::move(shape));
  };
  LinearGradients grads{g16(0, {2, 4, 10, 64}), g16(16384, {2, 2, 10, 64}),
                        g16(32768, {2, 2, 10, 128}), {}, {}};
  auto bwd = [&](const LinearGradients& gr, const LinearBackwardOptions& bo) {
    try {
      linear_attention_backward(q, k, v, out, gr, bo);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  // Valid arguments get as far as the GPU (never launched here: the pointers are fake).
  if (!gpu_available()) CHECK_THAT(bwd(grads, {}), Contains("flexc::linear_attention_backward"));
  LinearGradients bad = grads;
  bad.dk = g16(16384, {2, 2, 10, 128});
  CHECK_THAT(bwd(bad, {}), Contains("dk must have the shape of k"));
  bad = grads;
  bad.dv = g16(0, {2, 2, 10, 128});
  CHECK_THAT(bwd(bad, {}), Contains("dv overlaps dq"));
  bad = grads;
  bad.dq = q;
  CHECK_THAT(bwd(bad, {}), Contains("dq overlaps q"));
  LinearBackwardOptions bo;
  bo.g = TensorView::contiguous(mem, DType::F32, {2, 4, 10});
  CHECK_THAT(bwd(grads, bo), Contains("grads.dg must be set exactly when opts.g is"));
  bad = grads;
  bad.dg = TensorView::contiguous(grad_mem + 65536, DType::F32, {2, 4, 10, 64});
  CHECK_THAT(bwd(bad, bo), Contains("dg must have g's shape"));
  bad.dg = TensorView{grad_mem + 65536, DType::F32, {2, 4, 10}, {0, 1, 0}};
  CHECK_THAT(bwd(bad, bo), Contains("dg has elements that share memory"));
  bo.g.reset();
  bo.d_final_state = TensorView::contiguous(mem, DType::F32, {2, 4, 64, 64});
  CHECK_THAT(bwd(grads, bo), Contains("d_final_state must be contiguous float32"));
}

TEST_CASE("the linear attention kernels build for sm_80 and sm_90", "[linear][jit]") {
  std::vector<jit::KernelSpec> specs;
  using detail::GateType;
  for (const char* arch : {"sm_80", "sm_90"}) {
    for (GateType gate : {GateType::None, GateType::F32, GateType::BF16})
      specs.push_back(detail::gla_spec({arch, DType::BF16, 128, 128, gate}));
    specs.push_back(detail::gla_spec({arch, DType::BF16, 128, 128, GateType::F32, true}));
    specs.push_back(detail::gla_spec({arch, DType::F16, 64, 64, GateType::F16, true}));
    specs.push_back(detail::gla_spec({arch, DType::F16, 64, 128, GateType::F16}));
    specs.push_back(detail::gla_spec({arch, DType::BF16, 128, 64, GateType::F32}));
    // The backward's compile: every gate kind and head-dim pair once.
    specs.push_back(detail::gla_spec({arch, DType::BF16, 128, 128, GateType::F32, false, true}));
    specs.push_back(detail::gla_spec({arch, DType::BF16, 128, 128, GateType::BF16, true, true}));
    specs.push_back(detail::gla_spec({arch, DType::F16, 64, 64, GateType::None, true, true}));
    specs.push_back(detail::gla_spec({arch, DType::F16, 64, 128, GateType::F16, false, true}));
    specs.push_back(detail::gla_spec({arch, DType::BF16, 128, 64, GateType::F32, false, true}));
  }
  const std::vector<jit::Compiled> out = jit::compile_all(detail::gla_variant(), specs);
  for (size_t i = 0; i < out.size(); ++i) {
    INFO(specs[i].arch << " " << specs[i].template_name << " " << specs[i].defines[0].second << " "
                       << specs[i].defines[1].second);
    CHECK(out[i].cubin.size() > 0);
    const bool backward = specs[i].template_name == "gla_backward.cuh";
    for (const char* entry :
         backward ? std::vector<const char*>{"flexc_gla_prepare", "flexc_gla_states",
                                             "flexc_gla_dstates", "flexc_gla_backward",
                                             "flexc_gla_dg_scan", "flexc_gla_dg", "flexc_gla_reduce"}
                  : std::vector<const char*>{"flexc_gla_prepare", "flexc_gla_states",
                                             "flexc_gla_output", "flexc_gla_step"})
      CHECK(out[i].ptx.find(fmt::format(".entry {}", entry)) != std::string::npos);
    // No local memory (spills would show as local loads).
    CHECK(out[i].ptx.find("ld.local") == std::string::npos);
  }
  CHECK_THROWS_WITH(detail::gla_spec({"sm_90", DType::BF16, 96, 128, GateType::None}),
                    Contains("head dim 96 is not supported"));
}

TEST_CASE("linear-attention configs: the catalogue, per-head decays, errors, kernels built",
          "[linear][jit]") {
  CHECK(LinearVariant::catalogue_names() ==
        std::vector<std::string>{"gla", "linear", "linear_elu", "retnet", "simple_gla"});
  CHECK(LinearVariant::from_catalogue("gla").gate() == LinearGate::PerDim);
  CHECK(LinearVariant::from_catalogue("@simple_gla").gate() == LinearGate::PerStep);
  CHECK(LinearVariant::from_catalogue("linear").gate() == LinearGate::None);
  const LinearVariant retnet = LinearVariant::load("@retnet");
  REQUIRE(retnet.gate() == LinearGate::PerHead);
  const std::vector<float> d = retnet.head_log_decays(8);
  REQUIRE(d.size() == 8);
  for (int h = 0; h < 8; ++h)
    CHECK(d[h] == static_cast<float>(std::log(1.0 - std::exp2(-5.0 - h))));
  CHECK(LinearVariant::is_linear_config("@retnet"));
  CHECK_FALSE(LinearVariant::is_linear_config("@causal"));
  CHECK_FALSE(LinearVariant::is_linear_config("/nonexistent.json"));
  CHECK_THROWS_WITH(LinearVariant::from_catalogue("retnt"), Contains("did you mean"));
  CHECK_THROWS_WITH(retnet.head_log_decays(0), Contains("heads = 0"));
  CHECK_THROWS_WITH(LinearVariant::from_catalogue("gla").head_log_decays(2),
                    Contains("a per_dim gate has no per-head decay"));
  // An attention loader given a linear config says what it is.
  CHECK_THROWS_WITH(Variant::from_json(R"({"name": "x", "kind": "linear", "gate": "none"})"),
                    Contains("a linear-attention config"));
  CHECK_THROWS_WITH(LinearVariant::from_json(R"({"name": "x", "kind": "linear", "gate": "none",
                                                 "scale": -1})"),
                    Contains("scale: must be > 0"));
  CHECK_THROWS_WITH(LinearVariant::from_json(R"({"name": "x", "kind": "softmax", "gate": "none"})"),
                    Contains("kind: expected \"linear\""));
  CHECK(LinearVariant::from_json(R"({"name": "x", "kind": "linear", "gate": "none",
                                     "scale": 0.25})")
            .scale() == 0.25);
  // The kernels a config runs, without a GPU: the forward and the backward modules.
  const std::vector<CompiledKernel> k =
      compile_linear_kernels(retnet, "sm_90", "fp16", 64, 128, "float32");
  REQUIRE(k.size() == 2);
  CHECK(k[0].ptx.find(".entry flexc_gla_output") != std::string::npos);
  CHECK(k[0].ptx.find(".entry flexc_gla_step") != std::string::npos);
  CHECK(k[1].ptx.find(".entry flexc_gla_backward") != std::string::npos);
  CHECK_THROWS_WITH(compile_linear_kernels(retnet, "sm_90", "fp32", 64, 64),
                    Contains("dtype must be bf16 or fp16"));
}

// ---- the kernels ([gpu])

TEST_CASE("linear attention matches the float64 reference: gates, dtypes, head dims, lengths",
          "[linear][gpu]") {
  SKIP_WITHOUT_GPU();
  const int64_t lengths[] = {1, 63, 64, 65, 1000, 4096};
  for_kernel_configs([&](LinearCase& c, int i) {
    c.T = lengths[i % 6];
    c.initial = i % 2 == 0;
    c.H = i % 3 == 0 ? 4 : 2, c.Hk = i % 3 == 0 ? 2 : c.H;  // GQA every third case
    c.B = c.T <= 1000 ? 2 : 1;
    const LinearAccuracy a = run_chunked(c);
    INFO(c.describe() << ": " << a.summary());
    CHECK(a.pass);
  });
}

TEST_CASE("linear attention: strong and weak gates, every length around a chunk", "[linear][gpu]") {
  SKIP_WITHOUT_GPU();
  for (Strength s : {Strength::Strong, Strength::Weak})
    for (DType dt : {DType::BF16, DType::F16})
      for (int64_t T : {17, 64, 129, 700}) {
        LinearCase c;
        c.dtype = dt, c.T = T, c.DK = 128, c.DV = 128, c.strength = s, c.initial = true;
        c.gates = T % 2 ? Gates::PerDim : Gates::PerStep;
        const LinearAccuracy a = run_chunked(c);
        INFO(c.describe() << ": " << a.summary());
        CHECK(a.pass);
      }
}

TEST_CASE("linear attention: two halves with the state passed between them equal one run",
          "[linear][gpu]") {
  SKIP_WITHOUT_GPU();
  for (int64_t split : {256, 300}) {
    LinearCase c;
    c.T = 1000, c.DK = 128, c.DV = 128, c.initial = true;
    c.fill();
    DeviceCase d(c);
    linear_attention(d.tq, d.tk, d.tv, d.tout,
                     with(d.tg, d.th0, d.tstate));
    synchronize_device();
    const std::vector<float> whole = d.output(c), whole_state = d.final_state(c);
    const auto part = tokens;
    DeviceBuffer mid(c.B * c.H * c.DK * c.DV * 4);
    const TensorView tmid = TensorView::contiguous(mid.get(), DType::F32, {c.B, c.H, c.DK, c.DV});
    d.out.fill(0xff);
    const int64_t rest = c.T - split;
    linear_attention(part(d.tq, 0, split), part(d.tk, 0, split), part(d.tv, 0, split),
                     part(d.tout, 0, split),
                     with(part(*d.tg, 0, split), d.th0, tmid));
    linear_attention(part(d.tq, split, rest), part(d.tk, split, rest), part(d.tv, split, rest),
                     part(d.tout, split, rest),
                     with(part(*d.tg, split, rest), tmid, d.tstate));
    synchronize_device();
    const std::vector<float> halves = d.output(c), halves_state = d.final_state(c);
    INFO("split at " << split);
    if (split % 64 == 0) {  // the same chunks: the same arithmetic
      CHECK(halves == whole);
      CHECK(halves_state == whole_state);
    } else {
      const LinearReferenceResult r = reference_linear_attention(c.reference());
      const LinearAccuracy a = check_linear_accuracy(r, halves, halves_state);
      INFO(a.summary());
      CHECK(a.pass);
    }
  }
}

TEST_CASE("linear attention: a positive gate makes its head NaN and only its head",
          "[linear][gpu]") {
  SKIP_WITHOUT_GPU();
  LinearCase c;
  c.T = 200, c.H = 2, c.Hk = 2;
  c.fill();
  c.g[(1 * c.T + 70) * c.DK + 3] = 0.5f;  // head 1, token 70
  DeviceCase d(c);
  linear_attention(d.tq, d.tk, d.tv, d.tout, with(d.tg, {}, d.tstate));
  synchronize_device();
  const std::vector<float> out = d.output(c);
  const int64_t per_head = c.T * c.DV;
  CHECK(std::all_of(out.begin(), out.begin() + per_head, [](float x) { return std::isfinite(x); }));
  CHECK(std::all_of(out.begin() + per_head + 70 * c.DV, out.begin() + 2 * per_head,
                    [](float x) { return std::isnan(x); }));
}

TEST_CASE("linear attention with a feature map: forward, backward and the step", "[linear][gpu]") {
  SKIP_WITHOUT_GPU();
  const FeatureMap maps[] = {FeatureMap::parse("where(x > 0, x + 1, exp(x))"),
                             FeatureMap::parse("x * x * 0.5 + x")};
  int i = 0;
  for (DType dt : {DType::BF16, DType::F16})
    for (auto [dk, dv] : {std::pair{64, 64}, {128, 128}, {128, 64}})
      for (Gates gates : {Gates::PerDim, Gates::None}) {
        LinearCase c;
        c.dtype = dt, c.DK = dk, c.DV = dv, c.gates = gates, c.fmap = maps[i % 2];
        c.T = i % 3 == 0 ? 65 : 200, c.H = 4, c.Hk = i % 2 ? 2 : 4, c.initial = i % 2 == 0;
        ++i;
        const LinearAccuracy a = run_chunked(c);
        INFO(c.describe() << ": " << a.summary());
        CHECK(a.pass);
        const BackwardAccuracy b = run_backward(c, true);
        INFO(c.describe() << ": backward " << b.summary());
        CHECK(b.pass);
      }
  // The step: a chunkwise prefill, then single tokens, all through the map.
  LinearCase c;
  c.DK = c.DV = 128, c.gates = Gates::PerStep, c.T = 70, c.H = 2, c.Hk = 1, c.B = 2;
  c.fmap = maps[0];
  c.fill();
  DeviceCase d(c);
  const auto part = tokens;
  LinearOptions o = with(part(*d.tg, 0, 64), {}, d.tstate);
  o.feature_map = c.fmap;
  linear_attention(part(d.tq, 0, 64), part(d.tk, 0, 64), part(d.tv, 0, 64), part(d.tout, 0, 64),
                   o);
  for (int64_t t = 64; t < 70; ++t) {
    LinearOptions so = with(part(*d.tg, t, 1));
    so.feature_map = c.fmap;
    linear_attention_step(part(d.tq, t, 1), part(d.tk, t, 1), part(d.tv, t, 1), *d.tstate,
                          part(d.tout, t, 1), so);
  }
  synchronize_device();
  const LinearAccuracy a =
      check_linear_accuracy(reference_linear_attention(c.reference()), d.output(c),
                            d.final_state(c));
  INFO(c.describe() << ", step: " << a.summary());
  CHECK(a.pass);
}

TEST_CASE("the recurrent step equals the reference token by token, from a chunkwise state",
          "[linear][gpu]") {
  SKIP_WITHOUT_GPU();
  for (DType dt : {DType::BF16, DType::F16})
    for (auto [dk, dv] : {std::pair{64, 128}, {128, 128}})
      for (Gates gates : {Gates::PerDim, Gates::PerStep, Gates::PerHead, Gates::None}) {
        // Prefill 300 tokens chunkwise, then 5 single steps, then one call of 7 tokens.
        LinearCase c;
        c.dtype = dt, c.DK = dk, c.DV = dv, c.gates = gates, c.T = 312, c.H = 4, c.Hk = 2;
        c.B = 2, c.initial = true;
        c.fill();
        DeviceCase d(c);
        const auto part = tokens;
        auto gpart = [&](int64_t t0, int64_t len) {
          return d.tg ? std::optional<TensorView>(part(*d.tg, t0, len)) : std::nullopt;
        };
        linear_attention(part(d.tq, 0, 300), part(d.tk, 0, 300), part(d.tv, 0, 300),
                         part(d.tout, 0, 300),
                         with(gpart(0, 300), d.th0, d.tstate));
        for (int64_t t = 300; t < 305; ++t)
          linear_attention_step(part(d.tq, t, 1), part(d.tk, t, 1), part(d.tv, t, 1), *d.tstate,
                                part(d.tout, t, 1), with(gpart(t, 1)));
        linear_attention_step(part(d.tq, 305, 7), part(d.tk, 305, 7), part(d.tv, 305, 7),
                              *d.tstate, part(d.tout, 305, 7), with(gpart(305, 7)));
        synchronize_device();
        const LinearReferenceResult r = reference_linear_attention(c.reference());
        const LinearAccuracy a = check_linear_accuracy(r, d.output(c), d.final_state(c));
        INFO(c.describe() << ": " << a.summary());
        CHECK(a.pass);
      }
}

TEST_CASE("linear attention backward matches the float64 reference: gates, dtypes, head dims, "
          "lengths", "[linear][gpu]") {
  SKIP_WITHOUT_GPU();
  const int64_t lengths[] = {1, 63, 64, 65, 1000};
  for_kernel_configs([&](LinearCase& c, int i) {
    c.T = lengths[i % 5];
    c.B = 1 + i % 2, c.H = 2, c.Hk = i % 3 == 0 ? 1 : 2;  // GQA every third case
    c.initial = i % 2 == 0;
    const bool dstate = i % 4 != 1;
    const BackwardAccuracy a = run_backward(c, dstate);
    INFO(c.describe() << (dstate ? ", final state's gradient" : "") << ": " << a.summary());
    CHECK(a.pass);
  });
}

TEST_CASE("linear attention backward: strong and weak gates, lengths around a chunk, 4096",
          "[linear][gpu]") {
  SKIP_WITHOUT_GPU();
  for (Strength s : {Strength::Strong, Strength::Weak})
    for (Gates gates : {Gates::PerDim, Gates::PerStep})
      for (int64_t T : {17, 64, 129}) {
        LinearCase c;
        c.DK = c.DV = 128, c.T = T, c.gates = gates, c.strength = s, c.initial = true;
        const BackwardAccuracy a = run_backward(c, true);
        INFO(c.describe() << ": " << a.summary());
        CHECK(a.pass);
      }
  LinearCase c;
  c.DK = c.DV = 128, c.T = 4096, c.H = 2, c.Hk = 1, c.gates = Gates::PerDim, c.initial = true;
  const BackwardAccuracy a = run_backward(c, true);
  INFO(c.describe() << ": " << a.summary());
  CHECK(a.pass);
}
