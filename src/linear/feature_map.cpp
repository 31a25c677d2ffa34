// flexc::FeatureMap: a linear-attention feature map phi on q and k, an expression of x in flexc's
// language, checked by the DSL front end and run three ways: the float64 interpreter (the
// reference), and the JIT kernels of templates/linear/gla_feature_map.cuh (phi(x) into a buffer,
// and dq, dk scaled by phi'(x) in place) from the same emitted hooks as a score_mod's.
#include <fmt/format.h>

#include <algorithm>
#include <string>

#include "../variant_impl.h"
#include "attention/attention_checks.h"
#include "dsl/analysis.h"
#include "dsl/frontend.h"
#include "flexc/error.h"
#include "flexc/linear.h"
#include "gla.h"
#include "jit/jit.h"
#include "templates/linear/gla_params.cuh"

namespace flexc {

struct FeatureMap::Impl {
  dsl::Mod mod;              // ModKind::Map: x is Input::Score
  dsl::NodeId grad = 0;      // d phi / d x, in mod.graph
  Variant variant;           // score_mod = phi: the hooks score_mod and score_mod_grad
};

FeatureMap FeatureMap::parse(std::string_view expression_of_x, std::string_view where) {
  dsl::Mod m;
  try {
    m = dsl::parse_mod(dsl::ModKind::Map, expression_of_x, dsl::Decls{}, std::string(where));
  } catch (const dsl::DslError& e) {
    throw Error(e.what());
  }
  m.graph = dsl::simplify(m.graph);
  // The emitter and the JIT see phi as a score_mod of `score` (reading nothing else): its text
  // comes from the checked graph, never from the user's.
  Variant v = Variant::from_strings(dsl::to_text(m.graph, m.graph.root, dsl::Decls{}), "true",
                                    {}, {}, "feature_map");
  dsl::Graph& g = m.graph;
  const dsl::NodeId grad = dsl::derivative_wrt_score(g, g.root);
  return FeatureMap(std::make_shared<const Impl>(Impl{std::move(m), grad, std::move(v)}));
}

std::string FeatureMap::text() const {
  return dsl::to_text(impl_->mod.graph, impl_->mod.graph.root, dsl::Decls{}, "x");
}

namespace {
double eval_at(const dsl::Graph& g, dsl::NodeId root, double x) {
  dsl::EvalEnv env;
  env.score = x;
  std::vector<dsl::Value> scratch;
  const dsl::Value v = dsl::evaluate(g, root, env, dsl::Precision::F64, scratch);
  return v.type == dsl::Type::Float ? v.f : double(v.i);
}
}  // namespace

double FeatureMap::operator()(double x) const {
  return eval_at(impl_->mod.graph, impl_->mod.graph.root, x);
}
double FeatureMap::derivative(double x) const {
  return eval_at(impl_->mod.graph, impl_->grad, x);
}

namespace detail {

jit::KernelSpec feature_map_spec(DType dtype, std::string arch) {
  return {"gla_feature_map.cuh",
          "flexc_feature_map",
          {{"FLEXC_BF16", dtype == DType::BF16 ? "1" : "0"}},
          std::move(arch)};
}

const Variant& feature_map_variant(const FeatureMap& fm) { return fm.impl_->variant; }

void run_feature_map(const FeatureMap& fm, const TensorView& x, const TensorView& y, bool grad,
                     CUstream_st* stream) {
  jit::KernelSpec spec = feature_map_spec(x.dtype, "");
  if (grad) spec.entry = "flexc_feature_map_grad";
  const jit::Kernel& kernel = jit::get_kernel(feature_map_variant(fm), spec);
  FlexcMapParams p{};
  p.x = x.data, p.y = y.data;
  for (int i = 0; i < 3; ++i) {
    p.n[i] = x.shape[i];
    p.x_stride[i] = x.stride(i), p.y_stride[i] = y.stride(i);
  }
  p.d = int(x.shape[3]);
  const long long pieces = p.n[0] * p.n[1] * p.n[2] * (p.d / 8);  // 16 bytes each, a thread's
  if (pieces == 0) return;
  void* args[] = {&p};
  const long long blocks = std::min<long long>((pieces + 255) / 256, 132LL * 64);
  kernel.launch(unsigned(blocks), 1, 1, 256, 0, stream, args);
}

}  // namespace detail
}  // namespace flexc
