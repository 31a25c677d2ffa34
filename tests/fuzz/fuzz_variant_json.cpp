// libFuzzer target: arbitrary bytes as a JSON variant config. Anything but a loaded variant or a
// flexc::Error is a bug (another exception type, a crash, a sanitizer report). A loaded variant
// must survive every accessor, composition with catalogue entries, and the round trip of its
// normalized texts and declarations through Variant::from_strings.
#include <cstdint>
#include <string_view>

#include "dsl/emit_cuda.h"
#include "flexc/variant.h"
#include "variant_impl.h"

namespace {

void check(bool ok) {
  if (!ok) __builtin_trap();
}

void exercise(const flexc::Variant& v) {
  const std::string score = v.score_mod_text(), mask = v.mask_mod_text();
  (void)v.score_grad_text();
  (void)v.score_deps();
  (void)v.mask_deps();
  (void)v.identity_score();
  (void)v.mask_always_true();

  const flexc::detail::VariantImpl& impl = flexc::detail::impl_of(v);
  flexc::dsl::EmitInput in;
  in.score = &impl.score.graph;
  in.mask = &impl.mask.graph;
  in.decls = &impl.decls;
  in.variant_name = v.name();
  (void)flexc::dsl::emit_cuda_variant(in);

  // Printed texts can exceed the source limits only when they are long.
  if (score.size() + mask.size() <= 4096) {
    const flexc::Variant again =
        flexc::Variant::from_strings(score, mask, v.captures(), v.params(), v.name());
    check(again.score_mod_text() == score && again.mask_mod_text() == mask);
  }

  static const flexc::Variant alibi = flexc::Variant::from_catalogue("alibi");
  static const flexc::Variant causal = flexc::Variant::from_catalogue("causal");
  for (const auto& combine :
       {+[](const flexc::Variant&a, const flexc::Variant&b) { return compose(a, b); },
        +[](const flexc::Variant&a, const flexc::Variant&b) { return and_masks(a, b); }})
    for (const flexc::Variant* other : {&alibi, &causal}) {
      try {
        (void)combine(v, *other).mask_mod_text();
        (void)combine(*other, v).score_mod_text();
      } catch (const flexc::Error&) {  // conflicting declarations or scores, limits
      }
    }
  (void)not_mask(v).mask_mod_text();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    exercise(flexc::Variant::from_json(text, "fuzz.json"));
  } catch (const flexc::Error& e) {
    check(std::string_view(e.what()).starts_with("fuzz.json") ||
          std::string_view(e.what()).find("catalogue") != std::string_view::npos);
  }
  return 0;
}
