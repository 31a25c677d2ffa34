// libFuzzer target: arbitrary bytes as a score_mod and as a mask_mod (with a few declarations),
// through everything user text reaches: lexer, parser, checker, simplify, printer, derivatives,
// CUDA emitter, interpreter and interval analysis. Besides crashes it checks three properties:
//  - the normalized text (what `flexc check` shows) parses back, to the same values;
//  - derivatives and the emitter accept every checked mod;
//  - interval verdicts are sound on a small tile (checked exhaustively against the oracle).
#include <bit>
#include <cmath>
#include <cstdint>
#include <string_view>

#include "dsl/analysis.h"
#include "dsl/emit_cuda.h"
#include "dsl/frontend.h"

namespace dsl = flexc::dsl;

namespace {

const dsl::Decls& decls() {
  static const dsl::Decls d = [] {
    dsl::Decls out;
    out.captures = {
        {"bias", dsl::DType::F32, {{dsl::Dim::H}, {dsl::Dim::Fixed, 16}}},
        {"doc", dsl::DType::I32, {{dsl::Dim::KvLen}}},
        {"flag", dsl::DType::Bool, {{dsl::Dim::B}, {dsl::Dim::QLen}}},
        {"tab",
         dsl::DType::BF16,
         {{dsl::Dim::Fixed, 2}, {dsl::Dim::Fixed, 3}, {dsl::Dim::H}, {dsl::Dim::Fixed, 5}}},
    };
    out.params = {{"window", dsl::Type::Int, 64, false},
                  {"scale", dsl::Type::Float, 0.5, false},
                  {"k", dsl::Type::Int, 3, true},
                  {"cap", dsl::Type::Float, 30, true}};
    return out;
  }();
  return d;
}

// Capture contents for B = 2, H = 3, Q_LEN = KV_LEN = 8.
struct Data {
  float bias[3 * 16];
  int32_t doc[8];
  uint8_t flag[2 * 8];
  uint16_t tab[2 * 3 * 3 * 5];
  std::vector<dsl::HostTensor> tensors;
  Data() {
    for (int i = 0; i < 48; ++i) bias[i] = static_cast<float>(i % 7) - 2.5f;
    for (int i = 0; i < 8; ++i) doc[i] = i / 3;
    for (int i = 0; i < 16; ++i) flag[i] = i % 3 == 0;
    for (int i = 0; i < 90; ++i) tab[i] = static_cast<uint16_t>(0x3f80 + 16 * (i % 9));  // bf16
    tensors = {{dsl::DType::F32, bias, {3, 16}, {}},
               {dsl::DType::I32, doc, {8}, {}},
               {dsl::DType::Bool, flag, {2, 8}, {}},
               {dsl::DType::BF16, tab, {2, 3, 3, 5}, {}}};
  }
};

constexpr double kParams[] = {5, -1.25};  // runtime params by slot: window, scale

bool same_value(const dsl::Value& a, const dsl::Value& b) {
  if (a.type != b.type) return false;
  if (a.type != dsl::Type::Float) return a.i == b.i;
  return std::bit_cast<uint64_t>(a.f) == std::bit_cast<uint64_t>(b.f) ||
         (std::isnan(a.f) && std::isnan(b.f));
}

dsl::EvalEnv env_at(const Data& data, int64_t b, int64_t h, int64_t q, int64_t kv, double score) {
  dsl::EvalEnv env;
  env.ints = {0, b, h, q, kv, 8, 8};
  env.score = score;
  env.params = kParams;
  env.captures = data.tensors;
  return env;
}

void check(bool ok) {
  if (!ok) __builtin_trap();
}

void exercise(const dsl::Mod& m) {
  static const Data data;
  const dsl::Graph g = dsl::simplify(m.graph);
  const std::string text = dsl::to_text(g, g.root, decls());
  (void)dsl::dependencies(g, g.root);

  // Points to compare at: a spread of indices and scores.
  const double scores[] = {0.0, -1.5, 3.0, -0.0};
  std::vector<dsl::Value> scratch;
  std::vector<dsl::Value> values;
  for (int i = 0; i < 8; ++i) {
    const dsl::EvalEnv env = env_at(data, i % 2, i % 3, i, 7 - i, scores[i % 4]);
    values.push_back(dsl::evaluate(g, env, dsl::Precision::F64, scratch));
    (void)dsl::evaluate(g, env, dsl::Precision::F32, scratch);
  }

  // Round trip of the normalized text (short ones: long texts may exceed the source limits).
  if (text.size() <= 512) {
    const dsl::Mod again = dsl::parse_mod(m.kind, text, decls(), "normalized");
    const dsl::Graph g2 = dsl::simplify(again.graph);
    for (int i = 0; i < 8; ++i) {
      const dsl::EvalEnv env = env_at(data, i % 2, i % 3, i, 7 - i, scores[i % 4]);
      check(same_value(dsl::evaluate(g2, env, dsl::Precision::F64, scratch), values[i]));
    }
  }

  dsl::Graph score =
      dsl::simplify(dsl::parse_mod(dsl::ModKind::Score, "score", decls(), "id").graph);
  dsl::Graph mask = dsl::simplify(dsl::parse_mod(dsl::ModKind::Mask, "true", decls(), "id").graph);
  if (m.kind == dsl::ModKind::Score) {
    dsl::Graph d = g;
    d.root = dsl::derivative_wrt_score(d, d.root);
    const dsl::Graph ds = dsl::simplify(d);
    (void)dsl::to_text(ds, ds.root, decls());
    dsl::Graph l = g;
    for (const dsl::LoadDerivative& ld : dsl::derivatives_wrt_loads(l, l.root))
      (void)dsl::evaluate(l, ld.derivative, env_at(data, 1, 2, 3, 4, 0.5), dsl::Precision::F64,
                          scratch);
    score = g;
  } else {
    mask = g;
    // Soundness of the interval verdict on a 3 x 4 tile at (b, h) = (1, 2).
    dsl::IntervalEnv ienv;
    ienv.b = {1, 1};
    ienv.h = {2, 2};
    ienv.q_idx = {2, 4};
    ienv.kv_idx = {3, 6};
    ienv.q_len = ienv.kv_len = 8;
    ienv.params = kParams;
    const std::vector<std::vector<int64_t>> shapes = {{3, 16}, {8}, {2, 8}, {2, 3, 3, 5}};
    ienv.capture_shapes = shapes;
    const dsl::Verdict v = dsl::interval_verdict(g, g.root, ienv);
    if (v != dsl::Verdict::Unknown)
      for (int64_t q = 2; q <= 4; ++q)
        for (int64_t kv = 3; kv <= 6; ++kv)
          for (auto p : {dsl::Precision::F64, dsl::Precision::F32})
            check((dsl::evaluate(g, env_at(data, 1, 2, q, kv, 0), p, scratch).i != 0) ==
                  (v == dsl::Verdict::AlwaysTrue));
  }
  dsl::EmitInput in;
  in.score = &score;
  in.mask = &mask;
  in.decls = &decls();
  in.variant_name = "fuzz";
  (void)dsl::emit_cuda_variant(in);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  for (dsl::ModKind kind : {dsl::ModKind::Score, dsl::ModKind::Mask}) {
    dsl::Mod m;
    try {
      m = dsl::parse_mod(kind, text, decls(), "fuzz");
    } catch (const dsl::DslError& e) {
      check(!e.diagnostics().empty() && std::string_view(e.what()).starts_with("fuzz:"));
      continue;
    }
    exercise(m);
  }
  return 0;
}
