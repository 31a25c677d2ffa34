// flexc::Variant: the catalogue, JSON configs and their error messages, composition, analyses.
#include <fmt/format.h>

#include <catch2/catch.hpp>
#include <fstream>
#include <random>
#include <sstream>
#include <string>

#include "dsl/analysis.h"
#include "flexc/variant.h"
#include "variant_impl.h"
#include "test_random.h"

using flexc::CaptureSpec;
using flexc::ParamSpec;
using flexc::Variant;

namespace {

// The message a config is rejected with ("" when it loads).
std::string json_error(const std::string& json) {
  try {
    Variant::from_json(json, "t.json");
  } catch (const flexc::Error& e) {
    return e.what();
  }
  return "";
}

// A config with `body` spliced into {"name": "t", ...}.
std::string config(const std::string& body) { return R"({"name": "t", )" + body + "}"; }

bool mask_at(const Variant& v, int64_t q, int64_t kv, std::span<const double> params) {
  flexc::dsl::EvalEnv env;
  env.ints[static_cast<int>(flexc::dsl::Input::QIdx)] = q;
  env.ints[static_cast<int>(flexc::dsl::Input::KvIdx)] = kv;
  env.params = params;
  return flexc::dsl::evaluate(flexc::detail::impl_of(v).mask.graph, env).i != 0;
}

}  // namespace

TEST_CASE("the catalogue has exactly the documented entries, and each loads", "[variant]") {
  const std::vector<std::string> expected = {
      "alibi",     "causal",           "causal_bottom_right", "chunked",         "dilated_window",
      "document",  "document_batched", "global_local",        "neighborhood_2d", "noop",
      "prefix_lm", "sink_window",      "sliding_window",      "softcap",         "t5_bias"};
  REQUIRE(Variant::catalogue_names() == expected);
  for (const std::string& name : expected) {
    INFO(name);
    const Variant v = Variant::from_catalogue(name);
    CHECK(v.name() == name);
    CHECK(v.description().size() > 40);
    // The same file from the source tree gives the same variant.
    const Variant f = Variant::from_json_file(
        fmt::format("{}/examples/variants/{}.json", FLEXC_SOURCE_DIR, name));
    CHECK(f.score_mod_text() == v.score_mod_text());
    CHECK(f.mask_mod_text() == v.mask_mod_text());
    // Normalized texts are valid input that normalizes to themselves.
    const Variant again = Variant::from_strings(v.score_mod_text(), v.mask_mod_text(), v.captures(),
                                                v.params(), name);
    CHECK(again.score_mod_text() == v.score_mod_text());
    CHECK(again.mask_mod_text() == v.mask_mod_text());
    CHECK_FALSE(v.score_grad_text().empty());
  }
  CHECK(Variant::from_catalogue("@causal").mask_mod_text() == "q_idx >= kv_idx");
  CHECK(Variant::load("@causal").name() == "causal");
  CHECK(Variant::load(FLEXC_SOURCE_DIR "/examples/variants/alibi.json").name() == "alibi");
}

TEST_CASE("catalogue entries mean what their names say", "[variant]") {
  CHECK(Variant::from_catalogue("causal_bottom_right").mask_mod_text() ==
        "q_idx + kv_len - q_len >= kv_idx");
  CHECK(Variant::from_catalogue("sliding_window").mask_mod_text() ==
        "q_idx >= kv_idx && q_idx - kv_idx < window");
  CHECK(Variant::from_catalogue("prefix_lm").mask_mod_text() ==
        "kv_idx < prefix || q_idx >= kv_idx");
  CHECK(Variant::from_catalogue("document_batched").mask_mod_text() ==
        "doc[b, q_idx] == doc[b, kv_idx]");
  CHECK(Variant::from_catalogue("chunked").mask_mod_text() == "q_idx // chunk >= kv_idx // chunk");

  // Random points against the definitions, with random runtime param values.
  std::mt19937_64 rng(flexc::testing::fresh_seed());
  std::uniform_int_distribution<int64_t> idx(0, 5000), small(1, 300);
  const Variant sw = Variant::from_catalogue("sliding_window");
  const Variant sink = Variant::from_catalogue("sink_window");
  const Variant dil = Variant::from_catalogue("dilated_window");
  REQUIRE(sink.params().size() == 2);
  REQUIRE(sink.params()[0].name == "sinks");
  REQUIRE(dil.params()[0].name == "window");
  for (int i = 0; i < 2000; ++i) {
    const int64_t q = idx(rng), kv = idx(rng), w = small(rng), s = small(rng) % 8,
                  d = small(rng) % 5 + 1;
    const double pw[] = {double(w)}, ps[] = {double(s), double(w)}, pd[] = {double(w), double(d)};
    CHECK(mask_at(sw, q, kv, pw) == (q >= kv && q - kv < w));
    CHECK(mask_at(sink, q, kv, ps) == (q >= kv && (kv < s || q - kv < w)));
    CHECK(mask_at(dil, q, kv, pd) == (q >= kv && q - kv < w * d && (q - kv) % d == 0));
  }
}

TEST_CASE("JSON errors name the file, the path and what is wrong", "[variant]") {
  const std::string cap = R"({"name": "a", "dtype": "float32", "shape": ["H"]})";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {config(R"("mask_mdo": "true")"),
       "t.json: mask_mdo: unknown key (did you mean \"mask_mod\"?); expected one of name, "
       "description, score_mod, mask_mod, captures, params, precision"},
      {config(R"("precision": "fats")"),
       "t.json: precision: expected one of fast, exact, approx, got \"fats\" (did you mean "
       "\"fast\"?)"},
      {config(R"("precision": true)"), "t.json: precision: expected a string, got true"},
      {config(R"("captures": [)" + cap + R"(, {"name": "y", "dtype": "flaot32", "shape": [4]}])"),
       "t.json: captures[1].dtype: expected one of int32, float32, bf16, fp16, bool, got "
       "\"flaot32\" (did you mean \"float32\"?)"},
      {config(R"("captures": [{"name": "a", "dtype": "float32", "shape": []}])"),
       "t.json: captures[0].shape: expected 1 to 4 dims, got 0"},
      {config(R"("captures": [{"name": "a", "dtype": "bf16", "shape": [1, 2, 3, 4, 5]}])"),
       "t.json: captures[0].shape: expected 1 to 4 dims, got 5"},
      {config(R"("captures": [{"name": "a", "dtype": "fp16", "shape": ["H", "Q_LNE"]}])"),
       "t.json: captures[0].shape[1]: expected a positive integer (int32) or one of B, H, Q_LEN, "
       "KV_LEN, got \"Q_LNE\" (did you mean \"Q_LEN\"?)"},
      {config(R"("captures": [{"name": "a", "dtype": "fp16", "shape": [0]}])"),
       "t.json: captures[0].shape[0]: expected a positive integer (int32) or one of B, H, Q_LEN, "
       "KV_LEN, got \"0\""},
      {config(R"("captures": [)" + cap +
              R"(], "params": [{"name": "a", "type": "int", "default": 1}])"),
       "t.json: params[0].name: \"a\" is already declared at captures[0].name"},
      {config(R"("captures": [{"name": "exp", "dtype": "float32", "shape": ["H"]}])"),
       "t.json: captures[0].name: \"exp\" is reserved by the language (an input, a built-in "
       "function or a literal); choose another name"},
      {config(R"("params": [{"name": "2x", "type": "int", "default": 1}])"),
       "t.json: params[0].name: expected an identifier (letters, digits and '_', not starting "
       "with a digit), got \"2x\""},
      {config(R"("captures": {"name": "a"})"), "t.json: captures: expected a list, got an object"},
      {R"({"name": 7})", "t.json: name: expected a string, got 7"},
      {R"(["name"])", "t.json: (top level): expected an object, got a list"},
      {R"({"description": "x"})", "t.json: (top level): missing key \"name\""},
      {config(R"("mask_mod": "true", "mask_mod": "false")"),
       "t.json: (top level): duplicate key \"mask_mod\""},
      {config(R"("params": [{"name": "w", "type": "int", "default": 2.5}])"),
       "t.json: params[0].default: expected an integer in the int32 range for int param \"w\", "
       "got 2.5"},
      {config(R"("params": [{"name": "w", "type": "int", "default": "3"}])"),
       "t.json: params[0].default: expected a number, got the string \"3\""},
      {config(R"("params": [{"name": "w", "type": "int", "default": 3, "kind": "runtim"}])"),
       "t.json: params[0].kind: expected one of runtime, const, got \"runtim\" (did you mean "
       "\"runtime\"?)"},
      {config(R"("params": [{"name": "w", "type": "integer", "default": 3}])"),
       "t.json: params[0].type: expected one of int, float, got \"integer\""},
      {config(R"("params": [{"name": "w", "type": "float"}])"),
       "t.json: params[0]: missing key \"default\""},
      {config(R"("mask_mod": {"and": []})"),
       "t.json: mask_mod.and: expected a non-empty list of masks, got an empty list"},
      {config(R"("mask_mod": {"and": ["true"], "or": ["true"]})"),
       "t.json: mask_mod: expected exactly one of \"and\", \"or\", \"not\", got 2 keys"},
      {config(R"("mask_mod": {"nto": "true"})"),
       "t.json: mask_mod.nto: unknown key (did you mean \"not\"?); expected one of and, or, not"},
      {config(R"("mask_mod": 1)"),
       "t.json: mask_mod: expected a mask: an expression, \"@name\" of a catalogue entry, or an "
       "object {\"and\": [...]}, {\"or\": [...]} or {\"not\": ...}; got 1"},
  };
  for (const auto& [json, message] : cases) {
    INFO(json);
    CHECK(json_error(json) == message);
  }
}

TEST_CASE("precision: fast by default, exact on request, kept by composition", "[variant]") {
  const Variant fast = Variant::from_json(config(R"x("score_mod": "30.0 * tanh(score / 30.0)")x"));
  CHECK(fast.precision() == flexc::Precision::Fast);
  const Variant exact =
      Variant::from_json(config(R"("score_mod": "score * 2.0", "precision": "exact")"));
  CHECK(exact.precision() == flexc::Precision::Exact);
  CHECK(Variant::from_json(config(R"("precision": "fast")")).precision() == flexc::Precision::Fast);
  // with_precision copies; the original is unchanged.
  const Variant e = fast.with_precision(flexc::Precision::Exact);
  CHECK(e.precision() == flexc::Precision::Exact);
  CHECK(fast.precision() == flexc::Precision::Fast);
  CHECK(e.score_mod_text() == fast.score_mod_text());
  CHECK(e.renamed("x").precision() == flexc::Precision::Exact);
  // The launch facts follow: fast math tabulates two relative terms of a sum as one, exact as two
  // (the kernel's launch sizes their tables by them).
  const Variant two = Variant::from_json(config(
      R"("score_mod": "score + where((q_idx - kv_idx) % 7 == 0, 0.5, 0.0) - float(abs(q_idx - kv_idx) // 64) * 0.01")"));
  CHECK(flexc::detail::impl_of(two).facts.score_rel_terms == 1);
  const Variant two_exact = two.with_precision(flexc::Precision::Exact);
  CHECK(flexc::detail::impl_of(two_exact).facts.score_rel_terms == 2);
  CHECK(flexc::detail::impl_of(two_exact.with_precision(flexc::Precision::Fast))
            .facts.score_rel_terms == 1);
  // Combined variants are exact if either side is.
  const Variant causal = Variant::from_catalogue("causal");
  CHECK(and_masks(causal, exact).precision() == flexc::Precision::Exact);
  CHECK(or_masks(fast, causal).precision() == flexc::Precision::Fast);
  CHECK(compose(fast, exact).precision() == flexc::Precision::Exact);
  CHECK(compose(fast, causal).precision() == flexc::Precision::Fast);
  CHECK(not_mask(exact).precision() == flexc::Precision::Exact);
  // Approx combined with anything more accurate takes the more accurate.
  const Variant approx = Variant::from_json(config(R"("precision": "approx")"));
  CHECK(approx.precision() == flexc::Precision::Approx);
  CHECK(compose(approx, fast).precision() == flexc::Precision::Fast);
  CHECK(and_masks(exact, approx).precision() == flexc::Precision::Exact);
  CHECK(compose(approx, approx.renamed("y")).precision() == flexc::Precision::Approx);
  // Names and parsing.
  CHECK(to_string(flexc::Precision::Fast) == "fast");
  CHECK(to_string(flexc::Precision::Exact) == "exact");
  CHECK(to_string(flexc::Precision::Approx) == "approx");
  CHECK(flexc::parse_precision("exact") == flexc::Precision::Exact);
  CHECK(flexc::parse_precision("approx") == flexc::Precision::Approx);
  CHECK_THROWS_WITH(flexc::parse_precision("fastest", "--precision"),
                    "--precision: \"fastest\" is not a precision; use \"fast\", \"exact\" or "
                    "\"approx\"");
}

TEST_CASE("at most FLEXC_MAX_CAPTURES captures and FLEXC_MAX_PARAMS runtime params", "[variant]") {
  std::string caps, params;
  for (int i = 0; i < 9; ++i)
    caps += fmt::format(R"({}{{"name": "c{}", "dtype": "int32", "shape": [4]}})", i ? ", " : "", i);
  CHECK(json_error(config(R"("captures": [)" + caps + "]")) ==
        "t.json: captures: 9 captured tensors; at most 8 are supported");
  for (int i = 0; i < 17; ++i)
    params += fmt::format(R"({}{{"name": "p{}", "type": "int", "default": 1}})", i ? ", " : "", i);
  CHECK(json_error(config(R"("params": [)" + params + "]")) ==
        "t.json: params: 17 runtime params; at most 16 are supported (const params do not "
        "count)");
  // Const params do not take a kernel argument slot.
  std::vector<ParamSpec> specs;
  for (int i = 0; i < 16; ++i) specs.push_back({fmt::format("r{}", i), "int", 1, false});
  specs.insert(specs.begin(), ParamSpec{"k", "float", 2, true});
  const Variant v = Variant::from_strings("score * k + r15", "true", {}, specs);
  REQUIRE(v.params().size() == 17);
  CHECK(v.params()[15].name == "r15");  // runtime params first, each group in order
  CHECK(v.params()[16].name == "k");
  CHECK(v.score_mod_text() == "score * 2.0 + float(r15)");
  std::vector<ParamSpec> many;
  for (int i = 0; i < 257; ++i) many.push_back({fmt::format("k{}", i), "int", double(i), true});
  CHECK_THROWS_WITH(Variant::from_strings("score", "true", {}, many, "v"),
                    "v: params: 257 params; at most 256 may be declared");
}

TEST_CASE("JSON syntax errors give line:col", "[variant]") {
  CHECK(json_error("{\n  \"name\": \"t\",\n  \"mask_mod\": tru\n}")
            .starts_with(
                "t.json:3:18: invalid JSON: syntax error while parsing value - invalid literal"));
  CHECK(json_error("{\"name\": \"t\",}").starts_with("t.json:1:14: invalid JSON: "));
  CHECK(json_error("").starts_with("t.json:1:1: invalid JSON: "));
  // Nesting is bounded, not a stack overflow.
  CHECK(json_error(std::string(100000, '[')) ==
        "t.json: [0][0][0][0][0][0][0][0][0][0][0][0][0][0][0][0][0][0][0][0][0][0][0][0][0][0]"
        "[0][0][0][0][0][0]: JSON nested more than 32 levels deep");
  CHECK(json_error(config(R"("captures": [{"name": "a", "name": "b"}])")) ==
        "t.json: captures[0]: duplicate key \"name\"");
}

TEST_CASE("expression errors inside a config give the path and line:col", "[variant]") {
  const std::string e =
      json_error(config(R"("mask_mod": {"and": ["q_idx >= kv_idx", "q_idx < kv_id + 1"]})"));
  CHECK(e.starts_with("t.json: mask_mod.and[1]:1:9: error: unknown name 'kv_id'"));
  CHECK(e.find("did you mean 'kv_idx'?") != std::string::npos);
  // A list of strings is the expression's lines.
  const std::string lines =
      json_error(config(R"("score_mod": ["let x = score;", "x + q_idx * 2.0 +"])"));
  CHECK(lines.starts_with("t.json: score_mod:2:18: error: "));
  CHECK(json_error(config(R"("mask_mod": {"not": {"or": ["true", "@casual"]}})"))
            .starts_with("t.json: mask_mod.not.or[1]: unknown catalogue entry \"@casual\" (did you "
                         "mean \"@causal\"?); the catalogue has @alibi, @causal, "));
  CHECK(
      json_error(config(R"("score_mod": "q_idx")")).starts_with("t.json: score_mod:1:1: error: "));
  CHECK(json_error(config(R"("mask_mod": "@causal && q_idx > 0")"))
            .ends_with("@t5_bias; a reference is a mask of its own: combine it with {\"and\": "
                       "[\"@name\", \"expression\"]}"));
}

TEST_CASE("the C++ API checks declarations like the JSON loader", "[variant]") {
  auto error = [](auto&& make) {
    try {
      make();
    } catch (const flexc::Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK(error([] {
          Variant::from_strings("score", "true", {{"bias", "float", {"H"}}}, {}, "v");
        }) ==
        "v: captures[0].dtype: expected one of int32, float32, bf16, fp16, bool, got \"float\" "
        "(did you mean \"float32\"?)");
  CHECK(error([] {
          Variant::from_strings("score", "true", {}, {{"w", "int", 1.5, false}}, "v");
        }).starts_with("v: params[0].default: expected an integer"));
  CHECK(error([] {
          Variant::from_strings("score", "true", {}, {}, "bad name");
        }).starts_with("bad name: name: expected up to 128 letters"));
  CHECK(error([] {
          Variant::from_strings("score + q", "true", {}, {}, "v");
        }).starts_with("v: score_mod:1:9: error: unknown name 'q'"));
  CHECK(error([] { Variant::from_json_file("/nonexistent/x.json"); }) ==
        "cannot read variant config /nonexistent/x.json: No such file or directory");
  CHECK(error([] {
          Variant::from_catalogue("alibii");
        }).starts_with("unknown catalogue entry \"@alibii\" (did you mean \"@alibi\"?)"));
  CHECK(error([] {
          Variant::from_catalogue("noop").renamed("a b");
        }).starts_with("renaming \"noop\": name: expected"));
  CHECK(Variant::from_catalogue("noop").renamed("plain").name() == "plain");
  // Dims are normalized.
  const Variant v =
      Variant::from_strings("score + t[h, 0]", "true", {{"t", "bf16", {"H", "007"}}}, {}, "v");
  CHECK(v.captures()[0].dims == std::vector<std::string>{"H", "7"});
}

TEST_CASE("composition on the IR", "[variant]") {
  const Variant causal = Variant::from_catalogue("causal");
  const Variant near = Variant::from_strings("score", "q_idx - kv_idx < 8", {}, {}, "near");
  const Variant a = and_masks(causal, near);
  CHECK(a.name() == "causal_and_near");
  CHECK(a.mask_mod_text() == "q_idx >= kv_idx && q_idx - kv_idx < 8");
  CHECK(a.identity_score());
  CHECK(or_masks(causal, near).mask_mod_text() == "q_idx >= kv_idx || q_idx - kv_idx < 8");
  CHECK(not_mask(causal).name() == "not_causal");
  const Variant n = not_mask(causal);
  for (int q = 0; q < 4; ++q)
    for (int kv = 0; kv < 4; ++kv) CHECK(mask_at(n, q, kv, {}) == (q < kv));

  const Variant softcap = Variant::from_catalogue("softcap");
  const Variant alibi = Variant::from_catalogue("alibi");
  const Variant c = compose(softcap, alibi);
  CHECK(c.name() == "softcap_of_alibi");
  CHECK(c.score_mod_text() == "cap * tanh((score + slope[h] * float(kv_idx - q_idx)) / cap)");
  CHECK(c.captures().size() == 1);
  CHECK(c.params().size() == 1);
  CHECK(compose(Variant::from_catalogue("noop"), alibi).score_mod_text() == alibi.score_mod_text());
  CHECK(compose(causal, alibi).mask_mod_text() == "q_idx >= kv_idx");

  // Declarations merge by name; the same name must declare the same thing.
  const Variant sw = Variant::from_catalogue("sliding_window");
  const Variant merged = and_masks(sw, Variant::from_catalogue("sink_window"));
  REQUIRE(merged.params().size() == 2);
  CHECK(merged.params()[0].name == "window");
  CHECK(merged.params()[1].name == "sinks");
  const Variant other = Variant::from_strings("score", "kv_idx < window", {},
                                              {{"window", "float", 1024, false}}, "other");
  CHECK_THROWS_WITH(and_masks(sw, other),
                    "and_masks(sliding_window, other): conflicting declarations of \"window\": a "
                    "runtime int param (default 1024) and a runtime float param (default 1024)");
  const Variant doc_param =
      Variant::from_strings("score", "doc > 0", {}, {{"doc", "int", 0, false}}, "dp");
  CHECK_THROWS_WITH(or_masks(Variant::from_catalogue("document"), doc_param),
                    "or_masks(document, dp): conflicting declarations of \"doc\": a int32 capture "
                    "[KV_LEN] and a runtime int param (default 0)");
  // Both sides modifying the score is a conflict, unless they do the same.
  CHECK_THROWS_WITH(and_masks(alibi, softcap), Catch::Contains("both variants modify the score"));
  CHECK(and_masks(alibi, alibi).score_mod_text() == alibi.score_mod_text());
  CHECK(and_masks(alibi, causal).score_mod_text() == alibi.score_mod_text());
}

TEST_CASE("composition renumbers param and capture slots", "[variant]") {
  // a reads (p, q), b reads (q, r, s const): the merged slots differ from both sides'.
  const Variant a = Variant::from_strings("score", "q_idx < p && kv_idx < q", {},
                                          {{"p", "int", 0, false}, {"q", "int", 0, false}}, "a");
  const Variant b = Variant::from_strings(
      "score", "q_idx + s > r || kv_idx == q", {},
      {{"s", "int", 3, true}, {"q", "int", 0, false}, {"r", "int", 0, false}}, "b");
  const Variant v = or_masks(b, a);
  REQUIRE(v.params().size() == 4);
  std::vector<std::string> names;
  for (const ParamSpec& p : v.params()) names.push_back(p.name);
  CHECK(names == std::vector<std::string>{"q", "r", "p", "s"});
  std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<int64_t> d(0, 20);
  for (int i = 0; i < 500; ++i) {
    const int64_t q_idx = d(rng), kv_idx = d(rng), p = d(rng), q = d(rng), r = d(rng);
    const double slots[] = {double(q), double(r), double(p), 3};
    CHECK(mask_at(v, q_idx, kv_idx, slots) ==
          ((q_idx + 3 > r || kv_idx == q) || (q_idx < p && kv_idx < q)));
  }
  // Captures likewise: the merged variant reads `y` at slot 0 and `x` at slot 1.
  const Variant cx =
      Variant::from_strings("score", "x[q_idx] > 0", {{"x", "int32", {"Q_LEN"}}}, {}, "cx");
  const Variant cy =
      Variant::from_strings("score", "y[kv_idx] > 0", {{"y", "int32", {"KV_LEN"}}}, {}, "cy");
  const Variant xy = and_masks(cy, cx);
  REQUIRE(xy.captures().size() == 2);
  CHECK(xy.captures()[0].name == "y");
  CHECK(xy.mask_mod_text() == "y[kv_idx] > 0 && x[q_idx] > 0");
  const auto deps = xy.mask_deps();
  CHECK(deps.captures == std::vector<std::string>{"y", "x"});
}

TEST_CASE("catalogue references in configs pull the mask and its declarations", "[variant]") {
  const Variant v = Variant::from_json(
      config(R"("mask_mod": {"and": ["@sliding_window", "@document", {"not": "kv_idx == 0"}]})"),
      "t.json");
  CHECK(v.mask_mod_text() ==
        "q_idx >= kv_idx && q_idx - kv_idx < window && doc[q_idx] == doc[kv_idx] && "
        "kv_idx != 0");
  REQUIRE(v.params().size() == 1);
  CHECK(v.params()[0].name == "window");
  REQUIRE(v.captures().size() == 1);
  CHECK(v.captures()[0].name == "doc");
  // Only what the referenced mask reads comes along (not alibi's capture).
  CHECK(Variant::from_json(config(R"("mask_mod": "@alibi")"), "t.json").captures().empty());
  // A declaration of the same name must match the referenced one.
  CHECK(json_error(config(R"("params": [{"name": "window", "type": "int", "default": 5}],
                             "mask_mod": {"or": ["kv_idx < window", "@sliding_window"]})")) ==
        "t.json: mask_mod.or[1]: conflicting declarations of \"window\": a runtime int param "
        "(default 5) and a runtime int param (default 1024)");
}

TEST_CASE("dependencies, identity detection, score derivative", "[variant]") {
  const Variant alibi = Variant::from_catalogue("alibi");
  const flexc::ModDeps s = alibi.score_deps();
  CHECK(s.score);
  CHECK(s.h);
  CHECK(s.q_idx);
  CHECK(s.kv_idx);
  CHECK_FALSE(s.b);
  CHECK_FALSE(s.q_len);
  CHECK(s.captures == std::vector<std::string>{"slope"});
  CHECK(s.params.empty());
  const flexc::ModDeps m = alibi.mask_deps();
  CHECK_FALSE((m.b || m.h || m.q_idx || m.kv_idx || m.score));
  CHECK(alibi.mask_always_true());
  CHECK_FALSE(alibi.identity_score());
  CHECK(alibi.score_grad_text() == "1.0");

  const Variant softcap = Variant::from_catalogue("softcap");
  CHECK(softcap.score_deps().params == std::vector<std::string>{"cap"});
  CHECK(softcap.score_grad_text().find("tanh(score / cap)") != std::string::npos);

  const flexc::ModDeps sw = Variant::from_catalogue("sliding_window").mask_deps();
  CHECK((sw.q_idx && sw.kv_idx && !sw.b && !sw.h));
  CHECK(sw.params == std::vector<std::string>{"window"});
  const flexc::ModDeps db = Variant::from_catalogue("document_batched").mask_deps();
  CHECK((db.b && !db.h));
  CHECK(Variant::from_catalogue("causal_bottom_right").mask_deps().q_len);

  const Variant noop = Variant::from_catalogue("noop");
  CHECK(noop.identity_score());
  CHECK(noop.mask_always_true());
  CHECK(noop.score_grad_text() == "1.0");
  CHECK(Variant::from_strings("score * 1.0").identity_score());
  CHECK_FALSE(Variant::from_strings("score * 2.0").identity_score());
  CHECK(Variant::from_strings("score", "q_idx >= 0 || true").mask_always_true());
  CHECK(Variant::from_strings("score * score").score_grad_text() == "score + score");
}

TEST_CASE("composition cannot build unbounded expressions", "[variant]") {
  // Each step doubles the printed size of the score_mod while its graph grows by a node or two.
  Variant v = Variant::from_strings("score * score + 1.0", "true", {}, {}, "sq");
  std::string error;
  try {
    for (int i = 0; i < 40; ++i) v = compose(v, v).renamed("sq");
  } catch (const flexc::Error& e) {
    error = e.what();
  }
  CHECK_THAT(error, Catch::StartsWith("compose(sq, sq): the score_mod is too large ("));
}

TEST_CASE("t5_bias buckets are T5's", "[variant]") {
  // T5 (bidirectional, 32 buckets, max_distance 128): 16 buckets per direction, distances 0..7
  // exact, then log-spaced with edges at 12, 16, 23, 32, 46, 64, 91.
  auto t5_bucket = [](int64_t rel) {
    const int64_t n = rel < 0 ? -rel : rel;
    int64_t bucket = n < 8 ? n : 8;
    for (int64_t edge : {12, 16, 23, 32, 46, 64, 91})
      if (n >= edge) ++bucket;
    return (rel > 0 ? 16 : 0) + bucket;
  };
  const Variant v = Variant::from_catalogue("t5_bias");
  float bias[2 * 32];  // bias[h, k] = 100 h + k: the score_mod's result names the bucket
  for (int i = 0; i < 64; ++i) bias[i] = static_cast<float>(100 * (i / 32) + i % 32);
  const flexc::dsl::HostTensor t{flexc::dsl::DType::F32, bias, {2, 32}, {}};
  std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<int64_t> pos(0, 4000);
  for (int i = 0; i < 3000; ++i) {
    const int64_t q = pos(rng), kv = i < 600 ? q + i - 300 : pos(rng), h = i % 2;
    flexc::dsl::EvalEnv env;
    env.ints = {0, 0, h, q, kv, 4096, 4096};
    env.captures = std::span(&t, 1);
    for (auto p : {flexc::dsl::Precision::F64, flexc::dsl::Precision::F32}) {
      INFO("q " << q << " kv " << kv);
      CHECK(flexc::dsl::evaluate(flexc::detail::impl_of(v).score.graph, env, p).f ==
            static_cast<double>(100 * h + t5_bucket(kv - q)));
    }
  }
}

TEST_CASE("the configs in docs/variants.md load", "[variant]") {
  std::ifstream in(FLEXC_SOURCE_DIR "/docs/variants.md");
  std::stringstream doc;
  doc << in.rdbuf();
  const std::string text = doc.str();
  int loaded = 0;
  for (size_t at = text.find("```json\n{"); at != std::string::npos;
       at = text.find("```json\n{", at + 1)) {
    const size_t begin = at + 8, end = text.find("```", begin);
    INFO(text.substr(begin, end - begin));
    CHECK_NOTHROW(Variant::from_json(text.substr(begin, end - begin), "variants.md"));
    ++loaded;
  }
  CHECK(loaded >= 2);
}
