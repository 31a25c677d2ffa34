// Constant folding and exact identities. Every rewrite keeps the value bit-for-bit in both
// precisions of the interpreter (NaN, infinities and signed zeros included), so it is safe for
// the kernel and invisible to the oracle.
#include <array>
#include <bit>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <optional>
#include <vector>

#include "dsl/analysis.h"

namespace flexc::dsl {
namespace {

bool is_comparison(Op op) {
  return op == Op::Lt || op == Op::Le || op == Op::Gt || op == Op::Ge || op == Op::Eq ||
         op == Op::Ne;
}

// Ops whose float32 result is exactly defined (IEEE arithmetic, comparisons, selection), so a
// fold cannot disagree with the device. Transcendentals and sqrt are left to the device.
bool foldable(Op op) {
  switch (op) {
    case Op::Const: case Op::Input: case Op::Param: case Op::Load:
    case Op::Exp: case Op::Exp2: case Op::Log: case Op::Log2: case Op::Sqrt: case Op::Rsqrt:
    case Op::Tanh: case Op::Sigmoid: case Op::Sin: case Op::Cos: case Op::Pow:
      return false;
    default:
      return true;
  }
}

// !(a < b) == (a >= b) etc.; only exact when the operands cannot be NaN.
Op negated_comparison(Op op) {
  switch (op) {
    case Op::Lt: return Op::Ge;
    case Op::Le: return Op::Gt;
    case Op::Gt: return Op::Le;
    case Op::Ge: return Op::Lt;
    case Op::Eq: return Op::Ne;
    default: return Op::Eq;
  }
}

bool same_value(const Value& a, const Value& b) {
  if (a.type != b.type) return false;
  if (a.type != Type::Float) return a.i == b.i;
  if (std::isnan(a.f) || std::isnan(b.f)) return std::isnan(a.f) && std::isnan(b.f);
  return std::bit_cast<uint64_t>(a.f) == std::bit_cast<uint64_t>(b.f);
}

class Simplifier {
 public:
  explicit Simplifier(Graph& dst) : g_(dst) {}

  // Rewrites the expression at `root` of `src` into the destination graph, which may be `src`
  // itself (nodes are therefore copied, never referenced, across additions).
  NodeId run(const Graph& src, NodeId root) {
    const std::vector<char> live = reachable(src, root);
    std::vector<NodeId> to(root + 1, 0);
    for (NodeId id = 0; id <= root; ++id) {
      if (!live[id]) continue;
      Node n = src[id];
      for (int k = 0; k < n.nargs; ++k) n.args[k] = to[n.args[k]];
      to[id] = make(n);
    }
    return to[root];
  }

 private:
  // Adds `n` (operands already rewritten) after folding and identities.
  NodeId make(const Node& n) {
    if (n.nargs == 0) return g_.add(n);
    if (auto c = fold(n)) return *c;
    if (auto r = identity(n)) return *r;
    return g_.add(n);
  }

  NodeId make(Op op, Type t, std::initializer_list<NodeId> args, SrcRange src) {
    Node n;
    n.op = op;
    n.type = t;
    n.nargs = static_cast<uint8_t>(args.size());
    int k = 0;
    for (NodeId a : args) n.args[k++] = a;
    n.src = src;
    return make(n);
  }

  NodeId constant(const Value& v, SrcRange src) {
    Node n;
    n.type = v.type;
    if (v.type == Type::Float)
      n.fval = std::isnan(v.f) ? std::numeric_limits<double>::quiet_NaN() : v.f;
    else
      n.ival = v.i;
    n.src = src;
    return g_.add(n);
  }
  NodeId int_constant(Type t, int64_t v, SrcRange src) { return constant(Value{t, v, 0}, src); }

  // Folds when every operand is a constant and both precisions give the same value.
  std::optional<NodeId> fold(const Node& n) {
    if (!foldable(n.op)) return std::nullopt;
    // Negating a float constant is exact in both precisions even when the constant is not a
    // float32 value (0.4): fold it as the front end folds a negative literal, so that simplify
    // is idempotent on its own printed output.
    if (n.op == Op::Neg && n.type == Type::Float && g_[n.args[0]].op == Op::Const)
      return constant(Value{Type::Float, 0, -g_[n.args[0]].fval}, n.src);
    std::array<Value, kMaxArgs> v64{}, v32{};
    for (int k = 0; k < n.nargs; ++k) {
      const Node a = g_[n.args[k]];
      if (a.op != Op::Const) return std::nullopt;
      // As the interpreter reads a constant in each precision.
      const int64_t i = a.type == Type::Int ? static_cast<int32_t>(static_cast<uint32_t>(a.ival))
                                            : a.ival != 0;
      v64[k] = Value{a.type, i, a.fval};
      v32[k] = Value{a.type, i, static_cast<float>(a.fval)};
    }
    const Value r64 = evaluate_op(n, std::span(v64.data(), n.nargs), Precision::F64);
    const Value r32 = evaluate_op(n, std::span(v32.data(), n.nargs), Precision::F32);
    if (!same_value(r64, r32)) return std::nullopt;
    return constant(r64, n.src);
  }

  bool is_float(NodeId id, double v) const {
    const Node& n = g_[id];
    return n.op == Op::Const && n.type == Type::Float &&
           std::bit_cast<uint64_t>(n.fval) == std::bit_cast<uint64_t>(v);
  }
  bool is_int(NodeId id, int64_t v) const {
    const Node& n = g_[id];
    return n.op == Op::Const && n.type != Type::Float && n.ival == v;
  }
  Op op_of(NodeId id) const { return g_[id].op; }
  NodeId arg(NodeId id, int k) const { return g_[id].args[k]; }

  std::optional<NodeId> identity(const Node& n) {
    const NodeId a = n.args[0], b = n.nargs > 1 ? n.args[1] : 0, c = n.nargs > 2 ? n.args[2] : 0;
    const Type t = n.type;
    const bool flt = t == Type::Float, integer = t == Type::Int;
    // Identical operands of a comparison; floats excluded (NaN != NaN).
    if (is_comparison(n.op) && a == b && g_[a].type != Type::Float)
      return int_constant(Type::Bool, n.op == Op::Eq || n.op == Op::Le || n.op == Op::Ge, n.src);
    switch (n.op) {
      case Op::Neg:
        if (op_of(a) == Op::Neg) return arg(a, 0);
        break;
      case Op::Not:
        if (op_of(a) == Op::Not) return arg(a, 0);
        if (is_comparison(op_of(a)) && g_[arg(a, 0)].type != Type::Float)
          return make(negated_comparison(op_of(a)), Type::Bool, {arg(a, 0), arg(a, 1)}, n.src);
        break;
      case Op::BitNot:
        if (op_of(a) == Op::BitNot && g_[arg(a, 0)].type == Type::Int) return arg(a, 0);
        break;
      case Op::Add:
        if (flt) {
          // x + -0.0 == x for every x (x + +0.0 is not: -0.0 + +0.0 == +0.0).
          if (is_float(b, -0.0)) return a;
          if (is_float(a, -0.0)) return b;
          if (op_of(b) == Op::Neg) return make(Op::Sub, t, {a, arg(b, 0)}, n.src);
          if (op_of(a) == Op::Neg) return make(Op::Sub, t, {b, arg(a, 0)}, n.src);
        } else if (integer) {
          if (is_int(b, 0)) return a;
          if (is_int(a, 0)) return b;
        }
        break;
      case Op::Sub:
        if (flt) {
          if (is_float(b, 0.0)) return a;
          if (op_of(b) == Op::Neg) return make(Op::Add, t, {a, arg(b, 0)}, n.src);
        } else if (integer) {
          if (is_int(b, 0)) return a;
          if (a == b) return int_constant(t, 0, n.src);
          if (is_int(a, 0)) return make(Op::Neg, t, {b}, n.src);
        }
        break;
      case Op::Mul:
        if (flt) {
          if (is_float(b, 1.0)) return a;
          if (is_float(a, 1.0)) return b;
          if (is_float(b, -1.0)) return make(Op::Neg, t, {a}, n.src);
          if (is_float(a, -1.0)) return make(Op::Neg, t, {b}, n.src);
          if (op_of(a) == Op::Neg && op_of(b) == Op::Neg)
            return make(Op::Mul, t, {arg(a, 0), arg(b, 0)}, n.src);
        } else if (integer) {
          if (is_int(b, 1)) return a;
          if (is_int(a, 1)) return b;
          if (is_int(a, 0) || is_int(b, 0)) return int_constant(t, 0, n.src);
        }
        break;
      case Op::Div:
        if (is_float(b, 1.0)) return a;
        if (is_float(b, -1.0)) return make(Op::Neg, t, {a}, n.src);
        break;
      case Op::FloorDiv:
        if (integer && is_int(b, 1)) return a;
        break;
      case Op::Mod:
        if (integer && is_int(b, 1)) return int_constant(t, 0, n.src);
        break;
      case Op::Shl: case Op::Shr:
        if (g_[b].op == Op::Const && (g_[b].ival & 31) == 0) return a;
        break;
      case Op::BitAnd:
        if (is_int(a, 0) || is_int(b, 0)) return int_constant(t, 0, n.src);
        if (a == b) return a;
        break;
      case Op::BitOr:
        if (is_int(b, 0)) return a;
        if (is_int(a, 0)) return b;
        if (a == b) return a;
        break;
      case Op::BitXor:
        if (is_int(b, 0)) return a;
        if (is_int(a, 0)) return b;
        if (a == b) return int_constant(t, 0, n.src);
        break;
      case Op::And:
        if (is_int(a, 1) || a == b) return b;
        if (is_int(b, 1)) return a;
        if (is_int(a, 0) || is_int(b, 0)) return int_constant(t, 0, n.src);
        break;
      case Op::Or:
        if (is_int(a, 0) || a == b) return b;
        if (is_int(b, 0)) return a;
        if (is_int(a, 1) || is_int(b, 1)) return int_constant(t, 1, n.src);
        break;
      case Op::Select:
        if (op_of(a) == Op::Const) return g_[a].ival ? b : c;
        if (b == c) return b;
        if (op_of(a) == Op::Not) return make(Op::Select, t, {arg(a, 0), c, b}, n.src);
        if (t == Type::Bool && is_int(b, 1) && is_int(c, 0)) return a;
        if (t == Type::Bool && is_int(b, 0) && is_int(c, 1)) return make(Op::Not, t, {a}, n.src);
        // c1 ? (c2 ? x : y) : y  ==  c1 && c2 ? x : y, and the mirror image with ||.
        if (op_of(b) == Op::Select && arg(b, 2) == c) {
          const NodeId cond = make(Op::And, Type::Bool, {a, arg(b, 0)}, n.src);
          return make(Op::Select, t, {cond, arg(b, 1), c}, n.src);
        }
        if (op_of(c) == Op::Select && arg(c, 1) == b) {
          const NodeId cond = make(Op::Or, Type::Bool, {a, arg(c, 0)}, n.src);
          return make(Op::Select, t, {cond, b, arg(c, 2)}, n.src);
        }
        break;
      case Op::Min: case Op::Max:
        if (a == b) return a;
        break;
      case Op::Abs:
        if (op_of(a) == Op::Abs) return a;
        break;
      case Op::Floor: case Op::Ceil:
        if (!flt) return a;
        break;
      case Op::ToInt:
        if (g_[a].type == Type::Int) return a;
        break;
      default:
        break;
    }
    return std::nullopt;
  }

  Graph& g_;
};

}  // namespace

NodeId simplify_into(Graph& g, NodeId root) { return Simplifier(g).run(g, root); }

Graph simplify(const Graph& g) {
  Graph out;
  if (g.size() == 0) return out;
  Graph work;
  const NodeId r = Simplifier(work).run(g, g.root);
  // `work` may hold nodes a later rewrite made unreachable; copy only what the root reaches.
  out.root = out.import(work, r);
  return out;
}

}  // namespace flexc::dsl
