// The checker: syntax tree -> typed IR, with every error it can find reported at once.
#include "dsl/frontend.h"

#include <cmath>
#include <fmt/format.h>
#include <limits>
#include <optional>
#include <unordered_map>

#include "dsl/analysis.h"
#include "dsl/lexer.h"
#include "dsl/parser.h"

namespace flexc::dsl {

namespace {

// How a built-in function types its arguments and result.
enum class Sig : uint8_t {
  Numeric,  // numbers of a common type; result of that type (min, max, abs, sign, clamp)
  Round,    // a number; an int is returned unchanged (floor, ceil)
  Math,     // numbers; float result (exp, ..., pow)
  Where,    // (bool, a, b) with a and b of a common type
  ToFloat,  // any type
  ToInt,    // any type
};

struct Builtin {
  std::string_view name;
  Op op;
  int arity;
  Sig sig;
};

constexpr Builtin kBuiltins[] = {
    {"min", Op::Min, 2, Sig::Numeric},     {"max", Op::Max, 2, Sig::Numeric},
    {"abs", Op::Abs, 1, Sig::Numeric},     {"sign", Op::Sign, 1, Sig::Numeric},
    {"clamp", Op::Clamp, 3, Sig::Numeric}, {"floor", Op::Floor, 1, Sig::Round},
    {"ceil", Op::Ceil, 1, Sig::Round},     {"exp", Op::Exp, 1, Sig::Math},
    {"exp2", Op::Exp2, 1, Sig::Math},      {"log", Op::Log, 1, Sig::Math},
    {"log2", Op::Log2, 1, Sig::Math},      {"sqrt", Op::Sqrt, 1, Sig::Math},
    {"rsqrt", Op::Rsqrt, 1, Sig::Math},    {"tanh", Op::Tanh, 1, Sig::Math},
    {"sigmoid", Op::Sigmoid, 1, Sig::Math}, {"sin", Op::Sin, 1, Sig::Math},
    {"cos", Op::Cos, 1, Sig::Math},        {"pow", Op::Pow, 2, Sig::Math},
    {"where", Op::Select, 3, Sig::Where},  {"float", Op::ToFloat, 1, Sig::ToFloat},
    {"int", Op::ToInt, 1, Sig::ToInt},
};

const Builtin* find_builtin(std::string_view name) {
  for (const Builtin& b : kBuiltins)
    if (b.name == name) return &b;
  return nullptr;
}

std::optional<Input> find_input(std::string_view name) {
  for (int i = 0; i < kNumInputs; ++i)
    if (input_name(static_cast<Input>(i)) == name) return static_cast<Input>(i);
  return std::nullopt;
}

bool numeric(Type t) { return t != Type::Bool; }

std::string count(size_t n, std::string_view one, std::string_view many) {
  return fmt::format("{} {}", n, n == 1 ? one : many);
}

std::string declaration(const CaptureDecl& c) {
  std::string dims;
  for (const Dim& d : c.dims) dims += (dims.empty() ? "" : ", ") + dim_name(d);
  return fmt::format("'{}' is declared as {}[{}]", c.name, dtype_name(c.dtype), dims);
}

// The value of one syntax node: a graph node, or nothing when an error was reported there or
// below (its users then stay silent instead of reporting the same mistake again).
struct Checked {
  NodeId id = 0;
  Type type = Type::Float;
  bool ok = false;
};

// Thrown when checking cannot go on (too many errors, too many nodes).
struct Stop {};

class Checker {
 public:
  Checker(ModKind kind, std::string_view src, const SyntaxTree& tree, const Decls& decls,
          const Limits& limits, std::vector<Diagnostic>& diags)
      : kind_(kind), src_(src), tree_(tree), decls_(decls), limits_(limits), diags_(diags) {}

  // Returns the root, or nothing when errors were reported.
  std::optional<NodeId> run() {
    try {
      vals_.resize(tree_.nodes.size());
      size_t next_let = 0;
      for (uint32_t i = 0; i < tree_.nodes.size(); ++i) {
        current_let_ = next_let < tree_.lets.size() ? &tree_.lets[next_let] : nullptr;
        vals_[i] = check(tree_.nodes[i]);
        // The nodes of a let's value come right before it, so it is bound just in time.
        for (; next_let < tree_.lets.size() && tree_.lets[next_let].value == i; ++next_let)
          bind(tree_.lets[next_let]);
      }
      current_let_ = nullptr;
      check_result();
    } catch (const Stop&) {
      return std::nullopt;
    }
    if (errors_ > 0) return std::nullopt;
    return vals_[tree_.result].id;
  }

  Graph& graph() { return g_; }

 private:
  // ---- reporting

  // Past max_errors, gives up (at the next error, so that the last one keeps its notes).
  void error(SrcRange r, std::string message, std::string hint = {}) {
    if (errors_ >= limits_.max_errors) throw Stop{};
    diags_.push_back({Severity::Error, r, std::move(message), std::move(hint)});
    ++errors_;
  }
  void note(SrcRange r, std::string message) {
    diags_.push_back({Severity::Note, r, std::move(message), {}});
  }
  std::string_view text(SrcRange r) const { return src_.substr(r.begin, r.end - r.begin); }
  const SyntaxNode& child(const SyntaxNode& n, size_t i) const {
    return tree_.nodes[tree_.children_of(n)[i]];
  }
  const Checked& value(const SyntaxNode& n, size_t i) const {
    return vals_[tree_.children_of(n)[i]];
  }

  // ---- results

  // Accounts for the nodes the builders just added, then enforces the size limits (reported at
  // the operator of `n` that crosses them).
  Checked made(NodeId id, const SyntaxNode& n) {
    const SrcRange where = n.op_range;
    for (size_t k = height_.size(); k < g_.size(); ++k) {
      uint32_t h = 1;
      uint64_t e = 1;
      for (NodeId a : g_[static_cast<NodeId>(k)].operands()) {
        h = std::max(h, height_[a] + 1);
        e = std::min<uint64_t>(e + expanded_[a], uint64_t{1} << 62);
      }
      height_.push_back(h);
      expanded_.push_back(e);
    }
    if (g_.size() > limits_.max_nodes) {
      error(where, fmt::format("expression is too large (more than {} nodes)", limits_.max_nodes));
      throw Stop{};
    }
    if (height_[id] > static_cast<uint32_t>(std::max(limits_.max_depth, 1))) {
      error(where, fmt::format("expression is nested too deeply (more than {} levels)",
                               limits_.max_depth));
      return {};
    }
    if (expanded_[id] > limits_.max_expanded_nodes) {
      error(where, fmt::format("expression is too large with its let bindings expanded (more "
                               "than {} nodes)", limits_.max_expanded_nodes));
      return {};
    }
    return {id, g_[id].type, true};
  }

  // ---- names

  void candidates(std::vector<std::string>& out, bool values, bool functions, bool captures) const {
    if (values) {
      for (const LetBinding& l : tree_.lets)  // in source order, for a stable suggestion
        if (lets_.count(l.name)) out.emplace_back(l.name);
      if (kind_ == ModKind::Map) out.emplace_back("x");
      for (int i = 0; i < kNumInputs && kind_ != ModKind::Map; ++i)
        if (kind_ == ModKind::Score || static_cast<Input>(i) != Input::Score)
          out.emplace_back(input_name(static_cast<Input>(i)));
      for (const ParamDecl& p : decls_.params) out.push_back(p.name);
      for (std::string_view k : {"true", "false", "inf"}) out.emplace_back(k);
    }
    if (captures)
      for (const CaptureDecl& c : decls_.captures) out.push_back(c.name);
    if (functions)
      for (const Builtin& b : kBuiltins) out.emplace_back(b.name);
  }
  std::string did_you_mean(std::string_view name, bool values, bool functions, bool captures) const {
    std::vector<std::string> cs;
    candidates(cs, values, functions, captures);
    std::string best = closest_name(name, cs);
    return best.empty() ? std::string() : fmt::format("did you mean '{}'?", best);
  }

  const ParamDecl* find_param(std::string_view name, size_t& slot) const {
    for (slot = 0; slot < decls_.params.size(); ++slot)
      if (decls_.params[slot].name == name) return &decls_.params[slot];
    return nullptr;
  }
  const CaptureDecl* find_capture(std::string_view name, size_t& slot) const {
    for (slot = 0; slot < decls_.captures.size(); ++slot)
      if (decls_.captures[slot].name == name) return &decls_.captures[slot];
    return nullptr;
  }

  Checked name(const SyntaxNode& n) {
    const std::string_view name = n.name;
    if (auto it = lets_.find(name); it != lets_.end()) return it->second;
    if (current_let_ && current_let_->name == name) {
      error(n.range, fmt::format("'{}' is used in its own definition", clip(name)));
      return {};
    }
    if (kind_ == ModKind::Map) {
      if (name == "x") return made(g_.input(Input::Score), n);
      if (find_input(name)) {
        error(n.range, fmt::format("a feature map is an expression of x alone; '{}' is not visible "
                                   "here",
                                   clip(name)));
        return {};
      }
    } else if (const auto in = find_input(name)) {
      if (*in == Input::Score && kind_ == ModKind::Mask) {
        error(n.range, "`score` is only visible in score_mod",
              "a mask_mod decides from b, h, q_idx, kv_idx, q_len and kv_len");
        return {};
      }
      return made(g_.input(*in), n);
    }
    size_t slot = 0;
    if (const ParamDecl* p = find_param(name, slot)) return param(*p, slot, n);
    if (const CaptureDecl* c = find_capture(name, slot)) {
      error(n.range, fmt::format("captured tensor '{}' must be indexed with {}", clip(name),
                                 count(c->dims.size(), "index", "indices")),
            declaration(*c));
      return {};
    }
    if (find_builtin(name)) {
      error(n.range, fmt::format("'{}' is a built-in function; call it as {}(...)", name, name));
      return {};
    }
    error(n.range, fmt::format("unknown name '{}'", clip(name)), did_you_mean(name, true, true, true));
    return {};
  }

  Checked param(const ParamDecl& p, size_t slot, const SyntaxNode& n) {
    if (!p.is_const) return made(g_.param(static_cast<uint16_t>(slot), p.type), n);
    if (p.type == Type::Float) return made(g_.constant_float(p.default_value), n);
    const double v = p.default_value;
    if (!(v == std::trunc(v) && v >= std::numeric_limits<int32_t>::min() &&
          v <= std::numeric_limits<int32_t>::max())) {
      error(n.range, fmt::format("const param '{}' has the value {}, which is not an int32", p.name, v));
      return {};
    }
    return made(g_.constant_int(static_cast<int64_t>(v)), n);
  }

  void bind(const LetBinding& let) {
    const std::string_view name = let.name;
    const Checked& v = vals_[let.value];
    std::string what;
    size_t slot = 0;
    if (lets_.count(name)) {
      error(let.name_range, fmt::format("redefinition of '{}'", clip(name)));
      for (const LetBinding& other : tree_.lets)
        if (other.name == name) {
          note(other.name_range, "previous definition is here");
          break;
        }
      return;
    }
    if (find_input(name)) what = "a built-in input";
    else if (find_builtin(name)) what = "a built-in function";
    else if (find_param(name, slot)) what = "a declared param";
    else if (find_capture(name, slot)) what = "a declared captured tensor";
    if (!what.empty()) {
      error(let.name_range, fmt::format("'{}' is {} and cannot be redefined", name, what),
            "choose another name for the let binding");
      return;
    }
    lets_.emplace(name, v);
  }

  // ---- nodes

  Checked check(const SyntaxNode& n) {
    switch (n.kind) {
      case Syntax::Int:
        if (n.ival < std::numeric_limits<int32_t>::min() || n.ival > std::numeric_limits<int32_t>::max()) {
          error(n.range, fmt::format("integer literal '{}' is out of the int32 range", clip(text(n.range))),
                fmt::format("write {}.0 for a float", clip(text(n.range))));
          return {};
        }
        return made(g_.constant_int(n.ival), n);
      case Syntax::Float: return made(g_.constant_float(n.fval), n);
      case Syntax::Bool: return made(g_.constant_bool(n.ival != 0), n);
      case Syntax::Name: return name(n);
      case Syntax::Unary: return unary(n);
      case Syntax::Binary: return binary(n);
      case Syntax::Select: return select(n);
      case Syntax::Call: return call(n);
      case Syntax::Index: return index(n);
    }
    return {};
  }

  bool children_ok(const SyntaxNode& n) const {
    for (uint32_t c : tree_.children_of(n))
      if (!vals_[c].ok) return false;
    return true;
  }

  Checked unary(const SyntaxNode& n) {
    if (!children_ok(n)) return {};
    const Checked a = value(n, 0);
    const std::string_view op = text(n.op_range);
    const bool fine = n.op == Op::Neg ? numeric(a.type) : n.op == Op::Not ? a.type == Type::Bool
                                                                          : a.type == Type::Int;
    if (!fine) {
      std::string hint;
      if (n.op == Op::Not && a.type == Type::Int) hint = "write x == 0, or ~x for the bitwise not";
      else if (n.op == Op::Not) hint = "write x == 0";
      else if (n.op == Op::BitNot && a.type == Type::Bool) hint = "write !x for a bool";
      else if (n.op == Op::Neg) hint = "write !x for a bool";
      error(n.range, fmt::format("invalid operand to '{}': {}", op, type_name(a.type)),
            std::move(hint));
      return {};
    }
    // A negated constant is a constant, so that printed text (which writes it as `-5`)
    // re-parses to the same graph. Int negation wraps; NaN has no sign.
    if (const Node& c = g_[a.id]; n.op == Op::Neg && c.op == Op::Const) {
      if (c.type == Type::Int)
        return made(g_.constant_int(static_cast<int32_t>(0u - static_cast<uint32_t>(c.ival))), n);
      return made(g_.constant_float(std::isnan(c.fval) ? c.fval : -c.fval), n);
    }
    return made(g_.unary(n.op, a.id, n.range), n);
  }

  Checked binary(const SyntaxNode& n) {
    if (!children_ok(n)) return {};
    const Checked a = value(n, 0), b = value(n, 1);
    const bool nums = numeric(a.type) && numeric(b.type);
    const bool bools = a.type == Type::Bool && b.type == Type::Bool;
    bool fine = false;
    std::string hint;
    switch (n.op) {
      case Op::Add: case Op::Sub: case Op::Mul: case Op::Div: case Op::FloorDiv: case Op::Mod:
        fine = nums;
        hint = "arithmetic needs numbers: convert a bool with int(...), or choose with where(...)";
        break;
      case Op::Shl: case Op::Shr:
        fine = a.type == Type::Int && b.type == Type::Int;
        hint = "shifts need ints";
        break;
      case Op::Lt: case Op::Le: case Op::Gt: case Op::Ge:
        fine = nums;
        hint = is_comparison(child(n, 0))
                   ? "comparisons do not chain: write a < b && b < c"
                   : "only numbers are ordered";
        break;
      case Op::Eq: case Op::Ne:
        fine = nums || bools;
        hint = "compare two numbers or two bools";
        break;
      case Op::BitAnd: case Op::BitXor: case Op::BitOr:
        fine = bools || (a.type == Type::Int && b.type == Type::Int);
        hint = is_comparison(child(n, 0)) || is_comparison(child(n, 1))
                   ? fmt::format("'{}' binds more loosely than comparisons, as in C: write "
                                 "(x {} 1) == 1", text(n.op_range), text(n.op_range))
                   : "it takes two bools or two ints";
        break;
      case Op::And: case Op::Or:
        fine = bools;
        hint = "it takes bools: compare a number first, e.g. x != 0";
        break;
      default: break;
    }
    if (!fine) {
      error(n.range, fmt::format("invalid operands to '{}': {} and {}", text(n.op_range),
                                 type_name(a.type), type_name(b.type)),
            std::move(hint));
      return {};
    }
    if ((n.op == Op::Div || n.op == Op::FloorDiv || n.op == Op::Mod) && is_zero(b.id)) {
      const SyntaxNode& rhs = child(n, 1);
      std::string why;
      size_t slot = 0;
      if (rhs.kind == Syntax::Name)
        if (const ParamDecl* p = find_param(rhs.name, slot); p && p->is_const)
          why = fmt::format("the const param '{}' is 0", p->name);
      error(rhs.range,
            n.op == Op::Div ? "division by zero"
                            : fmt::format("{} by zero", n.op == Op::Mod ? "modulo" : "floor division"),
            std::move(why));
      return {};
    }
    return made(g_.binary(n.op, a.id, b.id, n.range), n);
  }

  static bool is_comparison(const SyntaxNode& n) {
    if (n.kind != Syntax::Binary || n.parenthesized) return false;
    switch (n.op) {
      case Op::Lt: case Op::Le: case Op::Gt: case Op::Ge: case Op::Eq: case Op::Ne: return true;
      default: return false;
    }
  }

  // A divisor that is zero once constants are folded (`0`, `1.0 - 1.0`, `~~0`, a const param):
  // checked on the simplified divisor so that normalized text always parses back.
  bool is_zero(NodeId id) {
    const Node& d = g_[simplify_into(g_, id)];
    return d.op == Op::Const && (d.type == Type::Float ? d.fval == 0 : d.ival == 0);
  }

  // The two alternatives of `?:` / where(): two numbers (promoted) or two bools.
  bool branches_ok(const SyntaxNode& n, size_t first, std::string_view what) {
    const Checked a = value(n, first), b = value(n, first + 1);
    if ((numeric(a.type) && numeric(b.type)) || a.type == b.type) return true;
    error(n.range, fmt::format("the alternatives of {} have different types: {} and {}", what,
                               type_name(a.type), type_name(b.type)),
          "both must be numbers, or both bools");
    return false;
  }

  Checked select(const SyntaxNode& n) {
    if (!children_ok(n)) return {};
    const Checked c = value(n, 0);
    if (c.type != Type::Bool) {
      error(child(n, 0).range, fmt::format("the condition of '?:' must be bool, got {}", type_name(c.type)),
            "compare it, e.g. x != 0");
      return {};
    }
    if (!branches_ok(n, 1, "'?:'")) return {};
    return made(g_.ternary(Op::Select, c.id, value(n, 1).id, value(n, 2).id, n.range), n);
  }

  Checked call(const SyntaxNode& n) {
    const std::string_view name = n.name;
    const Builtin* fn = find_builtin(name);
    if (!fn) {
      size_t slot = 0;
      if (find_capture(name, slot))
        error(n.op_range, fmt::format("'{}' is a captured tensor, not a function", clip(name)),
              fmt::format("index it: {}[...]", clip(name)));
      else if (lets_.count(name) || find_input(name) || find_param(name, slot))
        error(n.op_range, fmt::format("'{}' is not a function", clip(name)));
      else
        error(n.op_range, fmt::format("unknown function '{}'", clip(name)),
              did_you_mean(name, false, true, false));
      return {};
    }
    if (n.num_children != static_cast<uint32_t>(fn->arity)) {
      error(n.range, fmt::format("'{}' takes {}, got {}", name, count(fn->arity, "argument", "arguments"),
                                 n.num_children));
      return {};
    }
    if (!children_ok(n)) return {};
    const Checked a = value(n, 0);
    switch (fn->sig) {
      case Sig::Numeric: case Sig::Round: case Sig::Math:
        for (size_t i = 0; i < n.num_children; ++i)
          if (!numeric(value(n, i).type)) {
            error(child(n, i).range, fmt::format("argument {} of '{}' must be a number, got {}",
                                                 i + 1, name, type_name(value(n, i).type)),
                  "convert a bool with int(...)");
            return {};
          }
        break;
      case Sig::Where:
        if (a.type != Type::Bool) {
          error(child(n, 0).range,
                fmt::format("the condition of 'where' must be bool, got {}", type_name(a.type)),
                "compare it, e.g. x != 0");
          return {};
        }
        if (!branches_ok(n, 1, "'where'")) return {};
        break;
      case Sig::ToFloat: case Sig::ToInt: break;
    }
    // floor / ceil / int of an int is the int itself.
    if ((fn->sig == Sig::Round || fn->sig == Sig::ToInt) && a.type == Type::Int) return a;
    switch (fn->arity) {
      case 1: return made(g_.unary(fn->op, a.id, n.range), n);
      case 2: return made(g_.binary(fn->op, a.id, value(n, 1).id, n.range), n);
      default: return made(g_.ternary(fn->op, a.id, value(n, 1).id, value(n, 2).id, n.range), n);
    }
  }

  Checked index(const SyntaxNode& n) {
    const std::string_view name = n.name;
    size_t slot = 0, unused = 0;
    // Lets, inputs and params come first in name resolution.
    const bool other = lets_.count(name) || find_input(name) || find_param(name, unused);
    const CaptureDecl* cap = other ? nullptr : find_capture(name, slot);
    if (!cap) {
      if (other)
        error(n.op_range, fmt::format("'{}' is not a captured tensor and cannot be indexed", clip(name)));
      else if (find_builtin(name))
        error(n.op_range, fmt::format("'{}' is a built-in function; call it as {}(...)", name, name));
      else
        error(n.op_range, fmt::format("unknown captured tensor '{}'", clip(name)),
              did_you_mean(name, decls_.captures.empty(), false, true));
      return {};
    }
    const size_t rank = cap->dims.size();
    if (rank < 1 || rank > static_cast<size_t>(kMaxArgs)) {
      error(n.op_range, fmt::format("captured tensor '{}' has rank {}; ranks 1 to {} are supported",
                                    cap->name, rank, kMaxArgs));
      return {};
    }
    if (n.num_children != rank) {
      error(n.range, fmt::format("captured tensor '{}' has {}, got {}", clip(name),
                                 count(rank, "dimension", "dimensions"),
                                 count(n.num_children, "index", "indices")),
            declaration(*cap));
      return {};
    }
    if (!children_ok(n)) return {};
    std::array<NodeId, kMaxArgs> idx{};
    bool fine = true;
    for (size_t i = 0; i < rank; ++i) {
      const Checked v = value(n, i);
      if (v.type != Type::Int) {
        error(child(n, i).range, fmt::format("index {} of '{}' must be int, got {}", i + 1,
                                             clip(name), type_name(v.type)),
              v.type == Type::Float ? "write int(...), which truncates toward zero"
                                    : "write int(...) or where(...)");
        fine = false;
      }
      idx[i] = v.id;
    }
    if (!fine) return {};
    return made(g_.load(static_cast<uint16_t>(slot), dtype_value_type(cap->dtype),
                        std::span<const NodeId>(idx.data(), rank), n.range),
                n);
  }

  void check_result() {
    const Checked& r = vals_[tree_.result];
    if (!r.ok) return;
    const SrcRange where = tree_.nodes[tree_.result].range;
    if (kind_ == ModKind::Map && r.type != Type::Float)
      error(where, fmt::format("a feature map must be float, got {}", type_name(r.type)),
            r.type == Type::Int ? "write float(...)" : "write where(cond, a, b) for a choice");
    if (kind_ == ModKind::Score && r.type != Type::Float)
      error(where, fmt::format("score_mod must be float, got {}", type_name(r.type)),
            r.type == Type::Int ? "write float(...)"
                                : "a score_mod cannot mask: write the condition as the mask_mod, or "
                                  "where(cond, score, -inf)");
    if (kind_ == ModKind::Mask && r.type != Type::Bool)
      error(where, fmt::format("mask_mod must be bool, got {}", type_name(r.type)),
            "a mask_mod says which scores to keep: write a comparison, e.g. q_idx >= kv_idx");
  }

  ModKind kind_;
  std::string_view src_;
  const SyntaxTree& tree_;
  const Decls& decls_;
  const Limits& limits_;
  std::vector<Diagnostic>& diags_;
  size_t errors_ = 0;

  Graph g_;
  std::vector<uint32_t> height_;    // per graph node: longest path to a leaf
  std::vector<uint64_t> expanded_;  // per graph node: size as a tree, saturating
  std::vector<Checked> vals_;       // per syntax node
  std::unordered_map<std::string_view, Checked> lets_;
  const LetBinding* current_let_ = nullptr;
};

}  // namespace

Mod parse_mod(ModKind kind, std::string_view source, const Decls& decls, std::string origin,
              const Limits& limits) {
  std::vector<Diagnostic> diags;
  auto fail = [&]() -> Mod { throw DslError(std::move(diags), std::string(source), std::move(origin)); };
  if (source.size() > limits.max_source_bytes) {
    diags.push_back({Severity::Error, {0, 0},
                     fmt::format("the source is too large: {} bytes (the limit is {})",
                                 source.size(), limits.max_source_bytes),
                     {}});
    return fail();
  }
  const size_t max_errors = std::max<size_t>(limits.max_errors, 1);
  const std::vector<Token> tokens = lex(source, diags);
  if (!diags.empty()) {
    if (diags.size() > max_errors) diags.resize(max_errors);
    return fail();
  }
  const SyntaxTree tree = parse(source, tokens, limits.max_depth, max_errors, diags);
  if (!diags.empty()) return fail();

  Limits capped = limits;
  capped.max_errors = max_errors;
  Checker checker(kind, source, tree, decls, capped, diags);
  const std::optional<NodeId> root = checker.run();
  if (!root) return fail();

  Mod m;
  m.kind = kind;
  // Only what the result reaches (an unused let leaves nodes behind).
  m.graph.root = m.graph.import(checker.graph(), *root);
  m.source = std::string(source);
  m.origin = std::move(origin);
  return m;
}

bool is_reserved_name(std::string_view name) {
  return find_input(name) || find_builtin(name) || is_keyword(name);
}

bool is_identifier(std::string_view name) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool letter = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
    if (!letter && (i == 0 || c < '0' || c > '9')) return false;
  }
  return true;
}

}  // namespace flexc::dsl
