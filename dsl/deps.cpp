// What a mod reads, and the two facts the kernels specialise on most.
#include <algorithm>

#include "dsl/analysis.h"

namespace flexc::dsl {

std::vector<char> reachable(const Graph& g, NodeId root) {
  std::vector<char> reached(root + 1, 0);
  reached[root] = 1;
  for (NodeId id = root + 1; id-- > 0;)
    if (reached[id])
      for (NodeId a : g[id].operands()) reached[a] = 1;
  return reached;
}

Deps dependencies(const Graph& g, NodeId root) {
  Deps d;
  const std::vector<char> live = reachable(g, root);
  for (NodeId id = 0; id <= root; ++id) {
    if (!live[id]) continue;
    const Node& n = g[id];
    if (n.op == Op::Input) d.inputs[static_cast<int>(n.input)] = true;
    if (n.op == Op::Param) d.params.push_back(n.slot);
    if (n.op == Op::Load) d.captures.push_back(n.slot);
  }
  for (auto* slots : {&d.params, &d.captures}) {
    std::sort(slots->begin(), slots->end());
    slots->erase(std::unique(slots->begin(), slots->end()), slots->end());
  }
  return d;
}

// Both facts are asked of the simplified expression, so `score * 1.0` is the identity and
// `q_idx == q_idx` the all-true mask.
static const Node& simplified_root(const Graph& g, NodeId root, Graph& scratch) {
  Graph sub;
  sub.root = sub.import(g, root);
  scratch = simplify(sub);
  return scratch[scratch.root];
}

bool is_identity_score(const Graph& g, NodeId root) {
  Graph s;
  const Node& n = simplified_root(g, root, s);
  return n.op == Op::Input && n.input == Input::Score;
}

bool is_all_true_mask(const Graph& g, NodeId root) {
  Graph s;
  const Node& n = simplified_root(g, root, s);
  return n.op == Op::Const && n.type == Type::Bool && n.ival != 0;
}

}  // namespace flexc::dsl
