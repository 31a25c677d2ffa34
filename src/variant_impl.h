// The checked IR behind flexc::Variant, for flexc's own code (JIT, BlockMask, CLI). Not installed.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dsl/analysis.h"
#include "dsl/emit_cuda.h"
#include "dsl/ir.h"
#include "flexc/variant.h"

namespace flexc::detail {

// A JSON variant config is at most this long (docs/variants.md, limits).
inline constexpr size_t kMaxConfigBytes = 1 << 20;
// A config's mask_mod has at most this many terms (expressions, "@name" references, and / or /
// not objects): each term is parsed and merged, so the count bounds the work.
inline constexpr size_t kMaxMaskTerms = 1024;

struct VariantImpl {
  std::string name, description;
  // The declarations in public form (normalized: canonical dtype / type names, dims as "B", "H",
  // "Q_LEN", "KV_LEN" or a decimal number) and as the IR refers to them: decls.captures[i] is Load
  // slot i and decls.params[i] is Param slot i, in the same order as the specs. Runtime params
  // come first (each group in declaration order), so every runtime param slot is below
  // FLEXC_MAX_PARAMS and indexes FlexcArgs::fparam / iparam directly.
  std::vector<CaptureSpec> capture_specs;
  std::vector<ParamSpec> param_specs;
  dsl::Decls decls;
  // Checked and simplified: score.graph.root is the Float score_mod, mask.graph.root the Bool
  // mask_mod. Const params are folded; runtime params appear as Param nodes. A mod built by
  // composing two others has an empty `source` and no source ranges on its nodes.
  dsl::Mod score, mask;
  Precision precision = Precision::Fast;
  // What a kernel's launch must agree on with the emitted header (dsl::launch_facts of the mods
  // above), computed once when the variant is built: the launch reads it on every call.
  dsl::LaunchFacts facts;
};

// Every precision by its name ("fast", "exact", "approx"), in that order: to_string,
// parse_precision and the JSON reader's.
inline constexpr std::pair<std::string_view, Precision> kPrecisionNames[] = {
    {"fast", Precision::Fast}, {"exact", Precision::Exact}, {"approx", Precision::Approx}};

// The precision of a variant combined from a and b: the more accurate (Exact, then Fast).
inline Precision combined_precision(const VariantImpl& a, const VariantImpl& b) {
  for (Precision p : {Precision::Exact, Precision::Fast})
    if (a.precision == p || b.precision == p) return p;
  return Precision::Approx;
}

// How the references' float32 side evaluates score_mod: with Approx's tanh rounded as
// tanh.approx errs (dsl::Precision::F32Approx).
inline dsl::Precision reference_math(const VariantImpl& v) {
  return v.precision == Precision::Approx ? dsl::Precision::F32Approx : dsl::Precision::F32;
}

// What the CUDA emitter takes from a variant (the kernels' flexc_variant.cuh).
inline dsl::EmitInput emit_input(const VariantImpl& v) {
  return {&v.score.graph, &v.mask.graph, &v.decls, v.name,
          v.precision == Precision::Fast    ? dsl::FloatMath::Fast
          : v.precision == Precision::Exact ? dsl::FloatMath::Exact
                                            : dsl::FloatMath::Approx};
}

// ---- A variant as a config describes it, before checking. The JSON loader (variant_json.cpp)
// produces one; build_variant (variant.cpp) checks it. `path` fields name the place in the
// config for messages ("score_mod", "mask_mod.and[1]").

struct MaskConfig {
  enum class Kind { Expr, Ref, And, Or, Not } kind = Kind::Expr;
  std::string text;  // Expr: the expression; Ref: the catalogue entry's name (without '@')
  std::string path;
  std::vector<MaskConfig> items;  // And / Or: two or more; Not: one
};

struct VariantConfig {
  std::string name, description;
  std::vector<CaptureSpec> captures;  // paths captures[i].name / .dtype / .shape[j]
  std::vector<ParamSpec> params;      // paths params[i].name / .type / .default
  std::string score_mod = "score";
  MaskConfig mask{MaskConfig::Kind::Expr, "true", "mask_mod", {}};
  Precision precision = Precision::Fast;
};

// A variant's (or linear config's) name: throws flexc::Error naming `origin` if it is not one.
void check_variant_name(const std::string& name, std::string_view origin);

// Checks everything; throws flexc::Error whose message starts with `origin`.
Variant build_variant(const VariantConfig& config, std::string_view origin);

// A float expression of the score_mod's inputs and nothing declared (a linear variant's
// log_decay), checked and simplified; diagnostics start with `where` ("retnet.json: log_decay").
dsl::Mod parse_float_expression(std::string_view text, std::string_view where);

// A linear-attention config ("kind": "linear"; docs/linear.md), JSON types and keys checked.
struct LinearConfig {
  std::string name, description;
  std::string gate;       // "per_dim", "per_step", "per_head" or "none"
  std::string log_decay;  // per_head only
  std::string feature_map;  // optional: an expression of x, applied to q and k
  std::optional<double> scale;
};
LinearConfig parse_linear_json(std::string_view text, std::string_view origin);
// Whether a JSON text is an object with "kind": "linear" (invalid JSON: false).
bool is_linear_json(std::string_view text);

// Parses a JSON config (schema in docs/variants.md); checks JSON types and keys only.
VariantConfig parse_variant_json(std::string_view text, std::string_view origin);

// Throws flexc::Error "origin: path: message".
[[noreturn]] void config_error(std::string_view origin, std::string_view path,
                               std::string_view message);
// `text` quoted for a message, JSON style, control bytes escaped.
std::string in_quotes(std::string_view text);
// " (did you mean \"x\"?)" for the closest candidate, or empty.
std::string did_you_mean(std::string_view got, const std::vector<std::string>& candidates);

// The IR behind a public Variant, and a Variant around one: for flexc's own code only.
struct VariantAccess {
  static const VariantImpl& impl(const Variant& v) { return *v.impl_; }
  static Variant make(std::shared_ptr<const VariantImpl> impl) { return Variant(std::move(impl)); }
};
inline const VariantImpl& impl_of(const Variant& v) { return VariantAccess::impl(v); }

}  // namespace flexc::detail
