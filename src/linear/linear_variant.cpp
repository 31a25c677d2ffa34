// flexc::LinearVariant: linear-attention configs ("kind": "linear"; docs/linear.md, "Configs"),
// their catalogue (examples/linear/), the per-head decays they describe, and building their
// kernels ahead of time.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "../embedded.h"
#include "../file_read.h"
#include "../variant_impl.h"
#include "dsl/analysis.h"
#include "dsl/ir.h"
#include "flexc/error.h"
#include "flexc/linear.h"
#include "gla.h"
#include "jit/jit.h"

namespace flexc {

struct LinearVariant::Impl {
  std::string origin;  // the config's file or catalogue entry, for messages
  std::string name, description;
  LinearGate gate = LinearGate::PerDim;
  std::optional<dsl::Mod> log_decay;  // per_head: checked, an expression of h alone
  std::optional<FeatureMap> feature_map;
  std::optional<double> scale;
};

namespace {

const detail::EmbeddedFile* catalogue_file(std::string_view name) {
  return detail::catalogue_entry("linear", name);
}

LinearGate gate_of(const std::string& s) {
  if (s == "per_dim") return LinearGate::PerDim;
  if (s == "per_step") return LinearGate::PerStep;
  if (s == "per_head") return LinearGate::PerHead;
  return LinearGate::None;
}

}  // namespace

std::string_view to_string(LinearGate g) {
  switch (g) {
    case LinearGate::PerDim: return "per_dim";
    case LinearGate::PerStep: return "per_step";
    case LinearGate::PerHead: return "per_head";
    case LinearGate::None: return "none";
  }
  return "";
}

LinearVariant LinearVariant::from_json(std::string_view json_text, std::string_view origin) {
  const detail::LinearConfig c = detail::parse_linear_json(json_text, origin);
  detail::check_variant_name(c.name, origin);
  auto impl = std::make_shared<Impl>();
  impl->origin = origin;
  impl->name = c.name;
  impl->description = c.description;
  impl->gate = gate_of(c.gate);
  impl->scale = c.scale;
  if (impl->gate == LinearGate::PerHead) {
    const std::string where = fmt::format("{}: log_decay", origin);
    dsl::Mod m = detail::parse_float_expression(c.log_decay, where);
    const dsl::Deps d = dsl::dependencies(m.graph, m.graph.root);
    for (auto [input, name] : {std::pair{dsl::Input::Score, "score"}, {dsl::Input::B, "b"},
                               {dsl::Input::QIdx, "q_idx"}, {dsl::Input::KvIdx, "kv_idx"},
                               {dsl::Input::QLen, "q_len"}, {dsl::Input::KvLen, "kv_len"}})
      if (d.reads(input))
        throw Error(fmt::format("{}: reads {}; a fixed decay per head is an expression of h "
                                "alone",
                                where, name));
    impl->log_decay = std::move(m);
  }
  if (!c.feature_map.empty())
    impl->feature_map = FeatureMap::parse(c.feature_map, fmt::format("{}: feature_map", origin));
  return LinearVariant(std::move(impl));
}

LinearVariant LinearVariant::from_json_file(const std::filesystem::path& path) {
  return from_json(detail::read_regular_file(path, detail::kMaxConfigBytes, "linear config"),
                   path.string());
}

LinearVariant LinearVariant::from_catalogue(std::string_view name) {
  if (name.starts_with('@')) name.remove_prefix(1);
  const detail::EmbeddedFile* f = catalogue_file(name);
  if (!f)
    throw Error(fmt::format("unknown linear-attention catalogue entry @{}{}; it has @{}", name,
                            detail::did_you_mean(name, catalogue_names()),
                            fmt::join(catalogue_names(), ", @")));
  return from_json(f->text, f->name);
}

std::vector<std::string> LinearVariant::catalogue_names() {
  return detail::catalogue_entries("linear");
}

bool LinearVariant::is_linear_config(std::string_view config) {
  if (config.starts_with('@')) return catalogue_file(config.substr(1)) != nullptr;
  try {
    return detail::is_linear_json(
        detail::read_regular_file(std::filesystem::path(config), detail::kMaxConfigBytes,
                                  "config"));
  } catch (const Error&) {
    return false;  // unreadable: the softmax loader reports it
  }
}

LinearVariant LinearVariant::load(std::string_view config) {
  return config.starts_with('@') ? from_catalogue(config)
                                 : from_json_file(std::filesystem::path(config));
}

const std::string& LinearVariant::name() const { return impl_->name; }
const std::string& LinearVariant::description() const { return impl_->description; }
LinearGate LinearVariant::gate() const { return impl_->gate; }
std::optional<double> LinearVariant::scale() const { return impl_->scale; }
const std::optional<FeatureMap>& LinearVariant::feature_map() const { return impl_->feature_map; }

std::string LinearVariant::log_decay_text() const {
  if (!impl_->log_decay) return "";
  return dsl::to_text(impl_->log_decay->graph, impl_->log_decay->graph.root, dsl::Decls{});
}

std::vector<float> LinearVariant::head_log_decays(int64_t heads) const {
  if (!impl_->log_decay)
    throw Error(fmt::format("{}: a {} gate has no per-head decay", impl_->name,
                            to_string(impl_->gate)));
  if (heads < 1 || heads > 65535)
    throw Error(fmt::format("{}: heads = {}; 1 to 65535 expected", impl_->name, heads));
  std::vector<float> out;
  dsl::EvalEnv env;
  for (int64_t h = 0; h < heads; ++h) {
    env.ints[static_cast<int>(dsl::Input::H)] = h;
    const dsl::Value v = dsl::evaluate(impl_->log_decay->graph, env, dsl::Precision::F64);
    const double x = v.type == dsl::Type::Float ? v.f : double(v.i);
    if (!(x <= 0))
      throw Error(fmt::format("{}: log_decay is {} at h = {}; a log decay must be <= 0 (a decay "
                              "in (0, 1])",
                              impl_->origin, x, h));
    out.push_back(static_cast<float>(x));
  }
  return out;
}

std::vector<CompiledKernel> compile_linear_kernels(const LinearVariant& v, std::string_view arch,
                                                   std::string_view dtype, int dk, int dv,
                                                   std::string_view gate_dtype) {
  detail::GlaConfig c;
  c.arch = arch;
  if (dtype != "bf16" && dtype != "fp16")
    throw Error(fmt::format("{}: dtype must be bf16 or fp16, not '{}'", v.name(), dtype));
  c.dtype = dtype == "bf16" ? DType::BF16 : DType::F16;
  c.dk = dk, c.dv = dv;
  if (v.gate() == LinearGate::None) {
    c.gate = detail::GateType::None;
  } else if (gate_dtype == "float32") {
    c.gate = detail::GateType::F32;
  } else if (gate_dtype == "bf16" || gate_dtype == "fp16") {
    c.gate = gate_dtype == "bf16" ? detail::GateType::BF16 : detail::GateType::F16;
  } else {
    throw Error(fmt::format("{}: gate dtype must be float32, bf16 or fp16, not '{}'", v.name(),
                            gate_dtype));
  }
  c.scalar_gate = v.gate() != LinearGate::PerDim;
  std::vector<jit::KernelSpec> specs{detail::gla_spec(c)};
  c.backward = true;
  specs.push_back(detail::gla_spec(c));
  std::vector<CompiledKernel> out;
  for (jit::Compiled& k : jit::compile_all(detail::gla_variant(), specs))
    out.push_back(jit::to_compiled_kernel(std::move(k), specs[out.size()].arch));
  if (v.feature_map()) {
    const jit::KernelSpec spec = detail::feature_map_spec(c.dtype, c.arch);
    out.push_back(jit::to_compiled_kernel(
        jit::compile(detail::feature_map_variant(*v.feature_map()), spec), spec.arch));
  }
  return out;
}

}  // namespace flexc
