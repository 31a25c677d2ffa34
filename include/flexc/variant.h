// flexc::Variant: an attention variant (score_mod + mask_mod + what they capture), checked.
#pragma once

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "flexc/error.h"

namespace flexc {

namespace detail {
struct VariantImpl;    // defined in src/; holds the checked IR
struct VariantAccess;  // flexc's own code reaches the IR through it (src/variant_impl.h)
}  // namespace detail

// A captured tensor the mods index, e.g. `bias[h, q_idx - kv_idx + 4095]`.
struct CaptureSpec {
  std::string name;
  std::string dtype;              // "int32", "float32", "bf16", "fp16", "bool"
  std::vector<std::string> dims;  // rank 1..4 ("shape" in JSON): a positive number or one of
                                  // "B", "H", "Q_LEN", "KV_LEN"
};

// A scalar parameter. `runtime` ones are kernel arguments (changing them never recompiles);
// `const` ones are folded into the generated code. An int param's default is an int32.
struct ParamSpec {
  std::string name;
  std::string type = "float";  // "int" or "float"
  double default_value = 0;
  bool is_const = false;
};

// How score_mod's float math is compiled (docs/dsl.md, "Precision"). Fast (the default): the
// GPU's approximate instructions for exp, log, tanh, sigmoid, sin, cos, sqrt, rsqrt and division,
// and multiply-adds fused, each function's error documented; Exact: every operation rounded as
// IEEE float32, as the CPU interpreter's float32 mode does, bit for bit. Approx: Fast with tanh on
// the GPU's tanh.approx (2^-11 relative at worst, FlashAttention-3's softcap: 1.3-1.5x Fast's
// softcap rate), outside the tolerance rule Fast meets (a softcap's LSE ~7x less accurate than
// Fast's; docs/dsl.md). mask_mod is always exact.
enum class Precision { Fast, Exact, Approx };
std::string_view to_string(Precision p);  // "fast", "exact", "approx"
// "fast", "exact" or "approx"; throws flexc::Error naming `what` (e.g. "--precision") otherwise.
Precision parse_precision(std::string_view text, std::string_view what = "precision");

// What a mod reads.
struct ModDeps {
  bool score = false, b = false, h = false, q_idx = false, kv_idx = false, q_len = false,
       kv_len = false;
  std::vector<std::string> params, captures;
};

class Variant {
 public:
  // From expressions. Throws flexc::Error with clang-style diagnostics on bad input.
  static Variant from_strings(std::string_view score_mod, std::string_view mask_mod = "true",
                              std::vector<CaptureSpec> captures = {},
                              std::vector<ParamSpec> params = {}, std::string name = "custom");
  // From a JSON config (schema in docs/variants.md). `origin` names the file in messages.
  static Variant from_json(std::string_view json_text, std::string_view origin = "<json>");
  static Variant from_json_file(const std::filesystem::path& path);
  // The built-in catalogue (examples/variants/, embedded at build time); "alibi" or "@alibi".
  static Variant from_catalogue(std::string_view name);
  static std::vector<std::string> catalogue_names();
  // What a command line names: "@name" is a catalogue entry, anything else a JSON file.
  static Variant load(std::string_view config);

  const std::string& name() const;
  const std::string& description() const;
  // Normalized declarations ("007" -> "7"). Runtime params come first, then const ones, each
  // group in declaration order; captures and runtime params are numbered in this order in the
  // kernels' argument block.
  const std::vector<CaptureSpec>& captures() const;
  const std::vector<ParamSpec>& params() const;

  // Normalized (checked, simplified) expressions, and d score_mod / d score.
  std::string score_mod_text() const;
  std::string mask_mod_text() const;
  std::string score_grad_text() const;
  ModDeps score_deps() const;
  ModDeps mask_deps() const;
  bool identity_score() const;    // score_mod is `score`
  bool mask_always_true() const;  // mask_mod is `true`
  // Float math of the kernels' score_mod ("precision" in JSON; default Fast).
  Precision precision() const;

  // Composition on checked trees. Declarations merge by name (the same name must declare the
  // same thing). and/or/not combine masks; the score_mods must not conflict (at most one side
  // may have a non-identity score_mod, unless both are the same). compose(outer, inner):
  // score = outer(inner(score)), mask = outer.mask && inner.mask. Results are named
  // "a_and_b", "a_or_b", "not_a", "outer_of_inner", and are Exact if either side is.
  friend Variant and_masks(const Variant& a, const Variant& b);
  friend Variant or_masks(const Variant& a, const Variant& b);
  friend Variant not_mask(const Variant& a);
  friend Variant compose(const Variant& outer, const Variant& inner);

  // Returns a copy with a new name.
  Variant renamed(std::string name) const;
  // Returns a copy whose kernels compile score_mod with `p` (a different kernel, cached apart).
  Variant with_precision(Precision p) const;

 private:
  friend struct detail::VariantAccess;
  explicit Variant(std::shared_ptr<const detail::VariantImpl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const detail::VariantImpl> impl_;
};

Variant and_masks(const Variant& a, const Variant& b);
Variant or_masks(const Variant& a, const Variant& b);
Variant not_mask(const Variant& a);
Variant compose(const Variant& outer, const Variant& inner);

}  // namespace flexc
