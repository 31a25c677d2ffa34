// The backward CPU reference (CI): its float64 gradients against central finite differences of
// the forward reference, for score_mods with nontrivial derivatives, masks, -inf scores, GQA,
// dlse and learnable captures; its rounded `ref`; and the gradient tolerance rule.
#include <fmt/format.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <limits>

#include "flexc/error.h"
#include "flexc/reference.h"
#include "flexc/variant.h"
#include "test_random.h"
#include "test_tensors.h"

using flexc::testing::round16;
using flexc::testing::rows_of;

using namespace flexc;
using flexc::testing::normal;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

struct Capture {
  std::vector<float> data;
  std::vector<int64_t> shape;
};

// A small problem with its tensors and the loss sum(out * dout) + sum(lse * dlse) over rows with
// an unmasked element.
struct Case {
  int64_t B = 2, Hq = 4, Hkv = 2, Lq = 5, Lkv = 7, D = 8;
  std::vector<float> q, k, v, dout, dlse;
  std::map<std::string, Capture, std::less<>> captures;

  Case() {
    q = normal(B * Hq * Lq * D, DType::BF16);
    k = normal(B * Hkv * Lkv * D, DType::BF16);
    v = normal(B * Hkv * Lkv * D, DType::BF16);
    dout = normal(q.size(), DType::BF16);
    dlse = normal(B * Hq * Lq, DType::BF16);
  }
  ReferenceProblem problem() const {
    ReferenceProblem p;
    p.q = q, p.k = k, p.v = v;
    p.batch = B, p.q_heads = Hq, p.kv_heads = Hkv, p.q_len = Lq, p.kv_len = Lkv, p.head_dim = D;
    for (const auto& [name, c] : captures)
      p.captures[name] = TensorView::contiguous(c.data.data(), DType::F32, c.shape);
    return p;
  }
  double loss(const Variant& variant) const {
    const ReferenceResult r = reference_attention(variant, problem());
    double l = 0;
    for (size_t i = 0; i < r.gold_out.size(); ++i) l += r.gold_out[i] * dout[i];
    for (size_t i = 0; i < r.gold_lse.size(); ++i)
      if (r.gold_lse[i] != -kInf) l += r.gold_lse[i] * dlse[i];
    return l;
  }
};

// Central differences of the loss in each element of x, against `gold`. The step is exact in
// float32 for |x| < 32 and small enough that no score crosses a kink of the tested mods.
void check_against_differences(const Variant& variant, Case& c, std::vector<float>& x,
                               const std::vector<double>& gold, const std::string& what) {
  REQUIRE(x.size() == gold.size());
  const double h = std::ldexp(1.0, -18);
  double err = 0, norm = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const float saved = x[i];
    x[i] = static_cast<float>(saved + h);
    const double up = c.loss(variant);
    x[i] = static_cast<float>(saved - h);
    const double down = c.loss(variant);
    x[i] = saved;
    const double fd = (up - down) / (2 * h);
    err = std::max(err, std::abs(fd - gold[i]));
    norm = std::max(norm, std::abs(gold[i]));
  }
  INFO(fmt::format("{} '{}': max |finite difference - gold| {:.3g}, max |gold| {:.3g}", what,
                   variant.name(), err, norm));
  CHECK(norm > 0);
  CHECK(err <= 1e-6 * std::max(1.0, norm));
}

ReferenceBackward backward(const Variant& variant, const Case& c) {
  ReferenceBackwardProblem bp;
  bp.forward = c.problem();
  bp.dout = c.dout;
  bp.dlse = c.dlse;
  return reference_attention_backward(variant, bp);
}

std::vector<float> as_float(const std::vector<double>& v) { return {v.begin(), v.end()}; }

}  // namespace

TEST_CASE("the backward reference is the gradient of the forward reference", "[reference]") {
  const std::vector<CaptureSpec> gain_bias{{"gain", "float32", {"H"}}, {"bias", "float32", {"H", "3"}}};
  const std::vector<CaptureSpec> full{{"bias", "float32", {"B", "H", "Q_LEN", "KV_LEN"}}};
  const Variant variants[] = {
      Variant::from_catalogue("noop"),
      Variant::from_catalogue("softcap"),
      Variant::from_strings("score", "q_idx >= 2 && kv_idx <= q_idx + 1", {}, {}, "late_rows"),
      Variant::from_strings("score * score / 8.0", "true", {}, {}, "square"),
      Variant::from_strings("score > 0 ? score : score * 0.5", "true", {}, {}, "leaky"),
      Variant::from_strings("kv_idx % 3 == 0 ? -inf : exp(score / 4.0)", "true", {}, {}, "holes"),
      Variant::from_catalogue("alibi"),
      Variant::from_catalogue("t5_bias"),
      Variant::from_strings("score * gain[h] + bias[h, kv_idx % 3] * bias[h, q_idx % 3]", "true",
                            gain_bias, {}, "two_loads"),
      Variant::from_strings("score + bias[b, h, q_idx, kv_idx]", "true", full, {}, "full_bias"),
  };
  for (const Variant& variant : variants) {
    Case c;
    for (const CaptureSpec& spec : variant.captures()) {
      Capture cap;
      for (const std::string& d : spec.dims)
        cap.shape.push_back(d == "H" ? c.Hq : d == "B" ? c.B : d == "Q_LEN" ? c.Lq
                                            : d == "KV_LEN" ? c.Lkv : std::stoll(d));
      int64_t n = 1;
      for (int64_t d : cap.shape) n *= d;
      cap.data = normal(n, DType::BF16, 0.5f);
      c.captures[spec.name] = cap;
    }
    const ReferenceBackward r = backward(variant, c);
    check_against_differences(variant, c, c.q, r.dq.gold, "dq");
    check_against_differences(variant, c, c.k, r.dk.gold, "dk");
    check_against_differences(variant, c, c.v, r.dv.gold, "dv");
    CHECK(r.captures.size() == c.captures.size());
    for (auto& [name, g] : r.captures)
      check_against_differences(variant, c, c.captures.at(name).data, g.gold, "d" + name);
  }
}

TEST_CASE("the backward reference: masked rows, ref's rounding, given out and lse", "[reference]") {
  const Variant late = Variant::from_strings("score", "q_idx >= 2 && kv_idx <= q_idx", {}, {}, "late");
  Case c;
  ReferenceBackward r = backward(late, c);
  // Rows 0 and 1 of every head have no unmasked element: dq 0, no contribution.
  for (int64_t row = 0; row < c.B * c.Hq * c.Lq; ++row)
    for (int64_t d = 0; d < c.D; ++d)
      if (row % c.Lq < 2) {
        CHECK(r.dq.gold[row * c.D + d] == 0);
        CHECK(r.dq.magnitude[row * c.D + d] == 0);
      }
  // ref rounds dq to bf16 and P / dS before their products: close to gold, not equal.
  const auto rel = [](const std::vector<double>& a, const std::vector<double>& b) {
    double e = 0, n = 0;
    for (size_t i = 0; i < a.size(); ++i) e += (a[i] - b[i]) * (a[i] - b[i]), n += b[i] * b[i];
    return std::sqrt(e / n);
  };
  for (const ReferenceGradient* g : {&r.dq, &r.dk, &r.dv}) {
    CHECK(rel(g->ref, g->gold) > 1e-4);
    CHECK(rel(g->ref, g->gold) < 2e-2);
    for (double x : g->ref) CHECK(x == static_cast<double>(round16(DType::BF16, float(x))));
  }
  // Given out and lse (here the float64 forward's, rounded to float32), gold is the same math.
  const ReferenceResult f = reference_attention(late, c.problem());
  const std::vector<float> out = as_float(f.gold_out), lse = as_float(f.gold_lse);
  ReferenceBackwardProblem bp;
  bp.forward = c.problem();
  bp.dout = c.dout, bp.dlse = c.dlse, bp.out = out, bp.lse = lse;
  const ReferenceBackward given = reference_attention_backward(late, bp);
  CHECK(rel(given.dq.gold, r.dq.gold) < 1e-5);
  CHECK(rel(given.dk.gold, r.dk.gold) < 1e-5);
  CHECK(rel(given.dv.gold, r.dv.gold) < 1e-5);

  bp.lse = {};
  CHECK_THROWS_WITH(reference_attention_backward(late, bp),
                    "reference backward for 'late': give both out and lse, or neither");
  bp.lse = lse;
  bp.dout = std::span<const float>(c.dout).first(3);
  CHECK_THROWS_WITH(reference_attention_backward(late, bp),
                    "reference backward for 'late': dout has 3 values; its shape needs 320");
}

TEST_CASE("the backward reference at positions: the blocks' gradients sum to the sequence's",
          "[reference]") {
  // Ring attention's backward: each (query block, key block) pair at its global positions,
  // given the whole sequence's out and LSE rows of its queries. dq of a query block is the sum
  // over key blocks, dk and dv of a key block the sum over query blocks, and a learnable
  // capture's gradient the sum over all blocks (a per-head slope and a per-position bias here).
  const int64_t B = 1, Hq = 4, Hkv = 2, L = 24, D = 8;
  const Variant v = Variant::from_strings(
      "score + slope[h] * (kv_idx - q_idx) + kvb[kv_idx]", "q_idx >= kv_idx",
      {{"slope", "float32", {"H"}}, {"kvb", "float32", {"KV_LEN"}}}, {}, "blocks");
  const std::vector<float> q = normal(B * Hq * L * D, DType::BF16),
                           k = normal(B * Hkv * L * D, DType::BF16),
                           vv = normal(B * Hkv * L * D, DType::BF16),
                           dout = normal(B * Hq * L * D, DType::BF16),
                           dlse = normal(B * Hq * L, DType::BF16);
  const std::vector<float> slope = normal(Hq, DType::BF16, 0.5f), kvb = normal(L, DType::BF16);
  auto problem = [&](int64_t q0, int64_t nq, int64_t k0, int64_t nk) {
    ReferenceProblem p;
    p.batch = B, p.q_heads = Hq, p.kv_heads = Hkv, p.q_len = nq, p.kv_len = nk, p.head_dim = D;
    p.q_offset = q0, p.kv_offset = k0, p.seq_q_len = L, p.seq_kv_len = L;
    p.captures["slope"] = TensorView::contiguous(slope.data(), DType::F32, {Hq});
    p.captures["kvb"] = TensorView::contiguous(kvb.data(), DType::F32, {L});
    return p;
  };
  ReferenceProblem wp = problem(0, L, 0, L);
  wp.q = q, wp.k = k, wp.v = vv;
  const ReferenceResult f = reference_attention(v, wp);
  const std::vector<float> out = as_float(f.gold_out), lse = as_float(f.gold_lse);
  ReferenceBackwardProblem wbp;
  wbp.forward = wp;
  wbp.dout = dout, wbp.dlse = dlse, wbp.out = out, wbp.lse = lse;
  const ReferenceBackward want = reference_attention_backward(v, wbp);

  std::vector<double> dq(want.dq.gold.size(), 0), dk(want.dk.gold.size(), 0),
      dv(want.dv.gold.size(), 0), dslope(Hq, 0), dkvb(L, 0);
  const std::pair<int64_t, int64_t> blocks[] = {{0, 10}, {10, 14}};
  for (auto [q0, nq] : blocks)
    for (auto [k0, nk] : blocks) {
      ReferenceBackwardProblem bp;
      bp.forward = problem(q0, nq, k0, nk);
      const std::vector<float> bq = rows_of(q, B * Hq, L, D, q0, nq),
                               bk = rows_of(k, B * Hkv, L, D, k0, nk),
                               bv = rows_of(vv, B * Hkv, L, D, k0, nk),
                               bdout = rows_of(dout, B * Hq, L, D, q0, nq),
                               bout = rows_of(out, B * Hq, L, D, q0, nq),
                               blse = rows_of(lse, B * Hq, L, 1, q0, nq),
                               bdlse = rows_of(dlse, B * Hq, L, 1, q0, nq);
      bp.forward.q = bq, bp.forward.k = bk, bp.forward.v = bv;
      bp.dout = bdout, bp.out = bout, bp.lse = blse, bp.dlse = bdlse;
      const ReferenceBackward g = reference_attention_backward(v, bp);
      for (int64_t bh = 0; bh < B * Hq; ++bh)
        for (int64_t i = 0; i < nq * D; ++i) dq[(bh * L + q0) * D + i] += g.dq.gold[bh * nq * D + i];
      for (int64_t bh = 0; bh < B * Hkv; ++bh)
        for (int64_t i = 0; i < nk * D; ++i) {
          dk[(bh * L + k0) * D + i] += g.dk.gold[bh * nk * D + i];
          dv[(bh * L + k0) * D + i] += g.dv.gold[bh * nk * D + i];
        }
      for (int64_t h = 0; h < Hq; ++h) dslope[h] += g.captures.at("slope").gold[h];
      for (int64_t j = 0; j < L; ++j) dkvb[j] += g.captures.at("kvb").gold[j];
    }
  const auto max_diff = [](const std::vector<double>& a, const std::vector<double>& b) {
    double m = 0;
    for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
    return m;
  };
  CHECK(max_diff(dq, want.dq.gold) < 1e-10);
  CHECK(max_diff(dk, want.dk.gold) < 1e-10);
  CHECK(max_diff(dv, want.dv.gold) < 1e-10);
  CHECK(max_diff(dslope, want.captures.at("slope").gold) < 1e-10);
  CHECK(max_diff(dkvb, want.captures.at("kvb").gold) < 1e-10);
}

TEST_CASE("the gradient tolerance rule", "[reference]") {
  const Variant alibi = Variant::from_catalogue("alibi");
  Case c;
  c.captures["slope"] = {{0.5f, 0.25f, 0.125f, 0.0625f}, {4}};
  const ReferenceBackward r = backward(alibi, c);
  const auto dq = as_float(r.dq.ref), dk = as_float(r.dk.ref), dv = as_float(r.dv.ref);
  const auto ds = as_float(r.captures.at("slope").ref);
  const auto check = [&](std::span<const float> q, std::span<const float> s) {
    return check_gradients(r, q, dk, dv, {{"slope", s}});
  };
  const BackwardAccuracy a = check(dq, ds);
  INFO(a.summary());
  CHECK(a.pass);
  CHECK(a.grads.size() == 4);
  CHECK(a.grads[3].name == "slope");
  // Twice ref's error fails; so do NaN, and a nonzero gradient where nothing adds up.
  std::vector<float> worse = dq;
  for (size_t i = 0; i < worse.size(); ++i) worse[i] += 2 * float(r.dq.ref[i] - r.dq.gold[i]);
  CHECK_FALSE(check(worse, ds).pass);
  std::vector<float> nan = dq;
  nan[5] = std::numeric_limits<float>::quiet_NaN();
  CHECK(check(nan, ds).grads[0].bad == 1);
  std::vector<float> off = ds;
  const ReferenceGradient& slope = r.captures.at("slope");
  for (size_t i = 0; i < off.size(); ++i) off[i] += 2 * float(slope.ref[i] - slope.gold[i]);
  CHECK_FALSE(check(dq, off).pass);
  CHECK_THROWS_WITH(check_gradients(r, dq, dk, dv),
                    "check_gradients: no kernel gradient for capture 'slope'");
  CHECK_THROWS_WITH(check_gradients(r, dq, dk, dv, {{"slope", ds}, {"other", ds}}),
                    "check_gradients: capture 'other' has no reference gradient");
  CHECK_THROWS_WITH(check(std::span<const float>(dq).first(8), ds),
                    "check_gradients: dq has 8 values; the reference has 320");

  const Variant late = Variant::from_strings("score", "q_idx >= 2 && kv_idx <= q_idx", {}, {}, "late");
  c.captures.clear();
  const ReferenceBackward m = backward(late, c);
  std::vector<float> mq = as_float(m.dq.ref);
  const BackwardAccuracy ok = check_gradients(m, mq, as_float(m.dk.ref), as_float(m.dv.ref));
  CHECK(ok.pass);
  mq[0] = 1e-30f;  // row 0 is fully masked
  CHECK(check_gradients(m, mq, as_float(m.dk.ref), as_float(m.dv.ref)).grads[0].bad == 1);
}
