// The float64 CPU reference for flexc::attention_backward, and its tolerance rule (see
// include/flexc/reference.h).
#include <fmt/format.h>

#include <atomic>
#include <cmath>
#include <limits>

#include "dsl/analysis.h"
#include "flexc/error.h"
#include "flexc/reference.h"
#include "reference/reference_common.h"

namespace flexc {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

void add(double& x, double v) {
  std::atomic_ref<double>(x).fetch_add(v, std::memory_order_relaxed);
}

// score_mod's value and derivatives at one element, in float64 (gold) and float32 (ref).
struct Derivatives {
  dsl::Graph graph;                        // the score_mod with its derivatives added
  dsl::NodeId dscore = 0;                  // d score_mod / d score
  std::vector<dsl::LoadDerivative> loads;  // d score_mod / d each differentiable load
  dsl::NodeId last = 0;                    // every node to evaluate is at or below it
  bool identity = false;
};

Derivatives derivatives(const detail::VariantImpl& impl) {
  Derivatives d;
  d.graph = impl.score.graph;
  dsl::Graph& g = d.graph;
  d.identity = dsl::is_identity_score(g, g.root);
  d.dscore = dsl::simplify_into(g, dsl::derivative_wrt_score(g, g.root));
  d.loads = dsl::derivatives_wrt_loads(g, g.root);
  d.last = std::max(g.root, d.dscore);
  for (dsl::LoadDerivative& ld : d.loads) {
    ld.derivative = dsl::simplify_into(g, ld.derivative);
    d.last = std::max({d.last, ld.derivative, ld.load});
  }
  return d;
}

// One element (row, kv_idx) of the backward: P and dS in gold and ref, and where each
// differentiable load's gradient goes with its derivative.
struct Element {
  bool gold = false, ref = false;          // does it contribute (unmasked, P > 0)?
  double p = 0, dscore = 0, ds = 0;        // gold: P, P (dP - delta), dscore d score_mod
  double dscore_mag = 0, ds_mag = 0;       // the same with |dP| + |delta| for dP - delta
  double p16 = 0, dscore32 = 0, ds16 = 0;  // ref: the same at the kernel's rounding points
  std::vector<int64_t> offsets;            // per load: the element of its capture (contiguous)
  std::vector<double> dload, dload32;      // per load: d score_mod / d element
};

}  // namespace

ReferenceBackward reference_attention_backward(const Variant& variant,
                                               const ReferenceBackwardProblem& bp) {
  const detail::VariantImpl& impl = detail::impl_of(variant);
  const ReferenceProblem& p = bp.forward;
  const std::string what = fmt::format("reference backward for '{}'", impl.name);
  if (p.v_head_dim != 0 && p.v_head_dim != p.head_dim)
    throw Error(fmt::format("{}: v_head_dim {} differs from head_dim {} (the backward takes one)",
                            what, p.v_head_dim, p.head_dim));
  const detail::ReferenceInputs in = detail::check_reference_inputs(impl, p, what);
  const int64_t B = p.batch, Hq = p.q_heads, Hkv = p.kv_heads, Lq = p.q_len, Lkv = p.kv_len,
                D = p.head_dim, rows = B * Hq * Lq, group = Hq / Hkv;
  auto check_size = [&](const char* name, size_t got, int64_t want) {
    if (static_cast<int64_t>(got) != want)
      throw Error(fmt::format("{}: {} has {} values; its shape needs {}", what, name, got, want));
  };
  check_size("dout", bp.dout.size(), rows * D);
  if (!bp.dlse.empty()) check_size("dlse", bp.dlse.size(), rows);
  if (bp.out.empty() != bp.lse.empty())
    throw Error(fmt::format("{}: give both out and lse, or neither", what));
  if (!bp.out.empty())
    check_size("out", bp.out.size(), rows * D), check_size("lse", bp.lse.size(), rows);

  // Per row: LSE and delta = rowsum(dout * out) - dlse, gold and ref (float32, as the kernel).
  std::vector<double> lse_g(rows), lse_r(rows), delta_g(rows, 0), delta_r(rows, 0);
  {
    std::vector<double> out_g, out_r;
    if (bp.out.empty()) {
      ReferenceProblem all = p;
      all.rows.clear();
      ReferenceResult f = reference_attention(variant, all);
      lse_g = std::move(f.gold_lse), lse_r = std::move(f.ref_lse);
      out_g = std::move(f.gold_out), out_r = std::move(f.ref_out);
    } else {
      lse_g.assign(bp.lse.begin(), bp.lse.end()), lse_r = lse_g;
      out_g.assign(bp.out.begin(), bp.out.end()), out_r = out_g;
    }
    for (int64_t r = 0; r < rows; ++r) {
      const double dlse = bp.dlse.empty() ? 0 : bp.dlse[r];
      for (int64_t d = 0; d < D; ++d) {
        delta_g[r] += double(bp.dout[r * D + d]) * out_g[r * D + d];
        delta_r[r] += double(bp.dout[r * D + d]) * out_r[r * D + d];
      }
      delta_g[r] -= dlse;
      delta_r[r] = static_cast<float>(delta_r[r] - dlse);
    }
  }

  const Derivatives der = derivatives(impl);
  const dsl::Graph& mask = impl.mask.graph;
  const bool all_true = dsl::is_all_true_mask(mask, mask.root);

  ReferenceBackward out;
  for (ReferenceGradient* g : {&out.dq, &out.dk, &out.dv}) {
    const size_t n = g == &out.dq ? rows * D : B * Hkv * Lkv * D;
    g->gold.assign(n, 0), g->ref.assign(n, 0), g->magnitude.assign(n, 0);
  }
  // Each load's gradient tensor (several loads may read one capture).
  std::vector<ReferenceGradient*> load_grad;
  std::vector<std::vector<int64_t>> load_shape;
  for (const dsl::LoadDerivative& ld : der.loads) {
    const uint16_t slot = der.graph[ld.load].slot;
    const dsl::HostTensor& t = in.captures[slot];
    ReferenceGradient& g = out.captures[impl.capture_specs[slot].name];
    int64_t n = 1;
    for (int64_t dim : t.shape) n *= dim;
    if (g.gold.empty()) g.gold.assign(n, 0), g.ref.assign(n, 0), g.magnitude.assign(n, 0);
    load_grad.push_back(&g);
    load_shape.push_back(t.shape);
  }
  const size_t nloads = der.loads.size();

  const float scale32 = static_cast<float>(in.scale);
  const auto at_q = [&](int64_t b, int64_t h, int64_t i) { return ((b * Hq + h) * Lq + i) * D; };
  const auto at_kv = [&](int64_t b, int64_t hk, int64_t j) {
    return ((b * Hkv + hk) * Lkv + j) * D;
  };

  // Computes element (b, h, i, j) into e; env and scratch belong to the calling thread.
  const auto element = [&](dsl::EvalEnv& env, std::vector<dsl::Value>& scratch, int64_t b,
                           int64_t h, int64_t i, int64_t j, Element& e) {
    const int64_t row = (b * Hq + h) * Lq + i, hk = h / group;
    const float* q = p.q.data() + at_q(b, h, i);
    const float* k = p.k.data() + at_kv(b, hk, j);
    const float* v = p.v.data() + at_kv(b, hk, j);
    const float* dout = bp.dout.data() + at_q(b, h, i);
    e.gold = e.ref = false;
    env.ints = {
        0, b, h, in.pos.q_offset + i, in.pos.kv_offset + j, in.pos.seq_q_len, in.pos.seq_kv_len};
    if (!all_true && dsl::evaluate(mask, env, dsl::Precision::F32, scratch).i == 0) return;
    double dot = 0, dp = 0;
    for (int64_t d = 0; d < D; ++d) dot += double(q[d]) * k[d], dp += double(dout[d]) * v[d];
    const double x = dot * in.scale;
    const double x32 = static_cast<float>(dot) * scale32;
    double s = x, grad = 1, s32 = x32, grad32 = 1;
    if (!der.identity) {
      env.score = x;
      dsl::evaluate(der.graph, der.last, env, dsl::Precision::F64, scratch);
      s = scratch[der.graph.root].f, grad = scratch[der.dscore].f;
      for (size_t l = 0; l < nloads; ++l) {
        e.offsets[l] =
            dsl::load_offset(der.graph[der.loads[l].load], scratch.data(), load_shape[l], {});
        e.dload[l] = scratch[der.loads[l].derivative].f;
      }
      env.score = x32;
      dsl::evaluate(der.graph, der.last, env, detail::reference_math(impl), scratch);
      s32 = scratch[der.graph.root].f, grad32 = scratch[der.dscore].f;
      for (size_t l = 0; l < nloads; ++l) e.dload32[l] = scratch[der.loads[l].derivative].f;
    }
    if (s != -kInf && lse_g[row] != -kInf) {
      e.p = std::exp(s - lse_g[row]);
      e.dscore = e.p * (dp - delta_g[row]);
      e.ds = e.dscore * grad;
      e.dscore_mag = e.p * (std::abs(dp) + std::abs(delta_g[row]));
      e.ds_mag = e.dscore_mag * std::abs(grad);
      e.gold = e.p != 0;
    }
    if (s32 != -kInf && lse_r[row] != -kInf) {
      const float p32 = static_cast<float>(std::exp(s32 - lse_r[row]));
      e.p16 = detail::round_to(p.dtype, p32);
      e.dscore32 =
          static_cast<float>(p32 * static_cast<float>(static_cast<float>(dp) - delta_r[row]));
      // The kernels' order: (P d score_mod / d score) (dP - delta) (online_softmax.cuh).
      e.ds16 = detail::round_to(
          p.dtype, static_cast<float>(static_cast<float>(p32 * grad32) *
                                      static_cast<float>(static_cast<float>(dp) - delta_r[row])));
      e.ref = p32 != 0;
    }
  };
  // What each thread evaluates with.
  struct Worker {
    dsl::EvalEnv env;
    Element e;
    std::vector<dsl::Value> scratch;
  };
  const auto worker = [&] {
    Worker w;
    w.env.params = in.params;
    w.env.captures = in.captures;
    w.e.offsets.resize(nloads), w.e.dload.resize(nloads), w.e.dload32.resize(nloads);
    return w;
  };
  // g[at + d] += coefficient * x[d] for d < D, in gold (with its magnitude) and in ref.
  const auto axpy = [&](ReferenceGradient& g, int64_t at, const float* x, const Element& e,
                        double gold, double magnitude, double ref) {
    if (e.gold)
      for (int64_t d = 0; d < D; ++d)
        g.gold[at + d] += gold * x[d], g.magnitude[at + d] += magnitude * std::abs(x[d]);
    if (e.ref)
      for (int64_t d = 0; d < D; ++d) g.ref[at + d] += ref * x[d];
  };

  // dq and the capture gradients, row by row.
  detail::parallel_chunks(rows, 4, [&](int64_t begin, int64_t end) {
    Worker w = worker();
    const Element& e = w.e;
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / (Hq * Lq), h = row / Lq % Hq, i = row % Lq;
      for (int64_t j = 0; j < Lkv; ++j) {
        element(w.env, w.scratch, b, h, i, j, w.e);
        const float* k = p.k.data() + at_kv(b, h / group, j);
        axpy(out.dq, row * D, k, e, in.scale * e.ds, in.scale * e.ds_mag, in.scale * e.ds16);
        for (size_t l = 0; l < nloads; ++l) {
          ReferenceGradient& g = *load_grad[l];
          if (e.gold) {
            add(g.gold[e.offsets[l]], e.dscore * e.dload[l]);
            add(g.magnitude[e.offsets[l]], e.dscore_mag * std::abs(e.dload[l]));
          }
          if (e.ref) add(g.ref[e.offsets[l]], static_cast<float>(e.dscore32 * e.dload32[l]));
        }
      }
    }
  });
  // dk and dv, kv row by kv row, summed over the query heads of the group.
  detail::parallel_chunks(B * Hkv * Lkv, 4, [&](int64_t begin, int64_t end) {
    Worker w = worker();
    const Element& e = w.e;
    for (int64_t kv = begin; kv < end; ++kv) {
      const int64_t b = kv / (Hkv * Lkv), hk = kv / Lkv % Hkv, j = kv % Lkv;
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h)
        for (int64_t i = 0; i < Lq; ++i) {
          element(w.env, w.scratch, b, h, i, j, w.e);
          const float* q = p.q.data() + at_q(b, h, i);
          const float* dout = bp.dout.data() + at_q(b, h, i);
          axpy(out.dk, kv * D, q, e, in.scale * e.ds, in.scale * e.ds_mag, in.scale * e.ds16);
          axpy(out.dv, kv * D, dout, e, e.p, e.p, e.p16);
        }
    }
  });
  for (ReferenceGradient* g : {&out.dq, &out.dk, &out.dv})
    for (double& x : g->ref) x = detail::round_to(p.dtype, x);
  for (auto& [name, g] : out.captures)
    for (double& x : g.ref) x = static_cast<float>(x);
  return out;
}

std::string BackwardAccuracy::summary() const {
  std::string s;
  int64_t bad = 0;
  for (const GradientAccuracy& g : grads) {
    s += fmt::format("{} rmse {:.3g} (ref {:.3g}){}, ", g.name, g.rmse, g.ref_rmse,
                     g.pass ? "" : " FAIL");
    bad += g.bad;
  }
  return s + fmt::format("{} bad: {}", bad, pass ? "PASS" : "FAIL");
}

BackwardAccuracy check_gradients(
    const ReferenceBackward& r, std::span<const float> dq, std::span<const float> dk,
    std::span<const float> dv,
    const std::map<std::string, std::span<const float>, std::less<>>& captures) {
  BackwardAccuracy a;
  const auto check = [&](const std::string& name, const ReferenceGradient& g,
                         std::span<const float> kernel) {
    if (kernel.size() != g.gold.size())
      throw Error(fmt::format("check_gradients: {} has {} values; the reference has {}", name,
                              kernel.size(), g.gold.size()));
    GradientAccuracy ga;
    ga.name = name;
    double e = 0, er = 0, m = 0;
    for (size_t i = 0; i < kernel.size(); ++i) {
      const double k = kernel[i], gold = g.gold[i];
      ga.bad += !std::isfinite(k) || (g.magnitude[i] == 0 && k != 0);
      e += (k - gold) * (k - gold), er += (g.ref[i] - gold) * (g.ref[i] - gold);
      m += g.magnitude[i] * g.magnitude[i];
    }
    const double n = std::max<double>(1, kernel.size());
    ga.rmse = std::sqrt(e / n), ga.ref_rmse = std::sqrt(er / n);
    ga.floor = std::ldexp(std::sqrt(m / n), -16);
    ga.pass = ga.bad == 0 && ga.rmse <= 1.5 * ga.ref_rmse + ga.floor + 1e-6;
    a.grads.push_back(ga);
  };
  check("dq", r.dq, dq);
  check("dk", r.dk, dk);
  check("dv", r.dv, dv);
  for (const auto& [name, g] : r.captures) {
    const auto it = captures.find(name);
    if (it == captures.end())
      throw Error(fmt::format("check_gradients: no kernel gradient for capture '{}'", name));
    check(name, g, it->second);
  }
  for (const auto& [name, span] : captures)
    if (!r.captures.contains(name))
      throw Error(fmt::format("check_gradients: capture '{}' has no reference gradient", name));
  a.pass = std::all_of(a.grads.begin(), a.grads.end(), [](const auto& g) { return g.pass; });
  return a;
}

}  // namespace flexc
