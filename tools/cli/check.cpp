// `flexc check CONFIG.json... | @name... | --catalogue`: loads variants and prints what flexc
// understood of them (normalized mods, what they read, the score derivative, declarations; for a
// linear-attention config its gate and per-head decays).
#include <fmt/format.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "cli/args.h"
#include "cli/command.h"
#include "flexc/linear.h"
#include "flexc/variant.h"

namespace flexc::cli {
namespace {

std::string reads(const ModDeps& d) {
  std::vector<std::string> parts;
  const std::pair<bool, const char*> inputs[] = {
      {d.score, "score"},   {d.b, "b"},         {d.h, "h"},          {d.q_idx, "q_idx"},
      {d.kv_idx, "kv_idx"}, {d.q_len, "q_len"}, {d.kv_len, "kv_len"}};
  for (const auto& [used, name] : inputs)
    if (used) parts.emplace_back(name);
  for (const std::string& p : d.params) parts.push_back("param " + p);
  for (const std::string& c : d.captures) parts.push_back("capture " + c);
  return parts.empty() ? "nothing" : fmt::format("{}", fmt::join(parts, ", "));
}

void print(const Variant& v) {
  fmt::print("{}", v.name());
  if (!v.description().empty()) fmt::print(": {}", printable(v.description()));
  fmt::print("\n  score_mod   {}{}\n", v.score_mod_text(),
             v.identity_score() ? "  (identity)" : "");
  fmt::print("    reads     {}\n", reads(v.score_deps()));
  fmt::print("    d/dscore  {}\n", v.score_grad_text());
  fmt::print("    math      {}\n", to_string(v.precision()));
  fmt::print("  mask_mod    {}{}\n", v.mask_mod_text(), v.mask_always_true() ? "  (no mask)" : "");
  fmt::print("    reads     {}\n", reads(v.mask_deps()));
  for (const CaptureSpec& c : v.captures())
    fmt::print("  capture     {}: {} [{}]\n", c.name, c.dtype, fmt::join(c.dims, ", "));
  for (const ParamSpec& p : v.params())
    fmt::print("  param       {}: {} {} = {}\n", p.name, p.is_const ? "const" : "runtime", p.type,
               p.default_value);
}

void print(const LinearVariant& v) {
  const std::vector<float> decays =
      v.gate() == LinearGate::PerHead ? v.head_log_decays(4) : std::vector<float>{};
  fmt::print("{}", v.name());
  if (!v.description().empty()) fmt::print(": {}", printable(v.description()));
  fmt::print("\n  kind        linear attention (docs/linear.md)\n");
  fmt::print("  gate        {}{}\n", to_string(v.gate()),
             v.gate() == LinearGate::PerDim    ? "  (g [B, H, T, DK], log space)"
             : v.gate() == LinearGate::PerStep ? "  (g [B, H, T], log space)"
             : v.gate() == LinearGate::None    ? "  (no gate)"
                                               : "");
  if (v.gate() == LinearGate::PerHead) {
    fmt::print("  log_decay   {}\n", v.log_decay_text());
    fmt::print("    h 0..3    {}\n", fmt::join(decays, ", "));
  }
  if (v.feature_map()) {
    const FeatureMap& fm = *v.feature_map();
    fmt::print("  feature_map {}  (on q and k)\n", fm.text());
    fmt::print("    x -1, 0, 1  {:.6g}, {:.6g}, {:.6g}\n", fm(-1), fm(0), fm(1));
  }
  if (v.scale()) fmt::print("  scale       {}\n", *v.scale());
}

struct Options {
  std::vector<std::string> configs;
  bool catalogue = false;
  std::string precision;
};

void run(const Options& o) {
  std::vector<std::string> todo = o.configs;
  if (o.catalogue) {
    for (const std::string& name : Variant::catalogue_names()) todo.push_back("@" + name);
    for (const std::string& name : LinearVariant::catalogue_names()) todo.push_back("@" + name);
  }
  if (todo.empty()) throw CLI::ValidationError("give CONFIG.json files, @name or --catalogue");
  int failed = 0;
  for (size_t i = 0; i < todo.size(); ++i) {
    const std::string& arg = todo[i];
    try {
      if (i) fmt::print("\n");
      if (LinearVariant::is_linear_config(arg))
        print(LinearVariant::load(arg));
      else
        print(load_variant(arg, o.precision));
    } catch (const Error& e) {
      std::fflush(stdout);
      fmt::print(stderr, "{}\n", e.what());
      ++failed;
    }
  }
  std::fflush(stdout);
  if (failed) {
    if (todo.size() > 1) fmt::print(stderr, "flexc check: {} of {} failed\n", failed, todo.size());
    throw CLI::RuntimeError(1);
  }
}

const Register reg("check", [](CLI::App& app) {
  auto opts = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand(
      "check",
      "Check variant configs: print the normalized score_mod and mask_mod, what they read, the "
      "score derivative and the declarations. Exit status 1 if any config has errors.");
  cmd->add_option("configs", opts->configs,
                  "JSON variant configs, or @name for an entry of the built-in catalogue");
  cmd->add_flag("--catalogue", opts->catalogue, "check every entry of the built-in catalogue");
  add_precision_option(cmd, opts->precision);
  cmd->callback([opts] { run(*opts); });
});

}  // namespace
}  // namespace flexc::cli
