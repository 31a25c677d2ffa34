// The DSL front end: lexer, parser, checker and diagnostics (dsl/frontend.h, dsl/diagnostics.h).
#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "dsl/diagnostics.h"
#include "dsl/analysis.h"
#include "dsl/frontend.h"
#include "test_random.h"

using namespace flexc::dsl;

namespace {

const Decls& test_decls() {
  static const Decls d = [] {
    Decls x;
    x.captures.push_back({"bias", DType::F32, {{Dim::H}, {Dim::Fixed, 8192}}});
    x.captures.push_back({"doc", DType::I32, {{Dim::KvLen}}});
    x.captures.push_back({"flags", DType::Bool, {{Dim::QLen}}});
    x.captures.push_back({"table", DType::BF16, {{Dim::Fixed, 4}, {Dim::Fixed, 4}, {Dim::Fixed, 4}}});
    x.params.push_back({"window", Type::Int, 128, false});
    x.params.push_back({"scale", Type::Float, 1.0, false});
    x.params.push_back({"cap", Type::Float, 30.0, true});
    x.params.push_back({"n", Type::Int, 7, true});
    x.params.push_back({"zero", Type::Int, 0, true});
    x.params.push_back({"half", Type::Int, 2.5, true});
    return x;
  }();
  return d;
}

Mod parse(ModKind k, std::string_view src, const Limits& l = {}) {
  return parse_mod(k, src, test_decls(), k == ModKind::Score ? "score_mod" : "mask_mod", l);
}
Mod score(std::string_view src) { return parse(ModKind::Score, src); }
Mod mask(std::string_view src) { return parse(ModKind::Mask, src); }

// The rendered error of a mod that must not check.
std::string error_of(ModKind k, std::string_view src, const Limits& l = {}) {
  try {
    parse(k, src, l);
  } catch (const DslError& e) {
    return e.what();
  }
  return "(no error)";
}

std::string text(const Mod& m) { return to_text(m.graph, m.graph.root, test_decls()); }

// A source and what is expected of it (normalized text, or a rendered error).
struct Case {
  ModKind kind;
  const char* src;
  const char* expected;
};

// Each mask_mod source must fail with an error of the given message.
void check_errors(std::initializer_list<std::pair<const char*, const char*>> cases) {
  for (const auto& [src, message] : cases) {
    INFO(src);
    CHECK_THAT(error_of(ModKind::Mask, src), Catch::Contains(std::string("error: ") + message));
  }
}

// Structural equality of two expressions (node ids may differ between graphs).
class SameExpr {
 public:
  SameExpr(const Graph& a, const Graph& b) : a_(a), b_(b) {}
  bool operator()(NodeId x, NodeId y) {
    if (auto it = memo_.find({x, y}); it != memo_.end()) return it->second;
    const Node& p = a_[x];
    const Node& q = b_[y];
    bool same = p.op == q.op && p.type == q.type && p.nargs == q.nargs && p.input == q.input &&
                p.slot == q.slot && p.ival == q.ival &&
                std::bit_cast<uint64_t>(p.fval) == std::bit_cast<uint64_t>(q.fval);
    for (int i = 0; same && i < p.nargs; ++i) same = (*this)(p.args[i], q.args[i]);
    memo_[{x, y}] = same;
    return same;
  }

 private:
  const Graph& a_;
  const Graph& b_;
  std::map<std::pair<NodeId, NodeId>, bool> memo_;
};

bool same_graph(const Graph& a, const Graph& b) { return SameExpr(a, b)(a.root, b.root); }

// Random well-typed source text together with the graph the checker must build from it, made
// with the Graph builders directly. Every operand is parenthesised: the structure is fixed by
// the text, whatever the precedence rules.
class RandomSource {
 public:
  RandomSource(uint64_t seed, bool score_visible) : rng_(seed), score_visible_(score_visible) {}

  struct Expr {
    std::string text;
    NodeId id = 0;
    Type type = Type::Int;
  };

  // A whole mod: some lets, then the final expression of type `t`.
  std::string mod(Graph& g, Type t) {
    std::string src;
    const int num_lets = pick(0, 3);
    for (int i = 0; i < num_lets; ++i) {
      const Type lt = static_cast<Type>(pick(0, 2));
      Expr e = gen(g, lt, 3);
      const std::string name = "v" + std::to_string(i);
      src += "let" + ws() + name + ws() + "=" + ws() + e.text + ws() + ";" + ws();
      lets_.push_back({name, e.id, lt});
    }
    Expr r = gen(g, t, 4);
    g.root = r.id;
    return src + r.text + (coin() ? ws() : "");
  }

 private:
  int pick(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  bool coin() { return pick(0, 1) == 1; }
  template <typename T>
  const T& one_of(const std::vector<T>& v) { return v[static_cast<size_t>(pick(0, static_cast<int>(v.size()) - 1))]; }

  std::string ws() {
    static const std::vector<std::string> spaces = {" ", " ", " ", "  ", "\n", "\t", " # note\n"};
    return one_of(spaces);
  }
  std::string paren(const std::string& s) { return "(" + s + ")"; }

  Expr numeric(Graph& g, int depth) { return gen(g, coin() ? Type::Int : Type::Float, depth); }
  Expr nonzero_divisor(Graph& g, Type t, int depth) {
    Expr e = gen(g, t, depth);
    // The checker rejects a divisor that folds to zero (e.g. `0 // n`), so test what it folds to.
    Graph divisor = g;
    divisor.root = e.id;
    const Graph folded = simplify(divisor);
    const Node& n = folded[folded.root];
    if (n.op == Op::Const && (n.type == Type::Float ? n.fval == 0 : n.ival == 0))
      return {"3", g.constant_int(3), Type::Int};
    return e;
  }

  Expr leaf(Graph& g, Type t) {
    std::vector<Expr> c;
    for (const auto& l : lets_)
      if (l.type == t) c.push_back({l.name, l.id, t});
    switch (t) {
      case Type::Bool:
        c.push_back({"true", g.constant_bool(true), t});
        c.push_back({"false", g.constant_bool(false), t});
        break;
      case Type::Int: {
        static const std::vector<int64_t> extremes = {2147483647, -2147483648LL, 0, -1};
        const int64_t v = coin() ? pick(-20, 20) : one_of(extremes);
        c.push_back({std::to_string(v), g.constant_int(v), t});
        for (Input in : {Input::B, Input::H, Input::QIdx, Input::KvIdx, Input::QLen, Input::KvLen})
          c.push_back({std::string(input_name(in)), g.input(in), t});
        c.push_back({"window", g.param(0, Type::Int), t});
        c.push_back({"n", g.constant_int(7), t});
        break;
      }
      case Type::Float: {
        struct Lit {
          const char* text;
          double value;
        };
        static const std::vector<Lit> lits = {{"0.5", 0.5},   {"2.", 2.0},     {".25", 0.25},
                                              {"1e-3", 1e-3}, {"3.5E2", 350.}, {"1e+2", 100.},
                                              {"-1.5", -1.5}, {"inf", INFINITY}, {"-inf", -INFINITY},
                                              {"0.0", 0.0},   {"-0.0", -0.0}};
        const Lit& l = one_of(lits);
        c.push_back({l.text, g.constant_float(l.value), t});
        if (score_visible_) c.push_back({"score", g.input(Input::Score), t});
        c.push_back({"scale", g.param(1, Type::Float), t});
        c.push_back({"cap", g.constant_float(30.0), t});
        break;
      }
    }
    return one_of(c);
  }

  Expr load(Graph& g, Type t, int depth) {
    std::vector<Expr> idx;
    std::string name;
    uint16_t slot = 0;
    size_t rank = 1;
    if (t == Type::Int) name = "doc", slot = 1;
    else if (t == Type::Bool) name = "flags", slot = 2;
    else if (coin()) name = "bias", slot = 0, rank = 2;
    else name = "table", slot = 3, rank = 3;
    std::string s = name + "[";
    std::array<NodeId, kMaxArgs> ids{};
    for (size_t i = 0; i < rank; ++i) {
      Expr e = gen(g, Type::Int, depth - 1);
      s += (i ? "," + ws() : "") + e.text;
      ids[i] = e.id;
    }
    return {s + "]", g.load(slot, t, std::span<const NodeId>(ids.data(), rank)), t};
  }

  Expr select(Graph& g, Type t, int depth) {
    Expr c = gen(g, Type::Bool, depth - 1);
    // A float select may mix an int alternative in (it is promoted).
    Expr a = t == Type::Float ? numeric(g, depth - 1) : gen(g, t, depth - 1);
    Expr b = gen(g, t, depth - 1);
    const NodeId id = g.ternary(Op::Select, c.id, a.id, b.id);
    if (coin())
      return {"where(" + c.text + "," + ws() + a.text + "," + ws() + b.text + ")", id, g[id].type};
    return {paren(paren(c.text) + ws() + "?" + ws() + paren(a.text) + ws() + ":" + ws() + paren(b.text)),
            id, g[id].type};
  }

  using OpTable = std::vector<std::pair<Op, const char*>>;

  // Applies an operator picked from `table`: infix, or a call for min, max and pow.
  Expr apply(Graph& g, const OpTable& table, const Expr& a, const Expr& b) {
    const auto& [op, s] = one_of(table);
    const NodeId id = g.binary(op, a.id, b.id);
    if (op == Op::Min || op == Op::Max || op == Op::Pow)
      return {std::string(s) + "(" + a.text + "," + ws() + b.text + ")", id, g[id].type};
    return {paren(paren(a.text) + ws() + s + ws() + paren(b.text)), id, g[id].type};
  }
  // Applies a prefix operator or one-argument function picked from `table`. As the checker
  // does, a negated constant is a constant.
  Expr apply(Graph& g, const OpTable& table, const Expr& a) {
    const auto& [op, s] = one_of(table);
    const Node& c = g[a.id];
    NodeId id;
    if (op == Op::Neg && c.op == Op::Const)
      id = c.type == Type::Int ? g.constant_int(static_cast<int32_t>(0u - static_cast<uint32_t>(c.ival)))
                               : g.constant_float(-c.fval);
    else
      id = g.unary(op, a.id);
    return {s + paren(a.text), id, g[id].type};
  }
  Expr clamp(Graph& g, const Expr& x, const Expr& lo, const Expr& hi) {
    const NodeId id = g.ternary(Op::Clamp, x.id, lo.id, hi.id);
    return {"clamp(" + x.text + ", " + lo.text + ", " + hi.text + ")", id, g[id].type};
  }

  Expr gen(Graph& g, Type t, int depth) {
    if (depth <= 0 || pick(0, 4) == 0) return leaf(g, t);
    const int d = depth - 1;
    static const OpTable compare = {{Op::Lt, "<"}, {Op::Le, "<="}, {Op::Gt, ">"},
                                    {Op::Ge, ">="}, {Op::Eq, "=="}, {Op::Ne, "!="}};
    static const OpTable logic = {{Op::Eq, "=="},  {Op::Ne, "!="},     {Op::And, "&&"},
                                  {Op::And, "and"}, {Op::Or, "||"},     {Op::Or, "or"},
                                  {Op::BitAnd, "&"}, {Op::BitOr, "|"}, {Op::BitXor, "^"}};
    static const OpTable int_ops = {{Op::Add, "+"},    {Op::Sub, "-"},   {Op::Mul, "*"},
                                    {Op::Shl, "<<"},   {Op::Shr, ">>"},  {Op::BitAnd, "&"},
                                    {Op::BitOr, "|"},  {Op::BitXor, "^"}, {Op::Min, "min"},
                                    {Op::Max, "max"}};
    static const OpTable float_ops = {{Op::Add, "+"},   {Op::Sub, "-"},   {Op::Mul, "*"},
                                      {Op::Min, "min"}, {Op::Max, "max"}, {Op::Pow, "pow"}};
    static const OpTable floor_ops = {{Op::FloorDiv, "//"}, {Op::Mod, "%"}};
    static const OpTable float_div = {{Op::Div, "/"}, {Op::FloorDiv, "//"}, {Op::Mod, "%"}};
    static const OpTable nots = {{Op::Not, "!"}, {Op::Not, "not "}};
    static const OpTable int_unary = {{Op::Neg, "-"}, {Op::BitNot, "~"}, {Op::Abs, "abs"}, {Op::Sign, "sign"}};
    static const OpTable float_unary = {{Op::Neg, "-"}, {Op::Abs, "abs"}, {Op::Sign, "sign"},
                                        {Op::Floor, "floor"}, {Op::Ceil, "ceil"}};
    static const OpTable math = {{Op::Exp, "exp"},   {Op::Exp2, "exp2"},   {Op::Log, "log"},
                                 {Op::Log2, "log2"}, {Op::Sqrt, "sqrt"},   {Op::Rsqrt, "rsqrt"},
                                 {Op::Tanh, "tanh"}, {Op::Sigmoid, "sigmoid"}, {Op::Sin, "sin"},
                                 {Op::Cos, "cos"}};
    switch (t) {
      case Type::Bool:
        switch (pick(0, 4)) {
          case 0: return apply(g, compare, numeric(g, d), numeric(g, d));
          case 1: return apply(g, logic, gen(g, t, d), gen(g, t, d));
          case 2: return apply(g, nots, gen(g, t, d));
          case 3: return load(g, t, depth);
          default: return select(g, t, depth);
        }
      case Type::Int:
        switch (pick(0, 7)) {
          case 0: return apply(g, int_ops, gen(g, t, d), gen(g, t, d));
          case 1: return apply(g, floor_ops, gen(g, t, d), nonzero_divisor(g, t, d));
          case 2: return apply(g, int_unary, gen(g, t, d));
          case 3: return clamp(g, gen(g, t, d), gen(g, t, d), gen(g, t, d));
          case 4: {
            // int(x): a conversion of a float or bool; of an int, the int itself.
            Expr a = gen(g, static_cast<Type>(pick(0, 2)), d);
            if (a.type == Type::Int) return {"int" + paren(a.text), a.id, t};
            return apply(g, {{Op::ToInt, "int"}}, a);
          }
          case 5: {
            Expr a = gen(g, t, d);  // floor / ceil of an int is the int
            return {(coin() ? "floor" : "ceil") + paren(a.text), a.id, t};
          }
          case 6: return load(g, t, depth);
          default: return select(g, t, depth);
        }
      case Type::Float:
        switch (pick(0, 7)) {
          case 0: {
            Expr a = gen(g, t, d), b = numeric(g, d);
            return coin() ? apply(g, float_ops, a, b) : apply(g, float_ops, b, a);
          }
          // `/` of any numbers is float; `//` and `%` of a float are float.
          case 1: return apply(g, float_div, gen(g, t, d), nonzero_divisor(g, coin() ? Type::Int : t, d));
          case 2: return apply(g, float_unary, gen(g, t, d));
          case 3: return apply(g, math, numeric(g, d));
          case 4: {
            Expr a = gen(g, static_cast<Type>(pick(0, 2)), d);
            return {"float" + paren(a.text), g.to_float(a.id), t};
          }
          case 5: return clamp(g, gen(g, t, d), numeric(g, d), numeric(g, d));
          case 6: return load(g, t, depth);
          default: return select(g, t, depth);
        }
    }
    return leaf(g, t);
  }

  struct Let {
    std::string name;
    NodeId id;
    Type type;
  };
  std::mt19937_64 rng_;
  bool score_visible_;
  std::vector<Let> lets_;
};

using flexc::testing::fresh_seed;

}  // namespace

// ---------------------------------------------------------------------------------------------
// Language features

TEST_CASE("every language feature parses to the expected normalized text", "[frontend]") {
  const Case cases[] = {
      {ModKind::Score, "score", "score"},
      {ModKind::Score, "score - 1.5", "score - 1.5"},
      {ModKind::Score, "score * 2. + .5 - 1e-3 + 2.5E+2", "score * 2.0 + 0.5 - 0.001 + 250.0"},
      {ModKind::Score, "score + 1", "score + float(1)"},
      {ModKind::Score, "q_idx / kv_idx", "float(q_idx) / float(kv_idx)"},
      {ModKind::Score, "float(q_idx // 3 + q_idx % 4)", "float(q_idx // 3 + q_idx % 4)"},
      {ModKind::Score, "score // 2.0 + score % 3.0", "score // 2.0 + score % 3.0"},
      {ModKind::Score, "float((q_idx << 2) + (kv_idx >> 1))", "float((q_idx << 2) + (kv_idx >> 1))"},
      {ModKind::Score, "float(q_idx & 1 | kv_idx ^ 2)", "float(q_idx & 1 | kv_idx ^ 2)"},
      {ModKind::Score, "-score + float(~q_idx)", "-score + float(~q_idx)"},
      {ModKind::Score, "where(q_idx >= kv_idx, score, -inf)", "q_idx >= kv_idx ? score : -inf"},
      {ModKind::Score, "q_idx == kv_idx ? score : 0", "q_idx == kv_idx ? score : float(0)"},
      {ModKind::Score, "min(score, 1.0) + max(score, 0.0)", "min(score, 1.0) + max(score, 0.0)"},
      {ModKind::Score, "abs(score) + sign(score) + clamp(score, -1.0, 1.0)",
       "abs(score) + sign(score) + clamp(score, -1.0, 1.0)"},
      {ModKind::Score, "exp(score) + exp2(score) + log(score) + log2(score)",
       "exp(score) + exp2(score) + log(score) + log2(score)"},
      {ModKind::Score, "sqrt(score) + rsqrt(score) + tanh(score) + sigmoid(score)",
       "sqrt(score) + rsqrt(score) + tanh(score) + sigmoid(score)"},
      {ModKind::Score, "sin(score) + cos(score) + pow(score, 2)", "sin(score) + cos(score) + pow(score, float(2))"},
      {ModKind::Score, "exp(q_idx)", "exp(float(q_idx))"},
      {ModKind::Score, "floor(score) + ceil(score)", "floor(score) + ceil(score)"},
      {ModKind::Score, "float(floor(q_idx) + ceil(kv_idx))", "float(q_idx + kv_idx)"},
      {ModKind::Score, "float(int(score) + int(true) + int(q_idx))", "float(int(score) + int(true) + q_idx)"},
      {ModKind::Score, "float(true) + float(score)", "float(true) + score"},
      {ModKind::Score, "score * float(b + h + q_len + kv_len)", "score * float(b + h + q_len + kv_len)"},
      {ModKind::Score, "-2147483648 * score + 2147483647", "float(-2147483648) * score + float(2147483647)"},
      {ModKind::Score, "-0.0 + nan * score + inf", "-0.0 + nan * score + inf"},
      {ModKind::Score, "score * scale + window", "score * scale + float(window)"},
      {ModKind::Score, "tanh(score / cap) * cap", "tanh(score / 30.0) * 30.0"},
      {ModKind::Score, "score + bias[h, q_idx - kv_idx + 4095]", "score + bias[h, q_idx - kv_idx + 4095]"},
      {ModKind::Score, "score + table[0, 1, 2]", "score + table[0, 1, 2]"},
      {ModKind::Score, "let x = 1; let y = x * 2; score + y;", "score + float(1 * 2)"},
      {ModKind::Score, "score # a comment: q_id / 0 )\n + 1.0", "score + 1.0"},
      {ModKind::Mask, "true", "true"},
      {ModKind::Mask, "false || flags[q_idx]", "false || flags[q_idx]"},
      {ModKind::Mask, "q_idx >= kv_idx and not (b == 1) or h != 2", "q_idx >= kv_idx && !(b == 1) || h != 2"},
      {ModKind::Mask, "!(q_idx < kv_idx) && q_idx <= kv_idx + n", "!(q_idx < kv_idx) && q_idx <= kv_idx + 7"},
      {ModKind::Mask, "q_idx > 0 & kv_idx > 0 | b > 0 ^ h > 0", "q_idx > 0 & kv_idx > 0 | b > 0 ^ h > 0"},
      {ModKind::Mask, "(q_idx > 0) == (kv_idx > 0)", "q_idx > 0 == kv_idx > 0"},
      {ModKind::Mask, "(q_idx == 0) == (kv_idx == 0)", "q_idx == 0 == (kv_idx == 0)"},
      {ModKind::Mask, "doc[q_idx] == doc[kv_idx]", "doc[q_idx] == doc[kv_idx]"},
      {ModKind::Mask, "q_idx + kv_len - q_len >= kv_idx", "q_idx + kv_len - q_len >= kv_idx"},
      {ModKind::Mask, "q_idx - kv_idx < window", "q_idx - kv_idx < window"},
  };
  for (const Case& c : cases) {
    INFO(c.src);
    const Mod m = parse(c.kind, c.src);
    CHECK(text(m) == c.expected);
    CHECK(m.graph[m.graph.root].type == (c.kind == ModKind::Score ? Type::Float : Type::Bool));
    CHECK(m.source == c.src);
    CHECK(m.origin == (c.kind == ModKind::Score ? "score_mod" : "mask_mod"));
    CHECK(m.kind == c.kind);
  }
}

TEST_CASE("operators follow C precedence and associativity", "[frontend]") {
  // Each pair must build the same graph; the explicit form differs from the other grouping.
  struct Case {
    const char* src;
    const char* explicit_form;
    const char* other_grouping;
  };
  const Case cases[] = {
      {"q_idx + kv_idx * b", "q_idx + (kv_idx * b)", "(q_idx + kv_idx) * b"},
      {"q_idx - kv_idx - b", "(q_idx - kv_idx) - b", "q_idx - (kv_idx - b)"},
      {"q_idx // kv_idx * b", "(q_idx // kv_idx) * b", "q_idx // (kv_idx * b)"},
      {"q_idx % kv_idx // b", "(q_idx % kv_idx) // b", "q_idx % (kv_idx // b)"},
      {"q_idx << kv_idx + b", "q_idx << (kv_idx + b)", "(q_idx << kv_idx) + b"},
      {"q_idx >> kv_idx >> b", "(q_idx >> kv_idx) >> b", "q_idx >> (kv_idx >> b)"},
      {"q_idx & kv_idx ^ b", "(q_idx & kv_idx) ^ b", "q_idx & (kv_idx ^ b)"},
      {"q_idx ^ kv_idx | b", "(q_idx ^ kv_idx) | b", "q_idx ^ (kv_idx | b)"},
      {"q_idx | kv_idx & b", "q_idx | (kv_idx & b)", "(q_idx | kv_idx) & b"},
      {"-q_idx * kv_idx", "(-q_idx) * kv_idx", "-(q_idx * kv_idx)"},
      {"~q_idx + kv_idx", "(~q_idx) + kv_idx", "~(q_idx + kv_idx)"},
      {"- -q_idx - kv_idx", "(-(-q_idx)) - kv_idx", "-(-(q_idx - kv_idx))"},
      {"q_idx == kv_idx != (b < h)", "(q_idx == kv_idx) != (b < h)", "q_idx == (kv_idx != (b < h))"},
  };
  const char* bool_cases[][3] = {
      {"q_idx < 1 == kv_idx < 2", "(q_idx < 1) == (kv_idx < 2)", "q_idx < (1 == kv_idx) < 2"},
      {"b > 0 || h > 0 && q_idx > 0", "b > 0 || (h > 0 && q_idx > 0)", "(b > 0 || h > 0) && q_idx > 0"},
      {"b > 0 and h > 0 or q_idx > 0", "(b > 0 && h > 0) || q_idx > 0", "b > 0 && (h > 0 || q_idx > 0)"},
      {"!(b > 0) && h > 0", "(!(b > 0)) && h > 0", "!(b > 0 && h > 0)"},
      {"b > 0 & h > 0 | q_idx > 0", "((b > 0) & (h > 0)) | (q_idx > 0)", "(b > 0) & ((h > 0) | (q_idx > 0))"},
      {"b > 0 ? h > 0 : q_idx > 0 ? kv_idx > 0 : false", "b > 0 ? h > 0 : (q_idx > 0 ? kv_idx > 0 : false)",
       "(b > 0 ? h > 0 : q_idx > 0) ? kv_idx > 0 : false"},
      {"b > 0 || h > 0 ? q_idx > 0 : false", "(b > 0 || h > 0) ? q_idx > 0 : false",
       "b > 0 || (h > 0 ? q_idx > 0 : false)"},
  };
  // False also when one side does not type-check (some other groupings do not).
  auto same = [](ModKind k, const std::string& a, const std::string& b) {
    try {
      const Mod x = parse(k, a), y = parse(k, b);
      return same_graph(x.graph, y.graph);
    } catch (const DslError&) {
      return false;
    }
  };
  for (const Case& c : cases) {
    INFO(c.src);
    const std::string wrap = std::string("float(") + c.src + ")";
    const std::string exp = std::string("float(") + c.explicit_form + ")";
    const std::string other = std::string("float(") + c.other_grouping + ")";
    CHECK(same(ModKind::Score, wrap, exp));
    CHECK_FALSE(same(ModKind::Score, wrap, other));
  }
  for (const auto& c : bool_cases) {
    INFO(c[0]);
    CHECK(same(ModKind::Mask, c[0], c[1]));
    CHECK_FALSE(same(ModKind::Mask, c[0], c[2]));
  }
  // The printer adds exactly the parentheses the grouping needs.
  CHECK(text(score("float(q_idx - (kv_idx - b))")) == "float(q_idx - (kv_idx - b))");
  CHECK(text(score("float((q_idx - kv_idx) - b)")) == "float(q_idx - kv_idx - b)");
  CHECK(text(score("float(-(q_idx * kv_idx))")) == "float(-(q_idx * kv_idx))");
  CHECK(text(score("float(-(q_idx + 1))")) == "float(-(q_idx + 1))");
  CHECK(text(score("float(- -q_idx)")) == "float(-(-q_idx))");
  CHECK(text(mask("b > 0 ? h > 0 : (q_idx > 0 ? kv_idx > 0 : false)")) ==
        "b > 0 ? h > 0 : q_idx > 0 ? kv_idx > 0 : false");
  CHECK(text(mask("(b > 0 ? h > 0 : q_idx > 0) ? true : false")) ==
        "(b > 0 ? h > 0 : q_idx > 0) ? true : false");
}

TEST_CASE("a negated constant is a constant", "[frontend]") {
  const Mod m = score("float(-5 + -(3) + -(-(n))) + -2.5 + -cap - -(-inf) + -nan");
  for (const Node& n : m.graph.nodes()) CHECK(n.op != Op::Neg);
  CHECK(text(m) == "float(-5 + -3 + 7) + -2.5 + -30.0 - inf + nan");
  // Int negation wraps: -(-2147483648) is -2147483648.
  CHECK(text(mask("q_idx > -(-2147483648)")) == "q_idx > -2147483648");
  // The int32 minimum can be written; one past it cannot.
  const Mod lo = mask("q_idx > -2147483648");
  CHECK(lo.graph[lo.graph[lo.graph.root].args[1]].ival == -2147483648LL);
  CHECK_THAT(error_of(ModKind::Mask, "q_idx > -2147483649"), Catch::Contains("out of the int32 range"));
  CHECK_THAT(error_of(ModKind::Mask, "q_idx > 2147483648"), Catch::Contains("out of the int32 range"));
  // A negated expression stays a negation.
  const Mod neg = score("-(score)");
  CHECK(neg.graph[neg.graph.root].op == Op::Neg);
}

TEST_CASE("let bindings are shared nodes", "[frontend]") {
  const Mod m = score("let d = q_idx - kv_idx;\nlet s = d * d;\nscore + float(s + d)");
  const Mod inlined = score("score + float((q_idx - kv_idx) * (q_idx - kv_idx) + (q_idx - kv_idx))");
  CHECK(same_graph(m.graph, inlined.graph));
  // One Sub node, used by both the Mul (twice) and the Add.
  int subs = 0;
  NodeId sub = 0;
  for (NodeId id = 0; id < m.graph.size(); ++id)
    if (m.graph[id].op == Op::Sub) ++subs, sub = id;
  CHECK(subs == 1);
  for (const Node& n : m.graph.nodes())
    if (n.op == Op::Mul) CHECK((n.args[0] == sub && n.args[1] == sub));
  // Unused lets are fine and leave nothing behind.
  const Mod unused = score("let unused = exp(q_idx * 3); score");
  CHECK(unused.graph.size() == 1);
  // A let may be used by a later let and in indices.
  CHECK(text(score("let i = q_idx - kv_idx + 4095; let j = h; score + bias[j, i]")) ==
        "score + bias[h, q_idx - kv_idx + 4095]");
}

TEST_CASE("params: runtime ones are Param nodes, const ones are folded", "[frontend]") {
  const Mod m = score("score * scale + float(window) + cap + float(n)");
  int params = 0;
  for (const Node& n : m.graph.nodes())
    if (n.op == Op::Param) {
      ++params;
      CHECK((n.slot == 0 || n.slot == 1));
      CHECK(n.type == (n.slot == 0 ? Type::Int : Type::Float));
    }
  CHECK(params == 2);
  CHECK(text(m) == "score * scale + float(window) + 30.0 + float(7)");
  // A const int param whose value is not an int32 is an error where it is used.
  CHECK_THAT(error_of(ModKind::Mask, "q_idx < half"),
             Catch::Contains("const param 'half' has the value 2.5, which is not an int32"));
  // Division by a const param that is 0 is division by a constant zero.
  CHECK_THAT(error_of(ModKind::Mask, "q_idx % zero == 0"), Catch::Contains("modulo by zero"));
  CHECK_THAT(error_of(ModKind::Score, "score / float(zero)"), Catch::Contains("division by zero"));
}

TEST_CASE("captures: element types per dtype, source ranges on nodes", "[frontend]") {
  const Mod m = score("score + bias[h, 1] + table[0, 0, 0] + float(doc[kv_idx]) + float(flags[q_idx])");
  std::vector<std::pair<uint16_t, Type>> loads;
  for (const Node& n : m.graph.nodes())
    if (n.op == Op::Load) loads.push_back({n.slot, n.type});
  const std::vector<std::pair<uint16_t, Type>> expected = {
      {0, Type::Float}, {3, Type::Float}, {1, Type::Int}, {2, Type::Bool}};
  CHECK(loads == expected);

  const std::string src = "score / (float(q_idx) - 3.0)";
  const Mod d = score(src);
  const Node& div = d.graph[d.graph.root];
  REQUIRE(div.op == Op::Div);
  CHECK(src.substr(div.src.begin, div.src.end - div.src.begin) == src);
  const Node& sub = d.graph[div.args[1]];
  CHECK(src.substr(sub.src.begin, sub.src.end - sub.src.begin) == "(float(q_idx) - 3.0)");
}

TEST_CASE("random well-typed sources build exactly the expected graph and round-trip", "[frontend]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 seeds(seed);
  for (int i = 0; i < 1500; ++i) {
    const bool is_score = i % 2 == 0;
    RandomSource gen(seeds(), is_score);
    Graph expected;
    const std::string src = gen.mod(expected, is_score ? Type::Float : Type::Bool);
    INFO(src);
    const ModKind kind = is_score ? ModKind::Score : ModKind::Mask;
    Mod m = parse(kind, src);
    INFO(text(m) << "\nexpected: " << to_text(expected, expected.root, test_decls()));
    REQUIRE(same_graph(m.graph, expected));
    // Printed text re-parses to the same graph, and printing is a fixpoint.
    const std::string printed = text(m);
    INFO(printed);
    const Mod again = parse(kind, printed);
    REQUIRE(same_graph(again.graph, m.graph));
    REQUIRE(text(again) == printed);
  }
}

// ---------------------------------------------------------------------------------------------
// Diagnostics

TEST_CASE("golden diagnostics", "[frontend]") {
  const Case cases[] = {
      {ModKind::Score, "score + q_id",
       "score_mod:1:9: error: unknown name 'q_id'\n"
       "  score + q_id\n"
       "          ^~~~\n"
       "hint: did you mean 'q_idx'?"},
      {ModKind::Score, "clamp(score, 0)",
       "score_mod:1:1: error: 'clamp' takes 3 arguments, got 2\n"
       "  clamp(score, 0)\n"
       "  ^~~~~~~~~~~~~~~"},
      {ModKind::Score, "score + bias[h]",
       "score_mod:1:9: error: captured tensor 'bias' has 2 dimensions, got 1 index\n"
       "  score + bias[h]\n"
       "          ^~~~~~~\n"
       "hint: 'bias' is declared as float32[H, 8192]"},
      {ModKind::Score, "score + bias[h, 0.5]",
       "score_mod:1:17: error: index 2 of 'bias' must be int, got float\n"
       "  score + bias[h, 0.5]\n"
       "                  ^~~\n"
       "hint: write int(...), which truncates toward zero"},
      {ModKind::Mask, "q_idx[0] > 1",
       "mask_mod:1:1: error: 'q_idx' is not a captured tensor and cannot be indexed\n"
       "  q_idx[0] > 1\n"
       "  ^~~~~"},
      {ModKind::Score, "score * bias",
       "score_mod:1:9: error: captured tensor 'bias' must be indexed with 2 indices\n"
       "  score * bias\n"
       "          ^~~~\n"
       "hint: 'bias' is declared as float32[H, 8192]"},
      {ModKind::Score, "score + (q_idx > kv_idx)",
       "score_mod:1:1: error: invalid operands to '+': float and bool\n"
       "  score + (q_idx > kv_idx)\n"
       "  ^~~~~~~~~~~~~~~~~~~~~~~~\n"
       "hint: arithmetic needs numbers: convert a bool with int(...), or choose with where(...)"},
      {ModKind::Mask, "q_idx - kv_idx",
       "mask_mod:1:1: error: mask_mod must be bool, got int\n"
       "  q_idx - kv_idx\n"
       "  ^~~~~~~~~~~~~~\n"
       "hint: a mask_mod says which scores to keep: write a comparison, e.g. q_idx >= kv_idx"},
      {ModKind::Score, "q_idx - kv_idx",
       "score_mod:1:1: error: score_mod must be float, got int\n"
       "  q_idx - kv_idx\n"
       "  ^~~~~~~~~~~~~~\n"
       "hint: write float(...)"},
      {ModKind::Mask, "score > 0",
       "mask_mod:1:1: error: `score` is only visible in score_mod\n"
       "  score > 0\n"
       "  ^~~~~\n"
       "hint: a mask_mod decides from b, h, q_idx, kv_idx, q_len and kv_len"},
      {ModKind::Mask, "q_idx // zero >= 0",
       "mask_mod:1:10: error: floor division by zero\n"
       "  q_idx // zero >= 0\n"
       "           ^~~~\n"
       "hint: the const param 'zero' is 0"},
      {ModKind::Score, "score / 0",
       "score_mod:1:9: error: division by zero\n"
       "  score / 0\n"
       "          ^"},
      {ModKind::Score, "(score + 1\n  * 2",
       "score_mod:2:6: error: expected ')'\n"
       "    * 2\n"
       "       ^\n"
       "score_mod:1:1: note: to match this '('\n"
       "  (score + 1\n"
       "  ^"},
      {ModKind::Score, "score + $x",
       "score_mod:1:9: error: invalid character '$'\n"
       "  score + $x\n"
       "          ^"},
      {ModKind::Score, "score * 1.5f",
       "score_mod:1:9: error: invalid number '1.5f'\n"
       "  score * 1.5f\n"
       "          ^~~~\n"
       "hint: write 1.5 (literals need no suffix)"},
      {ModKind::Mask, "true + 1 > 0",
       "mask_mod:1:1: error: invalid operands to '+': bool and int\n"
       "  true + 1 > 0\n"
       "  ^~~~~~~~\n"
       "hint: arithmetic needs numbers: convert a bool with int(...), or choose with where(...)"},
      {ModKind::Mask, "let d = q_idx - kv_idx;\nlet d = 2;\nd >= 0",
       "mask_mod:2:5: error: redefinition of 'd'\n"
       "  let d = 2;\n"
       "      ^\n"
       "mask_mod:1:5: note: previous definition is here\n"
       "  let d = q_idx - kv_idx;\n"
       "      ^"},
      {ModKind::Score, "score + exp",
       "score_mod:1:9: error: 'exp' is a built-in function; call it as exp(...)\n"
       "  score + exp\n"
       "          ^~~"},
      {ModKind::Mask, "let w = window\nq_idx - kv_idx < w",
       "mask_mod:1:15: error: expected ';' after the let binding\n"
       "  let w = window\n"
       "                ^"},
      {ModKind::Mask, "q_idx >= kv_idx &&\n\tq_idx - kv_idx < 3000000000",
       "mask_mod:2:19: error: integer literal '3000000000' is out of the int32 range\n"
       "  \tq_idx - kv_idx < 3000000000\n"
       "  \t                 ^~~~~~~~~~\n"
       "hint: write 3000000000.0 for a float"},
      {ModKind::Mask, "q_idx & 1 == 1",
       "mask_mod:1:1: error: invalid operands to '&': int and bool\n"
       "  q_idx & 1 == 1\n"
       "  ^~~~~~~~~~~~~~\n"
       "hint: '&' binds more loosely than comparisons, as in C: write (x & 1) == 1"},
      {ModKind::Mask, "q_idx < kv_idx < 3",
       "mask_mod:1:1: error: invalid operands to '<': bool and int\n"
       "  q_idx < kv_idx < 3\n"
       "  ^~~~~~~~~~~~~~~~~~\n"
       "hint: comparisons do not chain: write a < b && b < c"},
      {ModKind::Mask, "let a = a + 1; a > 0",
       "mask_mod:1:9: error: 'a' is used in its own definition\n"
       "  let a = a + 1; a > 0\n"
       "          ^"},
      {ModKind::Mask, "let q_idx = 3; true",
       "mask_mod:1:5: error: 'q_idx' is a built-in input and cannot be redefined\n"
       "  let q_idx = 3; true\n"
       "      ^~~~~\n"
       "hint: choose another name for the let binding"},
      {ModKind::Mask, "where(q_idx, true, false)",
       "mask_mod:1:7: error: the condition of 'where' must be bool, got int\n"
       "  where(q_idx, true, false)\n"
       "        ^~~~~\n"
       "hint: compare it, e.g. x != 0"},
      {ModKind::Mask, "x = 3; true",
       "mask_mod:1:3: error: unexpected '=' after the expression\n"
       "  x = 3; true\n"
       "    ^\n"
       "hint: write 'let x = ...;' to bind a name, or '==' to compare"},
      {ModKind::Mask, "",
       "mask_mod:1:1: error: expected an expression\n"
       "  \n"
       "  ^"},
      {ModKind::Score, "score ** 2",
       "score_mod:1:7: error: unexpected '**' after the expression\n"
       "  score ** 2\n"
       "        ^~\n"
       "hint: write pow(a, b)"},
      {ModKind::Mask, "Doc[q_idx] == 1",
       "mask_mod:1:1: error: unknown captured tensor 'Doc'\n"
       "  Doc[q_idx] == 1\n"
       "  ^~~\n"
       "hint: did you mean 'doc'?"},
      {ModKind::Mask, "q_idx >= kv_idx\n  && sqr(q_idx) > 0",
       "mask_mod:2:6: error: unknown function 'sqr'\n"
       "    && sqr(q_idx) > 0\n"
       "       ^~~\n"
       "hint: did you mean 'sqrt'?"},
  };
  for (const Case& c : cases) {
    INFO(c.src);
    CHECK(error_of(c.kind, c.src) == c.expected);
  }
}

TEST_CASE("several errors are reported in one throw, without cascades", "[frontend]") {
  const std::string src = "let a = q_id + 1;\nlet c = bias[h];\nscore + float(a) + exp(true) + c + nope";
  try {
    score(src);
    FAIL("no error");
  } catch (const DslError& e) {
    const auto& ds = e.diagnostics();
    REQUIRE(ds.size() == 4);
    CHECK(ds[0].message == "unknown name 'q_id'");
    CHECK(ds[1].message == "captured tensor 'bias' has 2 dimensions, got 1 index");
    CHECK(ds[2].message == "argument 1 of 'exp' must be a number, got bool");
    CHECK(ds[3].message == "unknown name 'nope'");
    // The uses of `a` and `c` (whose definitions failed) report nothing more.
    CHECK(e.source() == src);
    CHECK(e.origin() == "score_mod");
    CHECK(std::string(e.what()) == render_all(ds, src, "score_mod"));
    CHECK_THAT(e.what(), Catch::Contains("score_mod:3:36: error: unknown name 'nope'"));
  }
  // Syntax errors in several statements are all found.
  try {
    mask("let x = ;\nlet y = (1 + ;\nq_idx >= kv_idx");
    FAIL("no error");
  } catch (const DslError& e) {
    REQUIRE(e.diagnostics().size() == 2);
    CHECK(e.diagnostics()[0].message == "expected an expression");
    CHECK(line_col(e.source(), e.diagnostics()[1].range.begin).line == 2);
  }
  // At most max_errors are reported.
  Limits few;
  few.max_errors = 3;
  try {
    parse(ModKind::Mask, "a1 + a2 + a3 + a4 + a5 + a6 > 0", few);
    FAIL("no error");
  } catch (const DslError& e) {
    CHECK(e.diagnostics().size() == 3);
  }
}

TEST_CASE("did-you-mean covers every visible name", "[frontend]") {
  CHECK_THAT(error_of(ModKind::Mask, "kv_idz < q_idx"), Catch::Contains("did you mean 'kv_idx'?"));
  CHECK_THAT(error_of(ModKind::Mask, "q_idx < windw"), Catch::Contains("did you mean 'window'?"));
  CHECK_THAT(error_of(ModKind::Mask, "let dist = q_idx - kv_idx; dsit < 3"),
             Catch::Contains("did you mean 'dist'?"));
  CHECK_THAT(error_of(ModKind::Mask, "True"), Catch::Contains("did you mean 'true'?"));
  CHECK_THAT(error_of(ModKind::Score, "scroe"), Catch::Contains("did you mean 'score'?"));
  CHECK_THAT(error_of(ModKind::Score, "score + clmp"), Catch::Contains("did you mean 'clamp'?"));
  // `score` is not visible in a mask_mod, so it is not suggested there.
  CHECK_THAT(error_of(ModKind::Mask, "scroe > 0"), !Catch::Contains("did you mean"));
  // Nothing close: no suggestion.
  CHECK_THAT(error_of(ModKind::Mask, "zzzzzz > 0"), !Catch::Contains("did you mean"));
  CHECK_THAT(error_of(ModKind::Mask, "x > 0"), !Catch::Contains("did you mean"));
}

TEST_CASE("type rules", "[frontend]") {
  check_errors({
      {"!q_idx", "invalid operand to '!': int"},
      {"not 1.5 == 0.0", "invalid operand to 'not': float"},
      {"~true", "invalid operand to '~': bool"},
      {"float(~1.5) > 0", "invalid operand to '~': float"},
      {"-true", "invalid operand to '-': bool"},
      {"q_idx && kv_idx", "invalid operands to '&&': int and int"},
      {"q_idx > 0 or 1", "invalid operands to 'or': bool and int"},
      {"1.5 & 2.5 > 0", "invalid operands to '&': float and bool"},
      {"int(1.5 | 2.5) > 0", "invalid operands to '|': float and float"},
      {"1.5 << 2 == 0", "invalid operands to '<<': float and int"},
      {"true < false", "invalid operands to '<': bool and bool"},
      {"true == 1", "invalid operands to '==': bool and int"},
      {"q_idx > 0 ? 1 : true", "the alternatives of '?:' have different types: int and bool"},
      {"1 ? true : false", "the condition of '?:' must be bool, got int"},
      {"where(true, 1, false)", "the alternatives of 'where' have different types: int and bool"},
      {"exp(true) > 0", "argument 1 of 'exp' must be a number, got bool"},
      {"min(1, true) > 0", "argument 2 of 'min' must be a number, got bool"},
      {"abs(false) > 0", "argument 1 of 'abs' must be a number, got bool"},
      {"floor(true) > 0", "argument 1 of 'floor' must be a number, got bool"},
      {"pow(2, true) > 0", "argument 2 of 'pow' must be a number, got bool"},
      {"doc[true] > 0", "index 1 of 'doc' must be int, got bool"},
      {"exp(1, 2) > 0", "'exp' takes 1 argument, got 2"},
      {"where(true, 1) > 0", "'where' takes 3 arguments, got 2"},
      {"int() > 0", "'int' takes 1 argument, got 0"},
      {"q_idx(1) > 0", "'q_idx' is not a function"},
      {"doc(1) > 0", "'doc' is a captured tensor, not a function"},
      {"exp[1] > 0", "'exp' is a built-in function; call it as exp(...)"},
      {"window[1] > 0", "'window' is not a captured tensor and cannot be indexed"},
      {"table[1, 2] > 0", "captured tensor 'table' has 3 dimensions, got 2 indices"},
      {"let exp = 1; true", "'exp' is a built-in function and cannot be redefined"},
      {"let window = 1; true", "'window' is a declared param and cannot be redefined"},
      {"let doc = 1; true", "'doc' is a declared captured tensor and cannot be redefined"},
      {"let score = 1; true", "'score' is a built-in input and cannot be redefined"},
      {"q_idx / 0.0 > 0", "division by zero"},
      {"q_idx / -0.0 > 0", "division by zero"},
      {"let z = 0; q_idx % z == 0", "modulo by zero"},
      // Divisors that fold to zero (found by fuzz_parser: their normalized text did not parse).
      {"q_idx % ~~0 < 1", "modulo by zero"},
      {"q_idx // (3 - 3) < 1", "floor division by zero"},
      {"q_idx / (1.0 - 1.0) < 1", "division by zero"},
  });
  // Mixed int / float arithmetic promotes; `/` is float even of ints; int() and float() convert.
  CHECK(mask("q_idx + 0.5 > kv_idx").graph.size() > 0);
  CHECK(mask("q_idx / 2 == 0.5").graph.size() > 0);
  CHECK(mask("where(q_idx > 0, 1, 2.5) > 0").graph.size() > 0);
  CHECK(mask("int(1.5) + int(true) + q_idx // 2 > 0").graph.size() > 0);
  CHECK(score("where(true, score, 1)").graph.size() > 0);
  CHECK(mask("(q_idx > 0) == (kv_idx > 0) != true").graph.size() > 0);
  CHECK(mask("(q_idx > 0) ^ (kv_idx > 0)").graph.size() > 0);
  // A bool score_mod gets a hint toward masking.
  CHECK_THAT(error_of(ModKind::Score, "q_idx > kv_idx"),
             Catch::Contains("score_mod must be float, got bool"));
}

TEST_CASE("lexical errors", "[frontend]") {
  check_errors({
      {"0x10 > q_idx", "invalid number '0x10'"},
      {"007 == q_idx", "invalid number '007': leading zeros are not allowed"},
      {"1e > 0", "invalid number '1e'"},
      {"1.2.3 > 0", "invalid number '1.2.3'"},
      {"1e39 > 0", "float literal '1e39' is out of range"},
      {"3.4028236e38 > 0", "float literal '3.4028236e38' is out of range"},
      {"1e400 > 0", "float literal '1e400' is out of range"},
      {"q_idx @ 2", "invalid character '@'"},
      {"q_idx > 'a'", "invalid character '''"},
      {"q_idx > \"a\"", "invalid character '\"'"},
      {"q_idx > 1 \\\n && true", "invalid character '\\'"},
      {"q_idx.x > 1", "invalid character '.'"},
      {"q_idx > 1 {}", "invalid character '{'"},
  });
  // numpy's float32 max (3.4028235e38, above FLT_MAX as a double) rounds to it: accepted.
  CHECK(score("min(score, 3.4028235e38)").graph.size() > 0);
  // 1e-400 underflows to zero, like float32 would.
  CHECK(text(score("score + 1e-400")) == "score + 0.0");
  CHECK(text(score("score * 3.4e38")) == "score * 3.4e+38");
}

// ---------------------------------------------------------------------------------------------
// Limits and hostile input

TEST_CASE("limits give clean errors, never a stack overflow", "[frontend]") {
  Limits big;
  big.max_source_bytes = 4 << 20;
  const std::string deep_parens = std::string(100000, '(') + "score" + std::string(100000, ')');
  CHECK_THAT(error_of(ModKind::Score, deep_parens, big),
             Catch::Contains("error: expression is nested too deeply (more than 256 levels)"));
  CHECK_THAT(error_of(ModKind::Score, deep_parens), Catch::Contains("the source is too large: 200005 bytes"));
  std::string unary(100000, '-');
  CHECK_THAT(error_of(ModKind::Score, unary + "score", big), Catch::Contains("nested too deeply"));
  std::string nots;
  for (int i = 0; i < 100000; ++i) nots += "not ";
  CHECK_THAT(error_of(ModKind::Mask, nots + "true", big), Catch::Contains("nested too deeply"));
  std::string ternary;
  for (int i = 0; i < 100000; ++i) ternary += "true ? ";
  CHECK_THAT(error_of(ModKind::Mask, ternary, big), Catch::Contains("nested too deeply"));
  std::string calls;
  for (int i = 0; i < 100000; ++i) calls += "exp(";
  CHECK_THAT(error_of(ModKind::Score, calls, big), Catch::Contains("nested too deeply"));
  std::string indices;
  for (int i = 0; i < 100000; ++i) indices += "doc[";
  CHECK_THAT(error_of(ModKind::Mask, indices, big), Catch::Contains("nested too deeply"));

  // Nesting exactly at the limit is fine; one more level is not.
  Limits shallow;
  shallow.max_depth = 8;
  CHECK(parse(ModKind::Score, "((((((((score))))))))", shallow).graph.size() == 1);
  CHECK_THAT(error_of(ModKind::Score, "(((((((((score)))))))))", shallow), Catch::Contains("nested too deeply"));
  // A long flat chain is deep in the IR: bounded too (the printer and passes recurse on it).
  std::string chain = "score";
  for (int i = 0; i < 300; ++i) chain += " + score";
  CHECK_THAT(error_of(ModKind::Score, chain), Catch::Contains("nested too deeply"));
  std::string ok_chain = "score";
  for (int i = 0; i < 200; ++i) ok_chain += " + score";
  CHECK(score(ok_chain).graph.size() == 201);

  // Node count.
  Limits few_nodes;
  few_nodes.max_nodes = 10;
  CHECK_THAT(error_of(ModKind::Score, "score + float(q_idx + kv_idx + b + h + q_len + kv_len)", few_nodes),
             Catch::Contains("expression is too large (more than 10 nodes)"));
  // Lets that double the expanded size per line.
  std::string doubling = "let a0 = q_idx;\n";
  for (int i = 1; i < 40; ++i)
    doubling += "let a" + std::to_string(i) + " = a" + std::to_string(i - 1) + " + a" +
                std::to_string(i - 1) + ";\n";
  doubling += "q_idx > a39";
  CHECK_THAT(error_of(ModKind::Mask, doubling), Catch::Contains("too large with its let bindings expanded"));
  // Source size.
  Limits tiny;
  tiny.max_source_bytes = 10;
  CHECK(error_of(ModKind::Mask, "q_idx >= kv_idx", tiny) ==
        "mask_mod:1:1: error: the source is too large: 15 bytes (the limit is 10)\n"
        "  q_idx >= kv_idx\n"
        "  ^");
}

TEST_CASE("hostile input gives clean errors", "[frontend]") {
  // Identifiers that mean something to CUDA or C are plain unknown names here.
  for (const char* name : {"__global__", "asm", "printf", "__syncthreads", "threadIdx", "main", "include"}) {
    INFO(name);
    CHECK_THAT(error_of(ModKind::Score, std::string("score + ") + name),
               Catch::Contains(std::string("unknown name '") + name + "'"));
    CHECK_THAT(error_of(ModKind::Score, std::string("score + ") + name + "(1)"),
               Catch::Contains(std::string("unknown function '") + name + "'"));
  }
  CHECK_THAT(error_of(ModKind::Score, "score */ 2"), Catch::Contains("expected an expression"));
  CHECK_THAT(error_of(ModKind::Score, "score /* x */"), Catch::Contains("expected an expression"));
  CHECK_THAT(error_of(ModKind::Score, "score; } __global__ void f() {"),
             Catch::Contains("invalid character '}'"));
  // `#` starts a comment: an #include line is a comment and leaves nothing behind.
  CHECK(text(score("#include <stdio.h>\nscore")) == "score");
  CHECK_THAT(error_of(ModKind::Score, "#include <stdio.h>"), Catch::Contains("expected an expression"));
  // NUL bytes, control characters and bytes that are not UTF-8 are shown as '?'.
  const std::string nul("score + \0 1.0", 13);
  CHECK(error_of(ModKind::Score, nul) ==
        "score_mod:1:9: error: invalid character U+0000\n"
        "  score + ? 1.0\n"
        "          ^");
  CHECK(error_of(ModKind::Score, "score \x01\x02\x7f") ==
        "score_mod:1:7: error: invalid character U+0001\n"
        "  score ???\n"
        "        ^~~");
  CHECK(error_of(ModKind::Score, "score + \xff\xfe") ==
        "score_mod:1:9: error: invalid byte 0xFF (the source is not UTF-8)\n"
        "  score + ??\n"
        "          ^~");
  // Non-ASCII: columns count bytes, the caret lines up with the characters.
  CHECK(error_of(ModKind::Score, "score * \xce\xbb + \xc3\xa9") ==
        "score_mod:1:9: error: invalid character U+03BB: only ASCII is allowed outside comments\n"
        "  score * \xce\xbb + \xc3\xa9\n"
        "          ^\n"
        "score_mod:1:14: error: invalid character U+00E9: only ASCII is allowed outside comments\n"
        "  score * \xce\xbb + \xc3\xa9\n"
        "              ^");
  CHECK_THAT(error_of(ModKind::Score, "# \xce\xbb comment \xff\nscore + q_id"),
             Catch::Contains("score_mod:2:9: error: unknown name 'q_id'"));
  // A huge identifier is clipped in the message and the line is shown as a window.
  const std::string huge_name(60000, 'x');
  const std::string msg = error_of(ModKind::Score, "score + " + huge_name);
  CHECK_THAT(msg, Catch::Contains("unknown name 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx...'"));
  CHECK(msg.size() < 400);
  // Huge inputs of every kind stay clean and bounded.
  for (const std::string& s : {std::string(65536, '('), std::string(65536, ')'), std::string(65536, '-'),
                               std::string(65536, '\0'), std::string(65536, '\xff'), std::string(65536, '9'),
                               std::string(65536, ' '), std::string(65536, '\n'), std::string(65537, 'a')}) {
    const std::string e = error_of(ModKind::Score, s);
    CHECK_THAT(e, Catch::StartsWith("score_mod:"));
    CHECK(e.size() < 2000);
  }
}

TEST_CASE("random byte strings never crash the front end", "[frontend]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  static const std::vector<std::string> pieces = {
      "score", "q_idx", "kv_idx", "b", "h", "doc", "bias", "window", "cap", "let", "x", "=", ";", "(",
      ")", "[", "]", ",", "?", ":", "+", "-", "*", "/", "//", "%", "<<", ">>", "<", "<=", "==", "!=",
      "&", "|", "^", "&&", "||", "!", "~", "and", "or", "not", "1", "0", "2147483648", "1.5", "1e",
      ".5", "inf", "nan", "true", "where", "exp", "int", "float", "clamp", " ", "\n", "#", "\xce\xbb",
      "\xff", std::string(1, '\0'), "$", "\\"};
  int parsed = 0;
  for (int i = 0; i < 20000; ++i) {
    std::string src;
    const int n = std::uniform_int_distribution<int>(0, 30)(rng);
    for (int k = 0; k < n; ++k)
      src += pieces[std::uniform_int_distribution<size_t>(0, pieces.size() - 1)(rng)] +
             (rng() % 2 ? " " : "");
    for (ModKind kind : {ModKind::Score, ModKind::Mask}) {
      try {
        const Mod m = parse(kind, src);
        ++parsed;
        // Whatever parses prints to text that parses to the same graph.
        const Mod again = parse(kind, text(m));
        REQUIRE(same_graph(again.graph, m.graph));
      } catch (const DslError& e) {
        REQUIRE(!e.diagnostics().empty());
        for (const Diagnostic& d : e.diagnostics()) REQUIRE(d.range.end <= src.size());
      }
    }
  }
  CHECK(parsed > 0);
}

// ---------------------------------------------------------------------------------------------
// Names, rendering, suggestions

TEST_CASE("reserved names and identifiers", "[frontend]") {
  for (const char* r : {"score", "b", "h", "q_idx", "kv_idx", "q_len", "kv_len", "min", "where",
                        "float", "int", "sigmoid", "let", "true", "false", "inf", "nan", "and", "or", "not"})
    CHECK(is_reserved_name(r));
  for (const char* r : {"bias", "window", "x", "Score", "sqr", "_"}) CHECK_FALSE(is_reserved_name(r));
  for (const char* id : {"a", "_", "_x1", "bias_2", "Q"}) CHECK(is_identifier(id));
  for (const char* id : {"", "1a", "a-b", "a b", "a.b", "\xce\xbb", "a$"}) CHECK_FALSE(is_identifier(id));
}

TEST_CASE("line_col and render", "[frontend]") {
  const std::string src = "ab\ncd\n\nef";
  CHECK(line_col(src, 0).line == 1);
  CHECK(line_col(src, 4).line == 2);
  CHECK(line_col(src, 4).col == 2);
  CHECK(line_col(src, 7).line == 4);
  CHECK(line_col(src, 7).col == 1);
  CHECK(line_col(src, 1000).line == 4);  // clamped to the end
  CHECK(line_col(src, 1000).col == 3);

  // A range that runs onto the next line is underlined to the end of its first line.
  Diagnostic d{Severity::Warning, {1, 5}, "spans lines", ""};
  CHECK(render(d, src, "") == "1:2: warning: spans lines\n  ab\n   ^");
  // An empty range at the end of the source.
  Diagnostic e{Severity::Error, {10, 10}, "at the end", "h"};
  CHECK(render(e, src, "o") == "o:4:3: error: at the end\n  ef\n    ^\nhint: h");

  // A long line is shown as a window around the caret.
  std::string line;
  for (int i = 0; i < 30; ++i) line += "abcdefghij";
  Diagnostic w{Severity::Note, {150, 153}, "here", ""};
  const std::string r = render(w, line, "x");
  const std::string expected_text = "  ..." + line.substr(110, 100) + "...";
  const std::string expected_marks = "     " + std::string(40, ' ') + "^~~";
  CHECK(r == "x:1:151: note: here\n" + expected_text + "\n" + expected_marks);
  // Near the start of a long line, no leading "...".
  Diagnostic s{Severity::Error, {2, 3}, "m", ""};
  CHECK(render(s, line, "x") == "x:1:3: error: m\n  " + line.substr(0, 100) + "...\n    ^");
}

TEST_CASE("closest_name", "[frontend]") {
  const std::vector<std::string> names = {"q_idx", "kv_idx", "score", "window", "b", "h"};
  CHECK(closest_name("q_id", names) == "q_idx");
  CHECK(closest_name("qidx", names) == "q_idx");
  CHECK(closest_name("kvidx", names) == "kv_idx");
  CHECK(closest_name("socre", names) == "score");  // a transposition is one edit
  CHECK(closest_name("SCORE", names) == "score");  // case is ignored
  CHECK(closest_name("x", names).empty());
  CHECK(closest_name("window", names).empty());    // itself is no suggestion
  CHECK(closest_name("completely_else", names).empty());
  CHECK(closest_name("q", {}).empty());
}
