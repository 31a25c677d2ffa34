// The float64 CPU reference for flexc::attention (see include/flexc/reference.h).
#include "flexc/reference.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "attention/attention_args.h"
#include "dsl/analysis.h"
#include "flexc/error.h"
#include "reference/reference_common.h"

namespace flexc {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

}  // namespace

namespace detail {

ReferenceInputs check_reference_inputs(const VariantImpl& impl, const ReferenceProblem& p,
                                       const std::string& what) {
  const int64_t B = p.batch, Hq = p.q_heads, Hkv = p.kv_heads, Lq = p.q_len, Lkv = p.kv_len,
                D = p.head_dim, Dv = p.v_head_dim ? p.v_head_dim : D;
  if (B < 1 || Hq < 1 || Hkv < 1 || Hq % Hkv != 0 || Lq < 0 || Lkv < 0 || D < 1 || Dv < 1)
    throw Error(fmt::format("{}: bad sizes B {}, Hq {}, Hkv {}, Q_LEN {}, KV_LEN {}, D {}, Dv {}",
                            what, B, Hq, Hkv, Lq, Lkv, D, Dv));
  auto check_size = [&](const char* name, size_t got, int64_t want) {
    if (static_cast<int64_t>(got) != want)
      throw Error(fmt::format("{}: {} has {} values; its shape needs {}", what, name, got, want));
  };
  check_size("q", p.q.size(), B * Hq * Lq * D);
  check_size("k", p.k.size(), B * Hkv * Lkv * D);
  check_size("v", p.v.size(), B * Hkv * Lkv * Dv);
  if (p.dtype != DType::BF16 && p.dtype != DType::F16)
    throw Error(fmt::format("{}: dtype must be bf16 or fp16, not {}", what, dtype_name(p.dtype)));
  ReferenceInputs in;
  in.scale = p.scale.value_or(1.0 / std::sqrt(static_cast<double>(D)));
  in.params = resolve_params(impl, p.params, what);
  if (!p.kv_lens.empty() || !p.q_offsets.empty()) {
    if (p.kv_lens.size() != static_cast<size_t>(B) ||
        (!p.q_offsets.empty() && p.q_offsets.size() != static_cast<size_t>(B)))
      throw Error(
          fmt::format("{}: kv_lens ({}) and q_offsets ({}, or none) need one value per "
                      "batch ({})",
                      what, p.kv_lens.size(), p.q_offsets.size(), B));
    for (int64_t len : p.kv_lens)
      if (len < 0 || len > Lkv)
        throw Error(
            fmt::format("{}: kv_lens value {} is outside [0, KV_LEN = {}]", what, len, Lkv));
  }
  if (!p.kv_lens.empty() &&
      (p.q_offset != 0 || p.kv_offset != 0 || p.seq_q_len != 0 || p.seq_kv_len != 0))
    throw Error(
        fmt::format("{}: q_offset, kv_offset, seq_q_len and seq_kv_len are for prefill "
                    "(decode takes kv_lens and q_offsets)",
                    what));
  // Decode positions index one sequence: captures' Q_LEN dims are the cache's length.
  in.pos = p.kv_lens.empty()
               ? resolve_positions(what, Lq, Lkv, p.q_offset, p.kv_offset, p.seq_q_len,
                                   p.seq_kv_len, std::numeric_limits<int32_t>::max())
               : Positions{0, 0, Lkv, Lkv};
  const auto views =
      resolve_captures(impl, p.captures, {B, Hq, in.pos.seq_q_len, in.pos.seq_kv_len}, what);
  in.captures.resize(views.size());
  for (size_t slot = 0; slot < views.size(); ++slot) {
    if (!views[slot]) continue;
    const TensorView& t = *views[slot];
    in.captures[slot] = {to_dsl(t.dtype), t.data, t.shape, t.strides};
  }
  return in;
}

}  // namespace detail

ReferenceResult reference_attention(const Variant& v, const ReferenceProblem& p) {
  const detail::VariantImpl& impl = detail::impl_of(v);
  const std::string what = fmt::format("reference attention for '{}'", impl.name);
  const int64_t B = p.batch, Hq = p.q_heads, Hkv = p.kv_heads, Lq = p.q_len, Lkv = p.kv_len,
                D = p.head_dim, Dv = p.v_head_dim ? p.v_head_dim : D;
  const detail::ReferenceInputs in = detail::check_reference_inputs(impl, p, what);
  const double scale = in.scale;
  const std::vector<double>& params = in.params;
  const std::vector<dsl::HostTensor>& captures = in.captures;

  ReferenceResult r;
  r.rows = p.rows;
  if (r.rows.empty()) {
    r.rows.resize(B * Hq * Lq);
    for (int64_t i = 0; i < B * Hq * Lq; ++i) r.rows[i] = i;
  }
  for (int64_t row : r.rows)
    if (row < 0 || row >= B * Hq * Lq)
      throw Error(fmt::format("{}: row {} is out of range [0, {})", what, row, B * Hq * Lq));
  const int64_t n = static_cast<int64_t>(r.rows.size());
  r.gold_out.assign(n * Dv, 0), r.ref_out.assign(n * Dv, 0);
  r.gold_lse.assign(n, -kInf), r.ref_lse.assign(n, -kInf);

  const dsl::Graph& score = impl.score.graph;
  const dsl::Graph& mask = impl.mask.graph;
  const bool identity = dsl::is_identity_score(score, score.root);
  const bool all_true = dsl::is_all_true_mask(mask, mask.root);
  detail::parallel_chunks(n, 8, [&](int64_t begin, int64_t end) {
    std::vector<double> s(Lkv), s32(Lkv), gold(Dv), ref(Dv);
    std::vector<dsl::Value> scratch;
    dsl::EvalEnv env;
    env.params = params;
    env.captures = captures;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = r.rows[i];
      const int64_t b = row / (Hq * Lq), h = row / Lq % Hq, qi = row % Lq, hk = h / (Hq / Hkv);
      const float* q = p.q.data() + row * D;
      // The row's position, its keys and the lengths the mods see.
      int64_t pos = in.pos.q_offset + qi, keys = Lkv, hook_q_len = in.pos.seq_q_len,
              hook_kv_len = in.pos.seq_kv_len;
      if (!p.kv_lens.empty()) {
        keys = hook_kv_len = p.kv_lens[b];
        pos = (p.q_offsets.empty() ? keys - Lq : p.q_offsets[b]) + qi;
        hook_q_len = pos - qi + Lq;
        if (pos < 0 || pos >= Lkv) continue;  // no keys: output 0, LSE -inf
      }
      env.ints = {0, b, h, pos, 0, hook_q_len, hook_kv_len};
      double mx = -kInf, mx32 = -kInf;
      for (int64_t j = 0; j < keys; ++j) {
        const float* k = p.k.data() + ((b * Hkv + hk) * Lkv + j) * D;
        double dot = 0;
        for (int64_t d = 0; d < D; ++d) dot += static_cast<double>(q[d]) * k[d];
        double x = dot * scale;
        // The kernels' rounding points: an fp32 dot product times the fp32 scale, then score_mod
        // in float32 (the interpreter's F32 mode is what the emitted code computes).
        double x32 = static_cast<float>(dot) * static_cast<float>(scale);
        env.ints[static_cast<int>(dsl::Input::KvIdx)] = in.pos.kv_offset + j;
        if (!identity) {
          env.score = x;
          x = dsl::evaluate(score, env, dsl::Precision::F64, scratch).f;
          env.score = x32;
          x32 = dsl::evaluate(score, env, detail::reference_math(impl), scratch).f;
        }
        // The mask decides in float32, as the kernels do: a bit that flips between precisions
        // is not a rounding error to tolerate.
        if (!all_true && dsl::evaluate(mask, env, dsl::Precision::F32, scratch).i == 0) x = -kInf;
        s[j] = x;
        s32[j] = x == -kInf ? -std::numeric_limits<float>::infinity() : static_cast<float>(x32);
        mx = std::max(mx, x);
        mx32 = std::max(mx32, s32[j]);
      }
      if (mx == -kInf) continue;  // no unmasked element: output 0, LSE -inf
      std::fill(gold.begin(), gold.end(), 0.0);
      std::fill(ref.begin(), ref.end(), 0.0);
      double l = 0, l32 = 0;
      for (int64_t j = 0; j < keys; ++j) {
        if (s[j] == -kInf) continue;
        const double pg = std::exp(s[j] - mx), pr = std::exp(s32[j] - mx32);
        const double pr16 = detail::round_to(p.dtype, pr);
        l += pg, l32 += pr;
        const float* vv = p.v.data() + ((b * Hkv + hk) * Lkv + j) * Dv;
        for (int64_t d = 0; d < Dv; ++d) gold[d] += pg * vv[d], ref[d] += pr16 * vv[d];
      }
      for (int64_t d = 0; d < Dv; ++d) {
        r.gold_out[i * Dv + d] = gold[d] / l;
        r.ref_out[i * Dv + d] = detail::round_to(p.dtype, ref[d] / l32);
      }
      r.gold_lse[i] = mx + std::log(l);
      r.ref_lse[i] = static_cast<float>(mx32 + std::log(l32));
    }
  });
  return r;
}

std::string Accuracy::summary() const {
  return fmt::format(
      "out rmse {:.3g} (ref {:.3g}), lse rmse {:.3g} (ref {:.3g}), {} bad, {} masked "
      "rows: {}",
      out_rmse, out_ref_rmse, lse_rmse, lse_ref_rmse, bad, masked_rows, pass ? "PASS" : "FAIL");
}

Accuracy check_accuracy(const ReferenceResult& r, std::span<const float> out,
                        std::span<const float> lse) {
  const size_t n = r.rows.size();
  const size_t D = n ? r.gold_out.size() / n : 0;
  if (out.size() != n * D)
    throw Error(
        fmt::format("check_accuracy: {} output values for {} rows of {}", out.size(), n, D));
  if (!lse.empty() && lse.size() != n)
    throw Error(fmt::format("check_accuracy: {} LSE values for {} rows", lse.size(), n));
  Accuracy a;
  double eo = 0, ero = 0, el = 0, erl = 0;
  size_t no = 0, nl = 0;
  for (size_t i = 0; i < n; ++i) {
    if (r.gold_lse[i] == -kInf) {  // exactly 0 and -inf, never NaN
      ++a.masked_rows;
      bool ok = lse.empty() || lse[i] == -std::numeric_limits<float>::infinity();
      for (size_t d = 0; d < D; ++d) ok = ok && out[i * D + d] == 0.f;
      a.bad += !ok;
      continue;
    }
    for (size_t d = 0; d < D; ++d) {
      const double k = out[i * D + d], g = r.gold_out[i * D + d], rf = r.ref_out[i * D + d];
      a.bad += !std::isfinite(k);
      eo += (k - g) * (k - g), ero += (rf - g) * (rf - g), ++no;
    }
    if (!lse.empty()) {
      const double k = lse[i], g = r.gold_lse[i], rf = r.ref_lse[i];
      a.bad += !std::isfinite(k);
      el += (k - g) * (k - g), erl += (rf - g) * (rf - g), ++nl;
    }
  }
  a.out_rmse = no ? std::sqrt(eo / no) : 0, a.out_ref_rmse = no ? std::sqrt(ero / no) : 0;
  a.lse_rmse = nl ? std::sqrt(el / nl) : 0, a.lse_ref_rmse = nl ? std::sqrt(erl / nl) : 0;
  a.pass = a.bad == 0 && a.out_rmse <= 1.5 * a.out_ref_rmse + 1e-6 &&
           a.lse_rmse <= 1.5 * a.lse_ref_rmse + 1e-6;
  return a;
}

}  // namespace flexc
