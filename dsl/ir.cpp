#include "dsl/ir.h"

#include <bit>
#include <cassert>
#include <cmath>
#include <fmt/format.h>

namespace flexc::dsl {

std::string_view type_name(Type t) {
  switch (t) {
    case Type::Bool: return "bool";
    case Type::Int: return "int";
    case Type::Float: return "float";
  }
  return "?";
}

std::string_view input_name(Input i) {
  static constexpr std::string_view names[kNumInputs] = {"score",  "b",     "h",     "q_idx",
                                                         "kv_idx", "q_len", "kv_len"};
  return names[static_cast<int>(i)];
}

std::string_view op_name(Op op) {
  switch (op) {
    case Op::Const: return "const";
    case Op::Input: return "input";
    case Op::Param: return "param";
    case Op::Load: return "load";
    case Op::Neg: return "-";
    case Op::Not: return "!";
    case Op::BitNot: return "~";
    case Op::Add: return "+";
    case Op::Sub: return "-";
    case Op::Mul: return "*";
    case Op::Div: return "/";
    case Op::FloorDiv: return "//";
    case Op::Mod: return "%";
    case Op::Shl: return "<<";
    case Op::Shr: return ">>";
    case Op::Lt: return "<";
    case Op::Le: return "<=";
    case Op::Gt: return ">";
    case Op::Ge: return ">=";
    case Op::Eq: return "==";
    case Op::Ne: return "!=";
    case Op::BitAnd: return "&";
    case Op::BitXor: return "^";
    case Op::BitOr: return "|";
    case Op::And: return "&&";
    case Op::Or: return "||";
    case Op::Select: return "where";
    case Op::Min: return "min";
    case Op::Max: return "max";
    case Op::Abs: return "abs";
    case Op::Clamp: return "clamp";
    case Op::Exp: return "exp";
    case Op::Exp2: return "exp2";
    case Op::Log: return "log";
    case Op::Log2: return "log2";
    case Op::Sqrt: return "sqrt";
    case Op::Rsqrt: return "rsqrt";
    case Op::Tanh: return "tanh";
    case Op::Sigmoid: return "sigmoid";
    case Op::Sin: return "sin";
    case Op::Cos: return "cos";
    case Op::Pow: return "pow";
    case Op::Floor: return "floor";
    case Op::Ceil: return "ceil";
    case Op::Sign: return "sign";
    case Op::ToFloat: return "float";
    case Op::ToInt: return "int";
  }
  return "?";
}

std::string_view dtype_name(DType d) {
  switch (d) {
    case DType::I32: return "int32";
    case DType::F32: return "float32";
    case DType::BF16: return "bf16";
    case DType::F16: return "fp16";
    case DType::Bool: return "bool";
  }
  return "?";
}

Type dtype_value_type(DType d) {
  switch (d) {
    case DType::I32: return Type::Int;
    case DType::Bool: return Type::Bool;
    default: return Type::Float;
  }
}

std::string dim_name(const Dim& d) {
  switch (d.kind) {
    case Dim::B: return "B";
    case Dim::H: return "H";
    case Dim::QLen: return "Q_LEN";
    case Dim::KvLen: return "KV_LEN";
    case Dim::Fixed: break;
  }
  return std::to_string(d.extent);
}

bool same_node(const Node& a, const Node& b) {
  if (a.op != b.op || a.type != b.type || a.nargs != b.nargs || a.input != b.input ||
      a.slot != b.slot || a.ival != b.ival ||
      std::bit_cast<uint64_t>(a.fval) != std::bit_cast<uint64_t>(b.fval))
    return false;
  for (int i = 0; i < a.nargs; ++i)
    if (a.args[i] != b.args[i]) return false;
  return true;
}

static uint64_t hash_node(const Node& n) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
  mix(static_cast<uint64_t>(n.op));
  mix(static_cast<uint64_t>(n.type));
  mix(n.nargs);
  mix(static_cast<uint64_t>(n.input));
  mix(n.slot);
  mix(static_cast<uint64_t>(n.ival));
  mix(std::bit_cast<uint64_t>(n.fval));
  for (int i = 0; i < n.nargs; ++i) mix(n.args[i]);
  return h;
}

NodeId Graph::add(const Node& n) {
  for (int i = 0; i < n.nargs; ++i) assert(n.args[i] < nodes_.size());
  const uint64_t h = hash_node(n);
  auto [lo, hi] = index_.equal_range(h);
  for (auto it = lo; it != hi; ++it)
    if (same_node(nodes_[it->second], n)) return it->second;
  const auto id = static_cast<NodeId>(nodes_.size());
  nodes_.push_back(n);
  index_.emplace(h, id);
  return id;
}

NodeId Graph::constant_bool(bool v) {
  Node n;
  n.op = Op::Const;
  n.type = Type::Bool;
  n.ival = v;
  return add(n);
}

NodeId Graph::constant_int(int64_t v) {
  Node n;
  n.op = Op::Const;
  n.type = Type::Int;
  n.ival = v;
  return add(n);
}

NodeId Graph::constant_float(double v) {
  Node n;
  n.op = Op::Const;
  n.type = Type::Float;
  n.fval = v;
  return add(n);
}

NodeId Graph::input(Input i) {
  Node n;
  n.op = Op::Input;
  n.input = i;
  n.type = i == Input::Score ? Type::Float : Type::Int;
  return add(n);
}

NodeId Graph::param(uint16_t slot, Type t) {
  Node n;
  n.op = Op::Param;
  n.slot = slot;
  n.type = t;
  return add(n);
}

NodeId Graph::load(uint16_t slot, Type elem, std::span<const NodeId> idx, SrcRange src) {
  assert(!idx.empty() && idx.size() <= kMaxArgs);
  Node n;
  n.op = Op::Load;
  n.slot = slot;
  n.type = elem;
  n.nargs = static_cast<uint8_t>(idx.size());
  for (size_t i = 0; i < idx.size(); ++i) n.args[i] = idx[i];
  n.src = src;
  return add(n);
}

NodeId Graph::to_float(NodeId a) {
  if (nodes_[a].type == Type::Float) return a;
  Node n;
  n.op = Op::ToFloat;
  n.type = Type::Float;
  n.nargs = 1;
  n.args[0] = a;
  n.src = nodes_[a].src;
  return add(n);
}

// Result type of an op given its operand types, after promotion; `operand` receives the type
// every numeric operand is promoted to (Bool operands of logic ops stay Bool).
static Type result_type(Op op, std::span<const Type> in, Type& operand) {
  bool any_float = false;
  for (Type t : in) any_float |= t == Type::Float;
  const Type common = any_float ? Type::Float : in[0];
  operand = common;
  switch (op) {
    case Op::Not:
    case Op::And:
    case Op::Or:
      operand = Type::Bool;
      return Type::Bool;
    case Op::Lt: case Op::Le: case Op::Gt: case Op::Ge: case Op::Eq: case Op::Ne:
      return Type::Bool;
    case Op::Div: case Op::Exp: case Op::Exp2: case Op::Log: case Op::Log2: case Op::Sqrt:
    case Op::Rsqrt: case Op::Tanh: case Op::Sigmoid: case Op::Sin: case Op::Cos: case Op::Pow:
    case Op::ToFloat:
      operand = Type::Float;
      return Type::Float;
    case Op::ToInt:
      operand = in[0];
      return Type::Int;
    case Op::Shl: case Op::Shr: case Op::BitNot:
      operand = Type::Int;
      return Type::Int;
    default:
      return common;  // arithmetic, bitwise (Int or Bool), min/max/abs/clamp/sign/floor/ceil
  }
}

static NodeId build(Graph& g, Op op, std::span<const NodeId> args, SrcRange src) {
  Node n;
  n.op = op;
  n.nargs = static_cast<uint8_t>(args.size());
  n.src = src;
  if (op == Op::Select && args.size() == 3) {
    // The condition stays Bool; the branches are promoted to a common type.
    const Type ts[2] = {g[args[1]].type, g[args[2]].type};
    Type operand;
    n.type = result_type(Op::Add, ts, operand);
    n.args[0] = args[0];
    for (int i = 1; i < 3; ++i)
      n.args[i] = operand == Type::Float ? g.to_float(args[i]) : args[i];
    return g.add(n);
  }
  std::array<Type, kMaxArgs> ts{};
  for (size_t i = 0; i < args.size(); ++i) ts[i] = g[args[i]].type;
  Type operand;
  n.type = result_type(op, std::span(ts.data(), args.size()), operand);
  for (size_t i = 0; i < args.size(); ++i)
    n.args[i] = operand == Type::Float ? g.to_float(args[i]) : args[i];
  return g.add(n);
}

NodeId Graph::unary(Op op, NodeId a, SrcRange src) {
  if (op == Op::ToFloat) return to_float(a);
  const NodeId args[1] = {a};
  return build(*this, op, args, src);
}

NodeId Graph::binary(Op op, NodeId a, NodeId b, SrcRange src) {
  const NodeId args[2] = {a, b};
  return build(*this, op, args, src);
}

NodeId Graph::ternary(Op op, NodeId a, NodeId b, NodeId c, SrcRange src) {
  const NodeId args[3] = {a, b, c};
  return build(*this, op, args, src);
}

NodeId Graph::import(const Graph& other, NodeId from, const ImportMap& map) {
  std::vector<char> live(from + 1, 0);
  live[from] = 1;
  for (NodeId id = from + 1; id-- > 0;)
    if (live[id])
      for (NodeId a : other[id].operands()) live[a] = 1;
  std::vector<NodeId> to(from + 1, 0);
  for (NodeId id = 0; id <= from; ++id) {
    if (!live[id]) continue;
    Node n = other[id];
    if (n.op == Op::Input && map.input[static_cast<int>(n.input)] >= 0) {
      to[id] = static_cast<NodeId>(map.input[static_cast<int>(n.input)]);
      continue;
    }
    if (n.op == Op::Param && !map.param_slot.empty()) n.slot = map.param_slot.at(n.slot);
    if (n.op == Op::Load && !map.capture_slot.empty()) n.slot = map.capture_slot.at(n.slot);
    for (int i = 0; i < n.nargs; ++i) n.args[i] = to[n.args[i]];
    to[id] = add(n);
  }
  return to[from];
}

// ---- printer

namespace {

int precedence(Op op) {
  switch (op) {
    case Op::Select: return 1;
    case Op::Or: return 2;
    case Op::And: return 3;
    case Op::BitOr: return 4;
    case Op::BitXor: return 5;
    case Op::BitAnd: return 6;
    case Op::Eq: case Op::Ne: return 7;
    case Op::Lt: case Op::Le: case Op::Gt: case Op::Ge: return 8;
    case Op::Shl: case Op::Shr: return 9;
    case Op::Add: case Op::Sub: return 10;
    case Op::Mul: case Op::Div: case Op::FloorDiv: case Op::Mod: return 11;
    case Op::Neg: case Op::Not: case Op::BitNot: return 12;
    default: return 13;  // leaves and calls
  }
}

std::string float_literal(double v) {
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  if (std::isnan(v)) return "nan";
  std::string s = fmt::format("{}", v);
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}

struct Printer {
  const Graph& g;
  const Decls& decls;
  std::string_view score_name;

  std::string operand(NodeId id, int parent_prec, bool right) {
    const int p = precedence(g[id].op);
    std::string s = print(id);
    // Binary ops are left-associative, ?: right-associative.
    const bool paren = p < parent_prec || (p == parent_prec && (right != (p == 1)) && p != 13);
    return paren ? "(" + s + ")" : s;
  }

  std::string print(NodeId id) {
    const Node& n = g[id];
    const int p = precedence(n.op);
    switch (n.op) {
      case Op::Const:
        if (n.type == Type::Bool) return n.ival ? "true" : "false";
        if (n.type == Type::Int) return std::to_string(n.ival);
        return float_literal(n.fval);
      case Op::Input:
        return std::string(n.input == Input::Score ? score_name : input_name(n.input));
      case Op::Param:
        return n.slot < decls.params.size() ? decls.params[n.slot].name
                                            : fmt::format("param{}", n.slot);
      case Op::Load: {
        std::string s = n.slot < decls.captures.size() ? decls.captures[n.slot].name
                                                       : fmt::format("capture{}", n.slot);
        s += "[";
        for (int i = 0; i < n.nargs; ++i) s += (i ? ", " : "") + print(n.args[i]);
        return s + "]";
      }
      case Op::Neg: case Op::Not: case Op::BitNot: {
        std::string a = operand(n.args[0], p, true);
        // Keep "- -x" from printing as "--x".
        if (n.op == Op::Neg && !a.empty() && a[0] == '-') a = "(" + a + ")";
        return std::string(op_name(n.op)) + a;
      }
      case Op::Select:
        return operand(n.args[0], p + 1, false) + " ? " + operand(n.args[1], p, false) + " : " +
               operand(n.args[2], p, true);
      default:
        break;
    }
    if (p == 13) {  // a call
      std::string s = std::string(op_name(n.op)) + "(";
      for (int i = 0; i < n.nargs; ++i) s += (i ? ", " : "") + print(n.args[i]);
      return s + ")";
    }
    return operand(n.args[0], p, false) + " " + std::string(op_name(n.op)) + " " +
           operand(n.args[1], p, true);
  }
};

}  // namespace

std::string to_text(const Graph& g, NodeId root, const Decls& decls,
                    std::string_view score_name) {
  Printer pr{g, decls, score_name};
  return pr.print(root);
}

}  // namespace flexc::dsl
