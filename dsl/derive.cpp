// Symbolic derivatives of a score_mod by forward accumulation over the DAG: one pass in node order
// gives every node's derivative with respect to one leaf (the score input or one Load), built as
// new nodes of the same graph so that subexpressions of the mod are shared, then simplified.
#include <limits>
#include <vector>

#include "dsl/analysis.h"

namespace flexc::dsl {
namespace {

// A derivative that is identically zero; kept symbolic so that no `0.0 * x` is ever built.
constexpr NodeId kZero = std::numeric_limits<NodeId>::max();

// ln 2 as a float32 value, like every constant a kernel sees.
constexpr double kLn2 = static_cast<float>(0.69314718055994530942);

class Deriv {
 public:
  explicit Deriv(Graph& g) : g_(g) {}

  // d(root)/d(target), unsimplified; kZero when it is identically zero.
  NodeId run(NodeId root, NodeId target) {
    const std::vector<char> live = reachable(g_, root);
    std::vector<NodeId> d(root + 1, kZero);
    for (NodeId id = 0; id <= root; ++id) {
      if (!live[id]) continue;
      if (id == target) {
        d[id] = num(1.0);
        continue;
      }
      const Node n = g_[id];  // a copy: the rules add nodes
      if (n.type != Type::Float) continue;  // Int and Bool values are piecewise constant
      bool any = false;
      for (NodeId a : n.operands()) any |= d[a] != kZero;
      if (any) d[id] = rule(id, n, d);
    }
    return d[root];
  }

 private:
  NodeId rule(NodeId id, const Node& n, const std::vector<NodeId>& d) {
    const NodeId a = n.args[0], b = n.args[1], c = n.args[2];
    const NodeId da = d[a], db = n.nargs > 1 ? d[b] : kZero, dc = n.nargs > 2 ? d[c] : kZero;
    switch (n.op) {
      case Op::Neg: return neg(da);
      case Op::Add: return add(da, db);
      case Op::Sub: return sub(da, db);
      case Op::Mul: return add(mul(da, b), mul(a, db));
      // d(a/b) = (da - (a/b) db) / b, reusing the quotient.
      case Op::Div: return div(sub(da, mul(id, db)), b);
      // a % b = a - b floor(a/b), and floor is piecewise constant.
      case Op::Mod: return db == kZero ? da : sub(da, mul(g_.binary(Op::FloorDiv, a, b), db));
      case Op::Select: return select(a, db, dc);
      // min / max ignore a NaN operand (fminf / fmaxf), and a tie takes the left side: the
      // derivative follows the operand whose value is returned.
      case Op::Min: return select(takes_right(Op::Lt, a, b), db, da);
      case Op::Max: return select(takes_right(Op::Gt, a, b), db, da);
      case Op::Clamp: {
        // clamp(a, lo, hi) = min(max(a, lo), hi).
        const NodeId m = g_.binary(Op::Max, a, b);
        const NodeId dm = select(takes_right(Op::Gt, a, b), db, da);
        return select(takes_right(Op::Lt, m, c), dc, dm);
      }
      case Op::Abs: return mul(g_.unary(Op::Sign, a), da);
      case Op::Exp: return mul(id, da);
      case Op::Exp2: return mul(mul(id, num(kLn2)), da);
      case Op::Log: return div(da, a);
      case Op::Log2: return div(da, g_.binary(Op::Mul, a, num(kLn2)));
      case Op::Sqrt: return div(mul(num(0.5), da), id);
      case Op::Rsqrt: {
        const NodeId cube = g_.binary(Op::Mul, id, g_.binary(Op::Mul, id, id));
        return mul(g_.binary(Op::Mul, num(-0.5), cube), da);
      }
      case Op::Tanh: return mul(g_.binary(Op::Sub, num(1.0), g_.binary(Op::Mul, id, id)), da);
      case Op::Sigmoid: return mul(g_.binary(Op::Mul, id, g_.binary(Op::Sub, num(1.0), id)), da);
      case Op::Sin: return mul(g_.unary(Op::Cos, a), da);
      case Op::Cos: return mul(g_.unary(Op::Neg, g_.unary(Op::Sin, a)), da);
      case Op::Pow: {
        // d(a^b) = b a^(b-1) da + a^b ln(a) db
        NodeId t = kZero;
        if (da != kZero) {
          const NodeId p = g_.binary(Op::Pow, a, g_.binary(Op::Sub, b, num(1.0)));
          t = mul(g_.binary(Op::Mul, b, p), da);
        }
        return add(t, mul(g_.binary(Op::Mul, id, g_.unary(Op::Log, a)), db));
      }
      default:
        return kZero;  // floor, ceil, sign, float `//`: piecewise constant
    }
  }

  NodeId num(double v) { return g_.constant_float(v); }
  bool is_one(NodeId id) const {
    return g_[id].op == Op::Const && g_[id].type == Type::Float && g_[id].fval == 1.0;
  }

  NodeId neg(NodeId a) { return a == kZero ? kZero : g_.unary(Op::Neg, a); }
  NodeId add(NodeId a, NodeId b) {
    if (a == kZero) return b;
    if (b == kZero) return a;
    return g_.binary(Op::Add, a, b);
  }
  NodeId sub(NodeId a, NodeId b) {
    if (b == kZero) return a;
    if (a == kZero) return neg(b);
    return g_.binary(Op::Sub, a, b);
  }
  // Products are kept as one fraction, `f * (p / q)` as `(f * p) / q`, so that chains read as
  // `30.0 * (1.0 - t * t) / 30.0` rather than nesting reciprocals.
  NodeId mul(NodeId a, NodeId b) {
    if (a == kZero || b == kZero) return kZero;
    if (is_one(a)) return b;
    if (is_one(b)) return a;
    if (g_[b].op == Op::Div) {
      const NodeId p = g_[b].args[0], q = g_[b].args[1];
      return div(mul(a, p), q);
    }
    if (g_[a].op == Op::Div) {
      const NodeId p = g_[a].args[0], q = g_[a].args[1];
      return div(mul(p, b), q);
    }
    return g_.binary(Op::Mul, a, b);
  }
  NodeId div(NodeId a, NodeId b) {
    if (a == kZero) return kZero;
    if (is_one(b)) return a;
    return g_.binary(Op::Div, a, b);
  }
  // Whether min (cmp = Lt) / max (cmp = Gt) of (a, b) returns b: b wins the comparison, or a is
  // NaN.
  NodeId takes_right(Op cmp, NodeId a, NodeId b) {
    return g_.binary(Op::Or, g_.binary(cmp, b, a), g_.binary(Op::Ne, a, a));
  }
  NodeId select(NodeId cond, NodeId a, NodeId b) {
    if (a == kZero && b == kZero) return kZero;
    return g_.ternary(Op::Select, cond, a == kZero ? num(0.0) : a, b == kZero ? num(0.0) : b);
  }

  Graph& g_;
};

NodeId score_input(const Graph& g, NodeId root) {
  for (NodeId id = 0; id <= root; ++id)
    if (g[id].op == Op::Input && g[id].input == Input::Score) return id;
  return kZero;
}

}  // namespace

NodeId derivative_wrt_score(Graph& g, NodeId root) {
  const NodeId d = Deriv(g).run(root, score_input(g, root));
  return simplify_into(g, d == kZero ? g.constant_float(0.0) : d);
}

std::vector<LoadDerivative> derivatives_wrt_loads(Graph& g, NodeId root) {
  const std::vector<char> live = reachable(g, root);
  std::vector<LoadDerivative> out;
  for (NodeId id = 0; id <= root; ++id) {
    if (!live[id] || g[id].op != Op::Load || g[id].type != Type::Float) continue;
    const NodeId d = Deriv(g).run(root, id);
    if (d == kZero) continue;
    const NodeId s = simplify_into(g, d);
    if (g[s].op == Op::Const && g[s].fval == 0.0) continue;
    out.push_back({id, s});
  }
  return out;
}

}  // namespace flexc::dsl
