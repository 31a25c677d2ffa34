// The CUDA emitter (dsl/emit_cuda.cpp): the text it writes, and what that text computes. Without
// a GPU the generated hooks are compiled as host C++ (a few CUDA intrinsics stubbed to their
// IEEE meaning) and must agree with the interpreter's float32 mode bit for bit.
#include <fmt/format.h>
#include <unistd.h>

#include <bit>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <utility>

#include "dsl/analysis.h"
#include "dsl/emit_cuda.h"
#include "dsl/frontend.h"
#include "random_expr.h"
#include "test_random.h"

using namespace flexc::dsl;
using flexc::dsl::testing::RandomExpr;
using flexc::dsl::testing::RandomExprOptions;
namespace fs = std::filesystem;

namespace {

using flexc::testing::rng;

struct Parsed {
  Decls decls;
  Mod score, mask;
};

Parsed parse(std::string_view score, std::string_view mask, Decls decls = {}) {
  Parsed p{std::move(decls), {}, {}};
  p.score = parse_mod(ModKind::Score, score, p.decls, "score_mod");
  p.mask = parse_mod(ModKind::Mask, mask, p.decls, "mask_mod");
  return p;
}

std::string emit(const Parsed& p, std::string name = "t") {
  return emit_cuda_variant({&p.score.graph, &p.mask.graph, &p.decls, std::move(name)});
}

bool has(const std::string& text, std::string_view what) {
  return text.find(what) != std::string::npos;
}

}  // namespace

TEST_CASE("emitted facts follow the mods", "[emit]") {
  Decls d;
  d.captures.push_back({"bias", DType::F32, {{Dim::H}, {Dim::Fixed, 64}}});
  d.captures.push_back({"doc", DType::I32, {{Dim::QLen}}});
  const std::string plain = emit(parse("score", "true", d));
  CHECK(has(plain, "kIdentityScore = true;"));
  CHECK(has(plain, "kMaskAlwaysTrue = true;"));
  CHECK(has(plain, "kMaskReadsB = false;"));
  CHECK(has(plain, "kMaskReadsH = false;"));
  CHECK(has(plain, "kScoreGradIsOne = true;"));
  CHECK(has(plain, "kHasCaptureGrads = false;"));

  const std::string rich =
      emit(parse("score * 2.0 + bias[h, q_idx - kv_idx]", "doc[q_idx] == doc[kv_idx] && h < 4", d));
  CHECK(has(rich, "kIdentityScore = false;"));
  CHECK(has(rich, "kMaskAlwaysTrue = false;"));
  CHECK(has(rich, "kMaskReadsB = false;"));
  CHECK(has(rich, "kMaskReadsH = true;"));
  CHECK(has(rich, "kScoreGradIsOne = false;"));
  CHECK(has(rich, "kHasCaptureGrads = true;"));
  CHECK(has(rich, "grads.add(0, a.captures[0], "));
  CHECK(has(rich, "kCaptureGradLoads = 1;"));
  CHECK(has(rich, "kCaptureGradsReadScore = false;"));
  // A gradient that reads the score makes the kernels keep the pre-mod scores.
  const std::string gain = emit(parse("score * bias[h, 3] + bias[h, q_idx % 64]", "true", d));
  CHECK(has(gain, "grads.add(0, a.captures[0], o"));
  CHECK(has(gain, ", grad_score, score);"));
  CHECK(has(gain, "kCaptureGradsReadScore = true;"));

  // Reading a capture only through a comparison gives it no gradient.
  const std::string cmp = emit(parse("score + (bias[h, 0] > 0.0 ? 1.0 : 0.0)", "b == 0", d));
  CHECK(has(cmp, "kHasCaptureGrads = false;"));
  CHECK(has(cmp, "kMaskReadsB = true;"));
}

TEST_CASE("fast precision splits off score_mod's row terms", "[emit]") {
  Decls d;
  d.captures.push_back({"qb", DType::F32, {{Dim::H}, {Dim::QLen}}});
  d.captures.push_back({"kvb", DType::F32, {{Dim::KvLen}}});
  const auto fast = [&](std::string_view score) {
    const Parsed p = parse(score, "true", d);
    return emit_cuda_variant({&p.score.graph, &p.mask.graph, &p.decls, "t", FloatMath::Fast});
  };
  // `score + qb[h, q_idx]`: the scores are the identity; the row's load is row_terms'.
  const std::string qb = fast("score + qb[h, q_idx]");
  CHECK(has(qb, "kIdentityScore = false;"));
  CHECK(has(qb, "kRowless = true;"));
  CHECK(has(qb, "kRowlessIdentity = true;"));
  const size_t row_hook = qb.find("row_terms(");
  REQUIRE(row_hook != std::string::npos);
  CHECK(qb.find("flexc_load_f32(a.captures[0]", row_hook) != std::string::npos);
  // A term reading kv_idx stays with the scores; a subtracted row term (and a constant) splits.
  const std::string kv = fast("score + kvb[kv_idx] - qb[h, q_idx] * 2.0 + 1.0");
  CHECK(has(kv, "kRowless = true;"));
  CHECK(has(kv, "kRowlessIdentity = false;"));
  // Nothing to split: a row term under a product, or no row term.
  CHECK(has(fast("score * qb[h, q_idx]"), "kRowless = false;"));
  CHECK(has(fast("score + kvb[kv_idx]"), "kRowless = false;"));
  // Units: the positive constant factors of the rest, alone or beside row terms; not a negative
  // one or a param.
  const std::string cap = fast("30.0 * tanh(score / 30.0)");
  CHECK(has(cap, "kRowless = true;"));
  CHECK(has(cap, "kRowlessUnits = 30.0f;"));
  CHECK(has(cap, "kRowlessIdentity = false;"));
  const std::string temp = fast("score / 8.0 + qb[h, q_idx]");
  CHECK(has(temp, "kRowlessUnits = 0.125f;"));
  CHECK(has(temp, "kRowlessIdentity = true;"));
  CHECK(has(fast("score * -2.0"), "kRowless = false;"));
  CHECK(has(fast("score * float(h + 1)"), "kRowless = false;"));
  // Exact precision keeps score_mod's rounding order: never split.
  CHECK(has(emit(parse("score + qb[h, q_idx]", "true", d)), "kRowless = false;"));
}

TEST_CASE("score_mod's loads indexed by kv_idx alone are column loads", "[emit]") {
  Decls d;
  d.captures.push_back({"kvb", DType::BF16, {{Dim::H}, {Dim::KvLen}}});
  d.captures.push_back({"tab", DType::F32, {{Dim::Fixed, 4096}}});
  d.captures.push_back({"doc", DType::I32, {{Dim::KvLen}}});
  const std::string none = emit(parse("score + kvb[h, q_idx] + tab[3]", "true", d));
  CHECK(has(none, "kScoreColumnLoads = 0;"));
  // Two per-key loads, read back from cv[] in their types.
  const std::string pair = emit(parse("score + kvb[h, kv_idx] * float(doc[kv_idx])", "true", d));
  CHECK(has(pair, "kScoreColumnLoads = 2;"));
  CHECK(has(pair, "__uint_as_float(cv[0])"));
  CHECK(has(pair, "(int)cv[1]"));
  // kv_idx // 2, or kv_idx on a fixed dim (wrapped): column loads too.
  for (const char* mod : {"score + kvb[h, kv_idx // 2]", "score + tab[kv_idx]"}) {
    INFO(mod);
    CHECK(has(emit(parse(mod, "true", d)), "kScoreColumnLoads = 1;"));
  }
  // mask_mod's per-key loads too (a document mask's doc[kv_idx]); doc[q_idx] is not one.
  const std::string doc = emit(parse("score", "doc[q_idx] == doc[kv_idx] && q_idx >= kv_idx", d));
  CHECK(has(doc, "kScoreColumnLoads = 0;"));
  CHECK(has(doc, "kMaskColumnLoads = 1;"));
  CHECK(has(doc, "__forceinline__ bool mask_mod_cols("));
  CHECK(has(doc, "(int)cv[0]"));
  CHECK(has(emit(parse("score", "doc[q_idx] == 1", d)), "kMaskColumnLoads = 0;"));
  CHECK(has(emit(parse("score + kvb[h, kv_idx]", "doc[kv_idx] < h && tab[kv_idx] > 0.0", d)),
            "kMaskColumnLoads = 2;"));
}

TEST_CASE("score_mod's 16-bit loads indexed by q_idx and kv_idx itself are tile loads", "[emit]") {
  Decls d;
  d.captures.push_back({"kvb", DType::BF16, {{Dim::H}, {Dim::KvLen}}});
  d.captures.push_back({"bias", DType::BF16, {{Dim::QLen}, {Dim::KvLen}}});
  d.captures.push_back({"bias32", DType::F32, {{Dim::QLen}, {Dim::KvLen}}});
  d.captures.push_back({"bhqk", DType::F16, {{Dim::B}, {Dim::H}, {Dim::QLen}, {Dim::KvLen}}});
  const std::string tile = emit(parse("score + bias[q_idx, kv_idx]", "true", d));
  CHECK(has(tile, "kScoreColumnLoads = 0;"));
  CHECK(has(tile, "kScoreTileLoads = 1;"));
  CHECK(has(tile, "kScoreTilesShareHeads = true;"));
  CHECK(has(tile, "score_tile_slot(int k) { return k == 0 ? 1 : 0; }"));
  CHECK(has(tile, "score_tile_dim(int k) { return k == 0 ? 1 : 0; }"));
  CHECK(has(tile, "score_tile_type(int k) { return k == 0 ? 1 : 0; }"));
  CHECK(has(tile, "__uint_as_float(cv[0])"));
  // Beside a column load, the tile load's word follows the columns'; fp16 at [B, H, Q_LEN, KV_LEN].
  const std::string both =
      emit(parse("score + kvb[h, kv_idx] + bhqk[b, h, q_idx + 1, kv_idx]", "true", d));
  CHECK(has(both, "kScoreColumnLoads = 1;"));
  CHECK(has(both, "kScoreTileLoads = 1;"));
  CHECK(has(both, "kScoreTilesShareHeads = false;"));  // [B, H, Q_LEN, KV_LEN]: one per head
  CHECK(has(both, "score_tile_slot(int k) { return k == 0 ? 3 : 0; }"));
  CHECK(has(both, "score_tile_dim(int k) { return k == 0 ? 3 : 0; }"));
  CHECK(has(both, "score_tile_type(int k) { return k == 0 ? 2 : 0; }"));
  CHECK(has(both, "__uint_as_float(cv[1])"));
  // Not tile loads: 32-bit, kv_idx not alone at its dim, no q_idx, the score in the index.
  for (const char* mod : {"score + bias32[q_idx, kv_idx]", "score + bias[q_idx, kv_idx // 2]",
                          "score + bias[h, kv_idx]", "score + bias[int(score), kv_idx]"}) {
    INFO(mod);
    const std::string none = emit(parse(mod, "true", d));
    CHECK(has(none, "kScoreTileLoads = 0;"));
    CHECK(has(none, "kScoreTilesShareHeads = false;"));
  }
}

TEST_CASE("score_mod's costly terms in kv_idx - q_idx alone are relative terms", "[emit]") {
  Decls d;
  d.captures.push_back({"rel", DType::F32, {{Dim::H}, {Dim::Fixed, 511}}});
  d.captures.push_back({"slope", DType::F32, {{Dim::H}}});
  const auto terms = [&](std::string_view mod) {
    const std::string text = emit(parse(mod, "true", d));
    for (int n = 0; n <= 2; ++n)
      if (has(text, fmt::format("kScoreRelTerms = {};", n))) return n;
    return -1;
  };
  // A table gathered through the difference, a decay in either sign of it: one term each, read
  // back from the word after the column loads.
  CHECK(terms("score + rel[h, clamp(kv_idx - q_idx, -255, 255) + 255]") == 1);
  CHECK(terms("score + exp(-abs(q_idx - kv_idx) / 256.0)") == 1);
  CHECK(has(emit(parse("score * exp(float(kv_idx - q_idx) / 64.0)", "true", d)),
            "__uint_as_float(cv[0])"));
  // Two terms (and a third, cheaper one left inline); the largest subexpressions only.
  CHECK(terms("score + where((q_idx - kv_idx) % 7 == 0, 0.5, 0.0) - "
              "float(abs(q_idx - kv_idx) // 64) * 0.01") == 2);
  CHECK(terms("sqrt(float(abs(kv_idx - q_idx))) * score + log(1.0 + float(abs(q_idx - kv_idx))) "
              "+ cos(float(kv_idx - q_idx))") == 2);
  // Alibi's conversion and multiply: two operations, a term; one operation is not.
  CHECK(terms("score + slope[h] * (kv_idx - q_idx)") == 1);
  // Not: a single operation, a term that also reads q_idx or the score, no difference.
  for (const char* mod :
       {"score + float(kv_idx - q_idx)", "score + exp(float(kv_idx - q_idx) / float(q_idx + 1))",
        "exp(score * float(kv_idx - q_idx) / 64.0)", "score + exp(float(kv_idx + q_idx) / 64.0)",
        "score"}) {
    INFO(mod);
    CHECK(terms(mod) == 0);
  }
  // Fast math keeps a term exact where the whole score_mod needs it: here the term decides a
  // comparison through its sum with the score.
  const Parsed cmp = parse("where(exp(float(kv_idx - q_idx) / 100.0) + score > 1.0, score, 0.0)",
                           "true", d);
  const std::string fast =
      emit_cuda_variant({&cmp.score.graph, &cmp.mask.graph, &cmp.decls, "t", FloatMath::Fast});
  const std::string rel_hook = fast.substr(fast.find("score_rel_terms("));
  CHECK(has(rel_hook.substr(0, rel_hook.find("score_mod_cols(")), "expf("));
  CHECK_FALSE(has(rel_hook.substr(0, rel_hook.find("score_mod_cols(")), "flexc_fast_exp2("));
}

TEST_CASE("emitted text is deterministic and names no user identifier", "[emit]") {
  Decls d;
  d.captures.push_back({"my_secret_table", DType::BF16, {{Dim::Fixed, 8}}});
  d.params.push_back({"my_secret_scale", Type::Float, 0.5, false});
  const Parsed p = parse("let zz_local = score * my_secret_scale; zz_local + my_secret_table[h]",
                         "q_idx >= kv_idx", d);
  const std::string a = emit(p, "v*/ evil"), b = emit(p, "v*/ evil");
  CHECK(a == b);
  CHECK_FALSE(has(a, "my_secret"));
  CHECK_FALSE(has(a, "zz_local"));
  CHECK_FALSE(has(a, "*/ evil"));  // the name cannot close the comment it is written into
  CHECK(has(a, "a.fparam[0]"));
  CHECK(has(a, "flexc_load_bf16(a.captures[0], "));
}

TEST_CASE("user statements carry markers that point at their expression", "[emit]") {
  const std::string score = "let d = q_idx - kv_idx;\nscore + float(d // 3)";
  const Parsed p = parse(score, "kv_idx <= q_idx");
  const std::string text = emit(p);
  int markers = 0;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    const size_t at = line.find("// @");
    if (at == std::string::npos) continue;
    ++markers;
    unsigned b = 0, e = 0;
    char kind[16] = {};
    REQUIRE(std::sscanf(line.c_str() + at, "// @%15[a-z_]:%u:%u", kind, &b, &e) == 3);
    const std::string& src = std::string_view(kind) == "score_mod" ? score : p.mask.source;
    REQUIRE(b < e);
    REQUIRE(e <= src.size());
    // Each marked statement computes an operator of the text it points at.
    if (has(line, "flexc_floordiv(")) CHECK(src.substr(b, e - b) == "d // 3");
    if (has(line, "flexc_sub(")) CHECK(src.substr(b, e - b) == "q_idx - kv_idx");
    if (has(line, " <= ")) CHECK(src.substr(b, e - b) == "kv_idx <= q_idx");
  }
  CHECK(markers >= 4);
}

TEST_CASE("literals are exact float32 and int32", "[emit]") {
  Decls d;
  d.params.push_back({"n", Type::Int, 0, false});
  const std::string t =
      emit(parse("score * 0.1 + float(n * -2147483648) + 30.0 - inf", "n != -7", d));
  CHECK(has(t, "0.100000001f"));       // float32(0.1), enough digits to round-trip
  CHECK(has(t, "(-2147483647 - 1)"));  // INT_MIN without an out-of-range literal
  CHECK(has(t, "30.0f"));
  CHECK(has(t, "__int_as_float(0x7f800000)"));
  CHECK(has(t, "(-7)"));
}

TEST_CASE("int // and % by a power of two are a shift and a mask", "[emit]") {
  const std::string t = emit(parse(
      "score + float((q_idx - kv_idx) // 128 + (q_idx - kv_idx) % 64 + q_idx // 1 + kv_idx // 6)",
      "(kv_idx - q_idx) % 2 == 0 && q_idx // 1073741824 == 0"));
  CHECK(has(t, " >> 7;"));
  CHECK(has(t, " & 63;"));
  CHECK(has(t, "flexc_floordiv(kv_idx, 6)"));  // not a power of two
  CHECK(has(t, " & 1;"));
  CHECK(has(t, "q_idx >> 30;"));
  // Float // and % keep their floor-based forms.
  CHECK(has(emit(parse("score // 4.0 + score % 2.0", "true")), "flexc_floordivf(score, 4.0f)"));
}

TEST_CASE("the emitter rejects more captures than the hooks carry", "[emit]") {
  Decls d;
  for (int i = 0; i < 9; ++i) d.captures.push_back({fmt::format("c{}", i), DType::F32, {{Dim::H}}});
  Graph g;
  g.root = g.input(Input::Score);
  Graph m;
  m.root = m.constant_bool(true);
  CHECK_THROWS_WITH(emit_cuda_variant({&g, &m, &d, "x"}), Catch::Contains("at most 8 tensors"));
}

TEST_CASE("a capture index is wrapped unless it is the input its dim measures", "[emit]") {
  Decls d;
  d.captures.push_back({"slope", DType::F32, {{Dim::H}}});
  d.captures.push_back({"bias", DType::F32, {{Dim::H}, {Dim::Fixed, 64}}});
  d.captures.push_back({"doc", DType::I32, {{Dim::KvLen}}});
  d.captures.push_back({"pb", DType::F32, {{Dim::B}, {Dim::QLen}}});
  const std::string alibi = emit(parse("score + slope[h] * (kv_idx - q_idx)", "true", d));
  CHECK(has(alibi, "flexc_at(a.captures[0], h)"));
  CHECK_FALSE(has(alibi, "flexc_wrap"));

  // A fixed extent (validated at launch) wraps by the constant.
  const std::string bias = emit(parse("score + bias[h, q_idx - kv_idx]", "true", d));
  CHECK(has(bias, "flexc_at(a.captures[1], h, flexc_wrap(t"));
  CHECK(has(bias, ", 64))"));
  CHECK_FALSE(has(bias, "shape["));

  // By dim, not by input: doc is [KV_LEN], so q_idx wraps there and kv_idx does not.
  const std::string doc = emit(parse("score", "doc[q_idx] == doc[kv_idx]", d));
  CHECK(has(doc, "flexc_at(a.captures[2], flexc_wrap(q_idx, a.captures[2].shape[0]))"));
  CHECK(has(doc, "flexc_at(a.captures[2], kv_idx)"));

  // Inputs against other dims, and the lengths themselves, wrap.
  const std::string other =
      emit(parse("score + pb[h, b] + pb[b, q_len] + pb[b, q_idx]", "true", d));
  CHECK(has(other, "flexc_at(a.captures[3], flexc_wrap(h, a.captures[3].shape[0]), "
                   "flexc_wrap(b, a.captures[3].shape[1]))"));
  CHECK(has(other, "flexc_at(a.captures[3], b, flexc_wrap(q_len, a.captures[3].shape[1]))"));
  CHECK(has(other, "flexc_at(a.captures[3], b, q_idx)"));
}

namespace {

// The body of hook `name` ("score_mod", "mask_mod", ...) in emitted text.
std::string hook_body(const std::string& text, const std::string& name) {
  const size_t at = text.find(" " + name + "(");
  REQUIRE(at != std::string::npos);
  return text.substr(at, text.find("\n  }\n", at) - at);
}

std::string emit_fast(const Parsed& p) {
  return emit_cuda_variant(
      {&p.score.graph, &p.mask.graph, &p.decls, "t", FloatMath::Fast});
}

}  // namespace

TEST_CASE("fast math tabulates a sum's relative terms as one", "[emit]") {
  // Fast math adds a sum's relative terms first, so that they make one table: score + a - b reads
  // a - b, score - a - b reads a + b and subtracts it; exact math keeps the written order.
  const auto fast_cols = [](std::string_view mod) {
    const std::string text = emit_fast(parse(mod, "true"));
    return std::pair{has(text, "kScoreRelTerms = 1;"), hook_body(text, "score_mod_cols")};
  };
  const auto [one, plus_minus] = fast_cols(
      "score + where((q_idx - kv_idx) % 7 == 0, 0.5, 0.0) - float(abs(q_idx - kv_idx) // 64) * "
      "0.01");
  CHECK(one);
  CHECK(has(plus_minus, "__uint_as_float(cv[0])"));
  CHECK(has(plus_minus, " + score;"));
  const auto [one_neg, minus_minus] = fast_cols(
      "score - sqrt(float(abs(kv_idx - q_idx))) * 0.5 - float(abs(q_idx - kv_idx) // 64)");
  CHECK(one_neg);
  CHECK(has(minus_minus, "= score - t"));
  const auto [one_first, first] = fast_cols(
      "0.25 * float((kv_idx - q_idx) % 5) - score - sqrt(float(abs(q_idx - kv_idx))) * 0.5");
  CHECK(one_first);
  CHECK(has(first, " - score;"));
  // Not where the sum decides something discrete: fast math leaves such a value as written.
  CHECK_FALSE(fast_cols("where(score + where((q_idx - kv_idx) % 7 == 0, 0.5, 0.0) - "
                        "float(abs(q_idx - kv_idx) // 64) * 0.01 > 0.0, score, 0.0)")
                  .first);
}

TEST_CASE("fast float math: approximate instructions, exact where a value decides", "[emit]") {
  Decls d;
  d.params.push_back({"cap", Type::Float, 0, false});
  const Parsed softcap = parse("cap * tanh(score / cap)", "true", d);
  const std::string exact = emit(softcap), fast = emit_fast(softcap);
  CHECK(has(exact, "(exact float math in score_mod)"));
  CHECK(has(fast, "(fast float math in score_mod)"));
  // Exact: IEEE-rounded intrinsics; fast: 1 / cap computed once, one multiply into
  // tanh (CUDA's tanhf, flexc_hooks.cuh), in the score_mod and in its derivative.
  for (const char* hook : {"score_mod", "score_mod_grad"}) {
    INFO(hook);
    CHECK(has(hook_body(exact, hook), "__fdiv_rn("));
    CHECK_FALSE(has(hook_body(exact, hook), "flexc_fast_"));
    CHECK(has(hook_body(exact, hook), "tanhf("));
    CHECK(has(hook_body(fast, hook), "const float k0 = flexc_fast_rcp(t0);"));
    CHECK(has(hook_body(fast, hook), "= tanh_form(k0 * score);"));
    CHECK_FALSE(has(hook_body(fast, hook), "flexc_fast_div"));
    CHECK_FALSE(has(hook_body(fast, hook), "__fdiv_rn"));
    CHECK_FALSE(has(hook_body(fast, hook), "__fmul_rn"));
  }
  CHECK(has(hook_body(fast, "score_mod"), "= t0 * t3;"));
  // score / cap itself, folded into tanh's argument, is not written (NVRTC would warn).
  CHECK_FALSE(has(hook_body(fast, "score_mod"), " t2 = "));
  // The derivative cap (1 - t^2) / cap folds to one FMA in t^2: k + k' t^2.
  CHECK(has(hook_body(fast, "score_mod_grad"), "= k3 + k4 * t7;"));
  // Approx: the same code with tanh on tanh.approx, in both hooks (the backward's P and dS come
  // from the forward's math).
  const std::string approx = emit_cuda_variant(
      {&softcap.score.graph, &softcap.mask.graph, &softcap.decls, "t", FloatMath::Approx});
  CHECK(has(approx, "(approx float math in score_mod)"));
  for (const char* hook : {"score_mod", "score_mod_grad"}) {
    INFO(hook);
    CHECK(has(hook_body(approx, hook), "= flexc_approx_tanh(k0 * score);"));
    CHECK_FALSE(has(hook_body(approx, hook), "flexc_fast_tanh"));
  }
  // Tanh forms (flexc_hooks.cuh): the kernels choose fast tanh's form per tile, so fast's score
  // hooks take it as an argument; exact's and approx's write their tanh, and say so.
  CHECK(has(fast, "kTanhForms = true;"));
  CHECK(has(exact, "kTanhForms = false;"));
  CHECK(has(approx, "kTanhForms = false;"));
  for (const char* hook : {"score_mod", "score_mod_grad", "score_mod_cols", "score_mod_rowless",
                           "score_mod_rowless_cols"})
    for (const std::string* h : {&exact, &fast, &approx}) {
      INFO(hook << " in\n" << *h);
      CHECK(has(*h, fmt::format("template <class Tanh = FlexcTanh>\n  __device__ static "
                                "__forceinline__ float {}(",
                                hook)));
    }
  CHECK_FALSE(has(emit_fast(parse("score * sigmoid(score)", "true")), "kTanhForms = true;"));

  const Parsed each = parse(
      "exp(score) + exp2(score) + log(score) + log2(score) + sqrt(score) + rsqrt(score) + "
      "sigmoid(score) + sin(score) + cos(score) + pow(score, 2.5)",
      "true");
  const std::string f = hook_body(emit_fast(each), "score_mod");
  for (const char* fn :
       {"flexc_fast_exp2(1.44269502f * score)", "flexc_fast_exp2(score)", "flexc_fast_log2(score)",
        "0.693147182f * l", "flexc_fast_sqrt(score)", "flexc_fast_rsqrt(score)",
        "flexc_fast_exp2((-1.44269502f) * score)", "flexc_fast_rcp(1.0f + e",
        "flexc_fast_sin(score)", "flexc_fast_cos(score)", "powf(score, 2.5f)"})
    CHECK(has(f, fn));

  // A float that decides something discrete is exact, with all it is computed from: t5_bias's
  // bucket, a comparison, floor; the continuous rest of the same score_mod is fast.
  Decls t5;
  t5.captures.push_back({"bias", DType::F32, {{Dim::H}, {Dim::Fixed, 32}}});
  const std::string bucket = hook_body(
      emit_fast(parse("score * 0.5 + bias[h, min(8 + int(2.0 * log2(abs(q_idx - kv_idx) / 8.0)), "
                      "15)] + log(1.0 + score * score)",
                      "true", t5)),
      "score_mod");
  CHECK(has(bucket, "log2f("));
  CHECK(has(bucket, ", 0.125f)"));  // / 8.0 exactly: a multiply by 1 / 8
  CHECK_FALSE(has(bucket, "__fdiv_rn("));
  CHECK(has(bucket, "__fmul_rn(2.0f, "));
  // Division by +-2^k is the multiply by 2^-k in either mode; by anything else it divides.
  const Parsed pow2 = parse("score / 0.25 + score / -8.0 + score / 3.0", "true");
  const std::string exact_pow2 = hook_body(emit(pow2), "score_mod");
  CHECK(has(exact_pow2, "__fmul_rn(score, 4.0f)"));
  CHECK(has(exact_pow2, "__fmul_rn(score, (-0.125f))"));
  CHECK(has(exact_pow2, "__fdiv_rn(score, 3.0f)"));
  const std::string fast_pow2 = hook_body(emit_fast(pow2), "score_mod");
  // Fast: the three terms, each the score times a constant, fold into one multiply.
  CHECK(has(fast_pow2, "const float t8 = 4.20833349f * score;"));
  CHECK(has(fast_pow2, "return t8;"));
  // No fold whose factor leaves float's range: 3e38 * log2(e) would be inf (inf * 0 = NaN where
  // exp(0) is 1), 1e-30 * 1e-20 would be 0.
  const std::string huge = hook_body(emit_fast(parse("exp(score * 3.0e38)", "true")), "score_mod");
  CHECK(has(huge, "= 3.00000001e+38f * score;"));
  CHECK(has(huge, "flexc_fast_exp2(1.44269502f * t"));
  const std::string tiny =
      hook_body(emit_fast(parse("score * 1.0e-30 * 1.0e-20 + 1.0", "true")), "score_mod");
  CHECK(has(tiny, "= t2 * 9.99999968e-21f;"));
  const std::string subnormal =
      hook_body(emit_fast(parse("score * 1.0e-30 * 1.0e-14", "true")), "score_mod");
  CHECK(has(subnormal, "= t2 * 9.99999982e-15f;"));  // not 9.8e-45, a subnormal factor
  // A value inside a relative term (here under floor, so exact) and outside it is exact in the
  // score_mod_cols twin too, which reads the term from the kernel's table: the forward (the
  // twin) and the backward (score_mod) compute the same bits.
  const std::string twin =
      emit_fast(parse("let x = log2(float(abs(kv_idx - q_idx)) + 1.0); score * sin(floor(x) + x) + "
                      "score * cos(x + 1.0) + x * 3.0 * score",
                      "true"));
  CHECK(has(twin, "kScoreRelTerms = 2"));
  for (const char* hook : {"score_mod", "score_mod_cols"}) {
    INFO(hook);
    CHECK(has(hook_body(twin, hook), "= log2f("));
    CHECK_FALSE(has(hook_body(twin, hook), "flexc_fast_log2("));
  }
  CHECK(has(bucket, "= log2f("));
  CHECK(has(bucket, "0.693147182f * l"));
  CHECK(has(bucket, "0.5f * score"));
  const std::string branch =
      hook_body(emit_fast(parse("exp(score) > 2.0 ? exp(score) : floor(score / 3.0) + sqrt(score)",
                                "true")),
                "score_mod");
  CHECK(has(branch, "expf("));
  CHECK(has(branch, "__fdiv_rn(score, 3.0f)"));
  CHECK_FALSE(has(branch, "flexc_fast_exp2("));
  CHECK(has(branch, "flexc_fast_sqrt("));
  // The mask is always exact.
  const std::string mask = hook_body(
      emit_fast(parse("score", "float(q_idx) * 0.5 < sqrt(float(kv_idx)) + 1.0")), "mask_mod");
  CHECK(has(mask, "__fmul_rn("));
  CHECK(has(mask, "sqrtf("));
  CHECK_FALSE(has(mask, "flexc_fast"));
}

// ---- generated code vs the interpreter, on the host

namespace {

// Host stand-ins for the CUDA intrinsics the hooks use; each is the exact IEEE operation. The
// program is built with -fno-builtin so that math functions of constants run in the C library,
// as the interpreter's do (GCC would fold them, correctly rounded, at compile time).
constexpr const char* kShim = R"(#include <bit>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <math.h>
#define __CUDACC__ 1
#define __device__
#define __forceinline__ inline
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline int __float2int_rz(float x) {
  if (std::isnan(x)) return 0;
  if (x >= 2147483648.0f) return INT_MAX;
  if (x <= -2147483648.0f) return INT_MIN;
  return (int)x;
}
inline float __int2float_rn(int i) { return (float)i; }
inline float __int_as_float(int i) { return std::bit_cast<float>(i); }
inline int __float_as_int(float f) { return std::bit_cast<int>(f); }
inline float __uint_as_float(unsigned u) { return std::bit_cast<float>(u); }
inline unsigned __float_as_uint(float f) { return std::bit_cast<unsigned>(f); }
template <class T> T __ldg(const T* p) { return *p; }
inline void atomicAdd(float* p, float v) { *p += v; }
// One thread is a warp of one lane (FlexcGradSink::flush_warp compiles; the test uses flush_thread).
struct { unsigned x = 0; } threadIdx;
inline unsigned __ballot_sync(unsigned, bool p) { return p; }
template <class T> T __shfl_sync(unsigned, T v, int) { return v; }
template <class T> T __shfl_xor_sync(unsigned, T v, int) { return v; }
inline int __ffs(unsigned x) { return x ? __builtin_ctz(x) + 1 : 0; }
)";

// A declaration set covering every dtype but fp16 (its load is inline PTX: GPU test only), ranks
// 1 to 4 and symbolic dims; the buffers get padded (non-contiguous) strides.
Decls random_decls() {
  Decls d;
  d.captures.push_back({"f", DType::F32, {{Dim::Fixed, 5}}});
  d.captures.push_back({"i", DType::I32, {{Dim::Fixed, 3}, {Dim::H}}});
  d.captures.push_back({"bf", DType::BF16, {{Dim::QLen}}});
  d.captures.push_back({"m", DType::Bool, {{Dim::Fixed, 2}, {Dim::Fixed, 3}, {Dim::B}}});
  d.captures.push_back({"g", DType::F32, {{Dim::B}, {Dim::H}, {Dim::Fixed, 2}, {Dim::Fixed, 3}}});
  d.captures.push_back({"k", DType::F32, {{Dim::Fixed, 2}, {Dim::KvLen}}});
  d.params.push_back({"pf", Type::Float, 0, false});
  d.params.push_back({"pi", Type::Int, 0, false});
  return d;
}

constexpr int kB = 2, kH = 3, kQLen = 7, kKvLen = 11;

int64_t extent(const Dim& dim) {
  switch (dim.kind) {
    case Dim::B:
      return kB;
    case Dim::H:
      return kH;
    case Dim::QLen:
      return kQLen;
    case Dim::KvLen:
      return kKvLen;
    case Dim::Fixed:
      break;
  }
  return dim.extent;
}

size_t elem_bytes(DType t) {
  return t == DType::Bool ? 1 : t == DType::BF16 || t == DType::F16 ? 2 : 4;
}

// One capture's data: random elements in a buffer with one padding element per row.
struct Buffer {
  DType dtype;
  std::vector<int64_t> shape, strides;
  std::vector<uint8_t> bytes;
  std::vector<float> grad;
};

Buffer random_buffer(const CaptureDecl& c) {
  Buffer b{c.dtype, {}, {}, {}, {}};
  for (const Dim& d : c.dims) b.shape.push_back(extent(d));
  b.strides.resize(b.shape.size());
  int64_t stride = 1;
  for (size_t k = b.shape.size(); k-- > 0;) {
    b.strides[k] = stride;
    stride *= b.shape[k] + (k + 1 == b.shape.size() ? 1 : 0);
  }
  b.bytes.resize(static_cast<size_t>(stride) * elem_bytes(c.dtype));
  b.grad.assign(static_cast<size_t>(stride), 0.0f);
  for (size_t e = 0; e * elem_bytes(c.dtype) < b.bytes.size(); ++e) {
    uint8_t* at = b.bytes.data() + e * elem_bytes(c.dtype);
    const float f = std::uniform_real_distribution<float>(-4, 4)(rng());
    const int32_t i = static_cast<int32_t>(std::uniform_int_distribution<int>(-9, 9)(rng()));
    const uint16_t bf = static_cast<uint16_t>(std::bit_cast<uint32_t>(f) >> 16);
    switch (c.dtype) {
      case DType::F32:
        std::memcpy(at, &f, 4);
        break;
      case DType::I32:
        std::memcpy(at, &i, 4);
        break;
      case DType::BF16:
      case DType::F16:
        std::memcpy(at, &bf, 2);
        break;
      case DType::Bool:
        *at = static_cast<uint8_t>(i & 1);
        break;
    }
  }
  return b;
}

std::string c_bytes(const std::vector<uint8_t>& v) {
  std::string s;
  for (uint8_t x : v) s += fmt::format("{},", x);
  return s;
}

std::string hex_bits(float f) { return fmt::format("{:08x}", std::bit_cast<uint32_t>(f)); }

// Writes `prog` to dir/main.cpp, builds it with $CXX (or c++) and `flags`, runs it into
// dir/out.txt; fails the test with the build log otherwise.
void run_host_program(const fs::path& dir, const std::string& prog, const std::string& flags) {
  std::ofstream(dir / "main.cpp") << prog;
  const char* cxx = std::getenv("CXX");
  const std::string cmd = fmt::format(
      "cd '{}' && '{}' -std=c++20 -O1 {} -fno-builtin -w -I'{}/templates' main.cpp -o main "
      "2> build.log && ./main > out.txt 2>> build.log",
      dir.string(), cxx && *cxx ? cxx : "c++", flags, FLEXC_SOURCE_DIR);
  if (std::system(cmd.c_str()) != 0) {
    std::ifstream log(dir / "build.log");
    FAIL("building or running the host program failed ("
         << cmd << "):\n"
         << std::string(std::istreambuf_iterator<char>(log), {}));
  }
}

struct Point {
  int b, h, q, kv, q_len, kv_len;
  float score;
};

}  // namespace

TEST_CASE("generated hooks compute what the interpreter computes (host build)", "[emit]") {
  const Decls decls = random_decls();
  constexpr int kRandom = 30, kPoints = 64;
  std::vector<Buffer> bufs;
  for (const CaptureDecl& c : decls.captures) bufs.push_back(random_buffer(c));
  const float pf = std::uniform_real_distribution<float>(-3, 3)(rng());
  const int pi = std::uniform_int_distribution<int>(-5, 5)(rng());

  // In range, as kernels call the hooks (flexc_hooks.cuh); index expressions still reach any int.
  std::vector<Point> points;
  for (int i = 0; i < kPoints; ++i) {
    const float special[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 1e30f};
    const float s =
        i % 8 == 0 ? special[i / 8 % 6] : std::uniform_real_distribution<float>(-10, 10)(rng());
    points.push_back({std::uniform_int_distribution<int>(0, kB - 1)(rng()),
                      std::uniform_int_distribution<int>(0, kH - 1)(rng()),
                      std::uniform_int_distribution<int>(0, kQLen - 1)(rng()),
                      std::uniform_int_distribution<int>(0, kKvLen - 1)(rng()), kQLen, kKvLen, s});
  }

  // Random variants; the score_mod may read score, the mask_mod may not.
  RandomExprOptions sopt;
  sopt.decls = &decls;
  sopt.inputs[0] = true;
  sopt.max_depth = 5;
  RandomExprOptions mopt = sopt;
  mopt.inputs[0] = false;
  std::vector<Graph> scores(kRandom), masks(kRandom);
  const uint64_t seed = rng()();
  for (int v = 0; v < kRandom; ++v) {
    RandomExpr sg(seed + 2 * v, sopt), mg(seed + 2 * v + 1, mopt);
    scores[v].root = sg.float_expr(scores[v]);
    masks[v].root = mg.bool_expr(masks[v]);
  }
  // And written ones: indices the emitter leaves unwrapped (h with dim H, kv_idx with KV_LEN, ...)
  // next to wrapped ones far out of range.
  const std::pair<const char*, const char*> written[] = {
      {"score + f[q_idx - kv_idx + 5] * k[1, kv_idx] + bf[q_idx] + g[b, h, kv_idx, q_idx]",
       "i[kv_idx, h] > 0 || m[q_idx, kv_idx * 2147483647, b]"},
      {"score * g[b, h, q_idx - 2147483647 - 1, kv_idx * -1000000007] - "
       "k[q_idx + 2147483647, q_idx]",
       "bf[kv_idx * 65537 - q_idx] < bf[q_idx] && i[-2147483648, h] != 0"},
      // Two relative terms (one an int, one reading b and a param), beside a column load.
      {"score * exp(float(kv_idx - q_idx) / pf) + k[1, kv_idx] - float(g[b, h, 1, "
       "(q_idx - kv_idx) % 3] > 0.0 ? abs(kv_idx - q_idx) % pi : (q_idx - kv_idx) // 3) + "
       "score / 0.25 - pf / -8.0",
       "true"},
  };
  for (const auto& [score, mask] : written) {
    scores.push_back(parse_mod(ModKind::Score, score, decls, "score_mod").graph);
    masks.push_back(parse_mod(ModKind::Mask, mask, decls, "mask_mod").graph);
  }

  // The host program: every variant's header in its own namespace, evaluated at every point.
  const fs::path dir = fs::temp_directory_path() / fmt::format("flexc_emit_{}", getpid());
  fs::create_directories(dir);
  std::string prog =
      std::string(kShim) + "#include \"" FLEXC_SOURCE_DIR "/templates/flexc_hooks.cuh\"\n";
  for (size_t v = 0; v < scores.size(); ++v) {
    // Distinct names keep the headers distinct: GCC's #pragma once merges identical files.
    const std::string h =
        emit_cuda_variant({&scores[v], &masks[v], &decls, fmt::format("random{}", v)});
    std::ofstream(dir / fmt::format("v{}.cuh", v)) << h;
    prog += fmt::format("namespace v{0} {{\n#include \"v{0}.cuh\"\n}}\n", v);
  }
  for (size_t c = 0; c < bufs.size(); ++c)
    prog += fmt::format("unsigned char data{}[] = {{{}}};\nfloat grad{}[{}];\n", c,
                        c_bytes(bufs[c].bytes), c, bufs[c].grad.size());
  prog += "struct P { int b, h, q, kv, q_len, kv_len; unsigned score; };\nP points[] = {";
  for (const Point& p : points)
    prog += fmt::format("{{{},{},{},{},{},{},0x{}u}},", p.b, p.h, p.q, p.kv, p.q_len, p.kv_len,
                        hex_bits(p.score));
  prog += "};\nint main() {\n  FlexcArgs a{};\n";
  for (size_t c = 0; c < bufs.size(); ++c) {
    prog += fmt::format("  a.captures[{0}].data = data{0}; a.captures[{0}].grad = grad{0};\n", c);
    for (size_t k = 0; k < 4; ++k)
      prog += fmt::format("  a.captures[{}].shape[{}] = {}; a.captures[{}].stride[{}] = {};\n", c,
                          k, k < bufs[c].shape.size() ? bufs[c].shape[k] : 1, c, k,
                          k < bufs[c].strides.size() ? bufs[c].strides[k] : 0);
  }
  prog += fmt::format("  a.fparam[0] = std::bit_cast<float>(0x{}u); a.iparam[1] = {};\n",
                      hex_bits(pf), pi);
  for (size_t v = 0; v < scores.size(); ++v) {
    prog += fmt::format(
        "  for (const P& p : points) {{\n"
        "    const float s = std::bit_cast<float>(p.score);\n"
        "    const float r = v{0}::FlexcVariant::score_mod(a, s, p.b, p.h, p.q, p.kv, p.q_len, "
        "p.kv_len);\n"
        "    const float g = v{0}::FlexcVariant::score_mod_grad(a, s, p.b, p.h, p.q, p.kv, "
        "p.q_len, p.kv_len);\n"
        "    const bool m = v{0}::FlexcVariant::mask_mod(a, p.b, p.h, p.q, p.kv, p.q_len, "
        "p.kv_len);\n"
        "    FlexcGradSink<v{0}::FlexcVariant::kCaptureGradLoads> grads;\n"
        "    v{0}::FlexcVariant::accumulate_capture_grads(a, grads, 0.5f, s, p.b, p.h, p.q, p.kv, "
        "p.q_len, p.kv_len);\n"
        "    grads.flush_thread();\n"
        // The twins (column and tile loads, relative terms made ahead, then read back) give
        // the same bits, or both NaN (the compiler may order a max's operands differently in
        // the two functions, and which NaN comes out is not part of the result: the
        // interpreter check below compares NaN as NaN too).
        "    unsigned cv[5] = {{}};\n"
        "    v{0}::FlexcVariant::score_columns(a, p.b, p.h, p.q, p.kv, p.q_len, p.kv_len, cv);\n"
        "    v{0}::FlexcVariant::score_tiles(a, p.b, p.h, p.q, p.kv, p.q_len, p.kv_len,\n"
        "                                    cv + v{0}::FlexcVariant::kScoreColumnLoads);\n"
        "    v{0}::FlexcVariant::score_rel_terms(a, p.b, p.h, flexc_sub(p.kv, p.q), p.q_len,\n"
        "        p.kv_len, cv + v{0}::FlexcVariant::kScoreColumnLoads +\n"
        "                  v{0}::FlexcVariant::kScoreTileLoads);\n"
        "    const float rc = v{0}::FlexcVariant::score_mod_cols(a, s, p.b, p.h, p.q, p.kv, "
        "p.q_len, p.kv_len, cv);\n"
        "    if (std::bit_cast<unsigned>(rc) != std::bit_cast<unsigned>(r) && "
        "!(std::isnan(rc) && std::isnan(r))) {{\n"
        "      std::fprintf(stderr, \"variant {0}: score_mod_cols differs\\n\");\n"
        "      return 3;\n"
        "    }}\n"
        "    std::printf(\"%08x %08x %d\\n\", std::bit_cast<unsigned>(r), "
        "std::bit_cast<unsigned>(g), (int)m);\n"
        "  }}\n",
        v);
  }
  for (size_t c = 0; c < bufs.size(); ++c)
    prog += fmt::format(
        "  for (float x : grad{}) std::printf(\"%08x\\n\", std::bit_cast<unsigned>(x));\n", c);
  prog += "}\n";
  run_host_program(dir, prog, "-ffp-contract=off");

  // The same on the interpreter, F32 mode.
  std::vector<HostTensor> tensors;
  for (const Buffer& b : bufs) tensors.push_back({b.dtype, b.bytes.data(), b.shape, b.strides});
  const double params[] = {pf, static_cast<double>(pi)};
  std::ifstream out(dir / "out.txt");
  std::vector<Value> scratch;
  for (size_t v = 0; v < scores.size(); ++v) {
    const Graph s = simplify(scores[v]), m = simplify(masks[v]);
    Graph dg = s;
    const NodeId droot = derivative_wrt_score(dg, dg.root);
    Graph cg = s;
    const std::vector<LoadDerivative> loads = derivatives_wrt_loads(cg, cg.root);
    for (const Point& p : points) {
      EvalEnv env;
      env.ints = {0, p.b, p.h, p.q, p.kv, p.q_len, p.kv_len};
      env.score = p.score;
      env.params = params;
      env.captures = tensors;
      const float want_s = static_cast<float>(evaluate(s, env, Precision::F32, scratch).f);
      const float want_g = static_cast<float>(evaluate(dg, droot, env, Precision::F32, scratch).f);
      const bool want_m = evaluate(m, env, Precision::F32, scratch).i != 0;
      for (const LoadDerivative& ld : loads) {
        const Node& load = cg[ld.load];
        const Buffer& buf = bufs[load.slot];
        int64_t off = 0;
        for (int k = 0; k < load.nargs; ++k) {
          const int64_t i = evaluate(cg, load.args[k], env, Precision::F32, scratch).i;
          off += ((i % buf.shape[k]) + buf.shape[k]) % buf.shape[k] * buf.strides[k];
        }
        const float d =
            static_cast<float>(evaluate(cg, ld.derivative, env, Precision::F32, scratch).f);
        bufs[load.slot].grad[static_cast<size_t>(off)] += 0.5f * d;
      }
      std::string got_s, got_g;
      int got_m = -1;
      out >> got_s >> got_g >> got_m;
      INFO("variant " << v << ": score_mod " << to_text(s, s.root, decls) << "; mask_mod "
                      << to_text(m, m.root, decls) << "; at b=" << p.b << " h=" << p.h << " q="
                      << p.q << " kv=" << p.kv << " kv_len=" << p.kv_len << " score=" << p.score);
      const auto same = [](const std::string& got, float want) {
        return std::isnan(want) ? std::isnan(std::bit_cast<float>(
                                      static_cast<uint32_t>(std::stoul(got, nullptr, 16))))
                                : got == hex_bits(want);
      };
      CHECK(same(got_s, want_s));
      CHECK(same(got_g, want_g));
      CHECK(got_m == static_cast<int>(want_m));
    }
  }
  for (const Buffer& b : bufs)
    for (float want : b.grad) {
      std::string got;
      out >> got;
      const float g = std::bit_cast<float>(static_cast<uint32_t>(std::stoul(got, nullptr, 16)));
      if (std::isnan(want))
        CHECK(std::isnan(g));
      else
        CHECK(g == want);
    }
  fs::remove_all(dir);
}

TEST_CASE("fast tanh's forms: tanhf's polynomial below 0.6, and the bound (host build)", "[emit]") {
  // FlexcTanhSmall is tanhf's polynomial branch (the GPU test "fast tanh is tanhf's bits in
  // either form a warp takes" checks the bits); here its accuracy below 0.6 against float64, and
  // FlexcTanhBound through a softcap's hooks: the largest |score / cap| over the calls.
  Decls d;
  d.params.push_back({"cap", Type::Float, 0, false});
  const Parsed softcap = parse("cap * tanh(score / cap)", "true", d);
  const fs::path dir = fs::temp_directory_path() / fmt::format("flexc_tanh_{}", getpid());
  fs::create_directories(dir);
  std::ofstream(dir / "v.cuh") << emit_fast(softcap);
  std::string prog =
      std::string(kShim) +
      "#include \"" FLEXC_SOURCE_DIR
      "/templates/flexc_hooks.cuh\"\n"
      "#include \"v.cuh\"\n"
      "int main() {\n"
      "  double worst = 0;\n"
      "  for (int i = -(1 << 20); i < (1 << 20); ++i) {\n"
      "    const float x = std::nextafter(0.6f, 0.0f) * (i + 0.5f) / (1 << 20);\n"
      "    const double t = std::tanh((double)x);\n"
      "    worst = std::max(worst, std::abs(FlexcTanhSmall{}(x) - t) / std::abs(t));\n"
      "  }\n"
      "  FlexcArgs a{};\n"
      "  a.fparam[0] = 7.5f;\n"
      "  float bound = 0.0f;\n"
      "  const float scores[] = {1.0f, -30.0f, 4.0f};\n"
      "  for (float s : scores)\n"
      "    FlexcVariant::score_mod(a, s, 0, 0, 1, 2, 3, 4, FlexcTanhBound{bound});\n"
      "  std::printf(\"%a %a\\n\", worst, bound);\n"
      "}\n";
  run_host_program(dir, prog, "");
  std::ifstream out(dir / "out.txt");
  std::string worst, bound;
  out >> worst >> bound;
  INFO("relative error " << worst << ", bound " << bound);
  CHECK(std::strtod(worst.c_str(), nullptr) <= 0x1p-22);
  CHECK(std::strtod(bound.c_str(), nullptr) == static_cast<double>(30.0f * (1.0f / 7.5f)));
  fs::remove_all(dir);
}

TEST_CASE("fast float math's folding keeps each value (host build)", "[emit]") {
  // Every folding rule (a uniform term on either side of + and -, a uniform factor on either side
  // of *, division by a uniform value and of one, terms of the same atom, negation) and every
  // expansion (exp, exp2, log, tanh, sigmoid), through param-valued factors too: the fast hooks,
  // built on the host (where the approximate instructions are the exact operations), against
  // the interpreter in float64. Only rounding may differ.
  Decls d;
  d.params.push_back({"pf", Type::Float, 0, false});
  d.params.push_back({"pi", Type::Int, 0, false});
  const char* mods[] = {
      "pf * tanh(score / pf)",
      "30.0 * tanh(score / 30.0)",
      "score * sigmoid(score * 1.702)",
      "(score * 3.0 + pf) / pf - 2.0 * (score - pf) + exp(score / 4.0 - 1.0)",
      "-(score / -pf) * 0.5 + log(2.0 + score * score) / 3.0",
      "score - score * 0.25 + 1.0 / (1.0 + exp(-score))",
      "pf - (score + pf) * float(pi) + exp2(0.5 * score - pf)",
      "(pf + 1.0) / (score * score + 1.0) - tanh(2.0 * score + 1.0) * (pf - 4.0)",
      "score + float(kv_idx - q_idx) * pf / 8.0 - sigmoid(-score / pf + 0.5) * 3.0",
      // Row terms (score_mod_rowless + row_terms): a rest that is negated, one of kv_idx, none.
      "pf * float(q_idx + 1) - score - 2.0",
      "score * 0.5 - (float(q_idx) * pf - float(kv_idx)) + exp(float(q_idx) / 4.0)",
      "float(q_idx) / pf",
      // Units: positive constant factors of the rest (over a rest that is the identity too).
      "(tanh(score / 8.0) * 2.0 + score) / 4.0 + float(q_idx)",
      "score * 0.5",
  };
  const float pfs[] = {2.5f, -0.75f};
  const int pi = 3;
  const fs::path dir = fs::temp_directory_path() / fmt::format("flexc_fold_{}", getpid());
  fs::create_directories(dir);
  std::string prog =
      std::string(kShim) + "#include \"" FLEXC_SOURCE_DIR "/templates/flexc_hooks.cuh\"\n";
  std::vector<Graph> graphs;
  for (size_t v = 0; v < std::size(mods); ++v) {
    const Parsed p = parse(mods[v], "true", d);
    graphs.push_back(p.score.graph);
    const std::string h = emit_cuda_variant(
        {&p.score.graph, &p.mask.graph, &p.decls, fmt::format("fold{}", v), FloatMath::Fast});
    std::ofstream(dir / fmt::format("v{}.cuh", v)) << h;
    prog += fmt::format("namespace v{0} {{\n#include \"v{0}.cuh\"\n}}\n", v);
  }
  std::vector<float> scores = {0.0f, -0.0f, 1e-3f, -7.5f, 40.0f, -40.0f};
  for (int i = 0; i < 40; ++i)
    scores.push_back(std::uniform_real_distribution<float>(-20, 20)(rng()));
  prog += "int main() {\n  FlexcArgs a{};\n";
  prog += fmt::format("  a.iparam[1] = {};\n  const float s[] = {{", pi);
  for (float x : scores) prog += fmt::format("std::bit_cast<float>(0x{}u),", hex_bits(x));
  prog += fmt::format("}};\n  const float pfs[] = {{{}f, {}f}};\n", pfs[0], pfs[1]);
  prog += "  for (float pf : pfs)\n  for (float x : s) {\n";
  prog += "    a.fparam[0] = pf;\n";
  for (size_t v = 0; v < std::size(mods); ++v)
    prog += fmt::format(
        "    std::printf(\"%a %a %a\\n\", v{0}::FlexcVariant::score_mod(a, x, 0, 0, 5, 2, 7, 11), "
        "v{0}::FlexcVariant::score_mod_grad(a, x, 0, 0, 5, 2, 7, 11), "
        "v{0}::FlexcVariant::row_terms(a, v{0}::FlexcVariant::kRowlessUnits * "
        "v{0}::FlexcVariant::score_mod_rowless(a, x, 0, 0, 5, 2, 7, 11), 0, 0, 5, 0, 7, 11));\n",
        v);
  prog += "  }\n}\n";
  run_host_program(dir, prog, "");
  std::ifstream out(dir / "out.txt");
  std::vector<Value> scratch;
  for (float pf : pfs)
    for (float x : scores)
      for (size_t v = 0; v < std::size(mods); ++v) {
        const double params[] = {pf, static_cast<double>(pi)};
        const Graph s = simplify(graphs[v]);
        Graph dg = s;
        const NodeId droot = derivative_wrt_score(dg, dg.root);
        EvalEnv env;
        env.ints = {0, 0, 0, 5, 2, 7, 11};
        env.score = x;
        env.params = params;
        const double want = evaluate(s, env, Precision::F64, scratch).f;
        const double want_g = evaluate(dg, droot, env, Precision::F64, scratch).f;
        std::string got, got_g, got_split;
        out >> got >> got_g >> got_split;
        INFO(mods[v] << " at score " << x << ", pf " << pf << ": got " << got << ", " << got_g
                     << " and (rows apart) " << got_split << ", want " << want << " and "
                     << want_g);
        // A few float32 roundings of terms up to 40 in size.
        CHECK(std::abs(std::strtod(got.c_str(), nullptr) - want) <=
              1e-5 * std::max(1.0, std::abs(want)) + 2e-5);
        CHECK(std::abs(std::strtod(got_split.c_str(), nullptr) - want) <=
              1e-5 * std::max(1.0, std::abs(want)) + 2e-5);
        CHECK(std::abs(std::strtod(got_g.c_str(), nullptr) - want_g) <=
              1e-5 * std::max(1.0, std::abs(want_g)) + 2e-5);
      }
  fs::remove_all(dir);
}
