#include "dsl/emit_cuda.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <optional>
#include <set>
#include <stdexcept>
#include <vector>

#include "dsl/analysis.h"

namespace flexc::dsl {

namespace {

// Mirrors FLEXC_MAX_CAPTURES / FLEXC_MAX_PARAMS in templates/flexc_hooks.cuh.
constexpr size_t kMaxCaptures = 8, kMaxParams = 16;

const char* c_type(Type t) {
  switch (t) {
    case Type::Bool:
      return "bool";
    case Type::Int:
      return "int";
    case Type::Float:
      return "float";
  }
  return "?";
}

// An exact float32 literal: `%.9g` round-trips every float; inf and NaN by their bits.
std::string float_literal(double v) {
  const float f = static_cast<float>(v);
  if (std::isnan(f)) return "__int_as_float(0x7fffffff)";
  if (std::isinf(f)) return f > 0 ? "__int_as_float(0x7f800000)" : "__int_as_float(0xff800000)";
  std::string s = fmt::format("{:.9g}", f);
  if (s.find_first_of(".e") == std::string::npos) s += ".0";
  s += "f";
  return s[0] == '-' ? "(" + s + ")" : s;
}

std::string int_literal(int64_t v) {
  const auto i = static_cast<int32_t>(v);  // the IR's ints are int32
  if (i == INT32_MIN) return "(-2147483647 - 1)";
  return i < 0 ? fmt::format("({})", i) : fmt::format("{}", i);
}

const char* load_helper(DType d) {
  switch (d) {
    case DType::I32:
      return "flexc_load_i32";
    case DType::F32:
      return "flexc_load_f32";
    case DType::BF16:
      return "flexc_load_bf16";
    case DType::F16:
      return "flexc_load_f16";
    case DType::Bool:
      return "flexc_load_bool";
  }
  return "?";
}

// Whether hook input `i` lies in [0, dim) whenever a hook runs: the inputs bounded by the lengths
// of the hooks' contract (templates/flexc_hooks.cuh), each against the dim naming that length.
bool in_range(Input i, const Dim& dim) {
  switch (dim.kind) {
    case Dim::B:
      return i == Input::B;
    case Dim::H:
      return i == Input::H;
    case Dim::QLen:
      return i == Input::QIdx;
    case Dim::KvLen:
      return i == Input::KvIdx;
    case Dim::Fixed:
      break;
  }
  return false;
}

// Ops whose result is discrete from its operands' values: fast float math leaves those operands
// (and what they are computed from) as written (docs/dsl.md, "Precision").
bool decides_discrete(Op op) {
  switch (op) {
    case Op::ToInt:
    case Op::Floor:
    case Op::Ceil:
    case Op::Sign:
    case Op::FloorDiv:
    case Op::Mod:
    case Op::Lt:
    case Op::Le:
    case Op::Gt:
    case Op::Ge:
    case Op::Eq:
    case Op::Ne:
      return true;
    default:
      return false;
  }
}

// Writes the body of one hook: an SSA statement per needed node, in id order (so every operand is
// defined before its use). Inputs and constants are used in place.
class BodyWriter {
 public:
  BodyWriter(const Graph& g, const Decls& decls, std::string_view marker, FloatMath math)
      : g_(g),
        decls_(decls),
        marker_(marker),
        fast_(math != FloatMath::Exact),
        approx_(math == FloatMath::Approx),
        value_(g.size(), 0),
        offset_(g.size(), 0) {}

  // Asks for `id`'s value; write() adds whatever it reads.
  void need_value(NodeId id) { value_[id] = 1; }
  // Asks for the element offset of Load `id` (its indices, not its value).
  void need_offset(NodeId id) { offset_[id] = 1; }
  // Capture loads as ordinary loads, which the compiler keeps in place (flexc_hooks.cuh).
  void plain_loads() { plain_ = true; }
  // Decides fast math's exact nodes as the hook computing `root` does (a part of it written
  // alone, the relative terms, must round as it does there).
  void exact_as_in(NodeId root) { context_ = reachable(g_, root); }
  // Fast tanh through the hook's `tanh_form` argument (a FlexcTanh* of flexc_hooks.cuh), which
  // the kernels choose per warp and tile.
  void tanh_forms() { tanh_forms_ = true; }
  // Takes `id`'s value from the C++ expression `value` instead of computing it (a capture load
  // the kernel made ahead of time): nothing it reads is computed for it.
  void substitute(NodeId id, std::string value) {
    if (subst_.empty()) subst_.resize(g_.size());
    subst_[id] = std::move(value);
  }

  std::string write() {
    // What the caller reads after the body (ref(id), o<id>).
    std::vector<std::string> roots;
    for (NodeId id = 0; id < g_.size(); ++id) {
      if (value_[id]) roots.push_back(ref(id));
      if (offset_[id]) roots.push_back(fmt::format("o{}", id));
    }
    for (NodeId id = static_cast<NodeId>(g_.size()); id-- > 0;) {
      if (!value_[id] && !offset_[id]) continue;
      if (substituted(id)) continue;
      const Node& n = g_[id];
      if (n.op == Op::Load) offset_[id] = 1;
      for (NodeId a : n.operands()) value_[a] = 1;
    }
    if (fast_) {
      mark_exact();
      mark_uniform();
    }
    std::string out;
    for (NodeId id = 0; id < g_.size(); ++id) {
      const Node& n = g_[id];
      if (n.op == Op::Const || n.op == Op::Input) continue;
      if (substituted(id)) {
        if (value_[id]) statement(out, n, c_type(n.type), ref(id), subst_[id]);
        continue;
      }
      if (offset_[id]) statement(out, n, "long long", fmt::format("o{}", id), offset_expr(n));
      if (!value_[id]) continue;
      std::string init = folds(id) ? fast_value(n, id, out) : std::string();
      statement(out, n, c_type(n.type), ref(id), init.empty() ? expr(n, id) : init);
    }
    return live_statements(out, roots);
  }

  std::string ref(NodeId id) const {
    const Node& n = g_[id];
    if (n.op == Op::Const) {
      if (n.type == Type::Bool) return n.ival ? "true" : "false";
      return n.type == Type::Int ? int_literal(n.ival) : float_literal(n.fval);
    }
    if (n.op == Op::Input) return std::string(input_name(n.input));
    return fmt::format("t{}", id);
  }

 private:
  bool substituted(NodeId id) const { return !subst_.empty() && !subst_[id].empty(); }

  // The statements of `body` ("    const T name = init;" lines) that `roots` read, directly or
  // through others: values that fast_value folded into their users are left out (written, they
  // would be dead code, and NVRTC warns of each).
  static std::string live_statements(const std::string& body,
                                     const std::vector<std::string>& roots) {
    std::vector<std::string_view> lines;
    for (size_t at = 0; at < body.size();) {
      const size_t nl = body.find('\n', at);
      lines.push_back(std::string_view(body).substr(at, nl + 1 - at));
      at = nl + 1;
    }
    std::set<std::string_view, std::less<>> used(roots.begin(), roots.end());
    std::vector<char> keep(lines.size(), 0);
    for (size_t i = lines.size(); i-- > 0;) {
      const std::string_view line = lines[i];
      const size_t eq = line.find(" = ");
      const std::string_view name =
          line.substr(line.rfind(' ', eq - 1) + 1, eq - line.rfind(' ', eq - 1) - 1);
      if (!used.count(name)) continue;
      keep[i] = 1;
      const std::string_view init = line.substr(eq + 3, line.find(';', eq) - eq - 3);
      for (size_t k = 0; k < init.size();) {
        const auto ident = [&](size_t j, bool first) {
          const unsigned char c = static_cast<unsigned char>(init[j]);
          return std::isalpha(c) || c == '_' || (!first && std::isdigit(c));
        };
        if (!ident(k, true) || (k > 0 && ident(k - 1, false))) {
          ++k;
          continue;
        }
        size_t e = k;
        while (e < init.size() && ident(e, false)) ++e;
        used.insert(init.substr(k, e - k));
        k = e;
      }
    }
    std::string out;
    for (size_t i = 0; i < lines.size(); ++i)
      if (keep[i]) out += lines[i];
    return out;
  }

  void statement(std::string& out, const Node& n, std::string_view type, std::string_view name,
                 std::string_view init) const {
    out += fmt::format("    const {} {} = {};", type, name, init);
    if (!n.src.empty()) out += fmt::format("  // @{}:{}:{}", marker_, n.src.begin, n.src.end);
    out += '\n';
  }

  // Fast math must never change a discrete outcome: a float that reaches int(), floor, ceil,
  // sign, a comparison or a floored float op (a bucket, an index, a branch; e.g. t5_bias's
  // int(2 * log2(n / 8))) is computed exactly, and so is everything it is computed from. Run once
  // the needed nodes are known.
  void mark_exact() {
    exact_.assign(g_.size(), 0);
    for (NodeId id = static_cast<NodeId>(g_.size()); id-- > 0;) {
      const Node& n = g_[id];
      const bool in_context = !context_.empty() && id < context_.size() && context_[id];
      if ((value_[id] || offset_[id] || in_context) && (decides_discrete(n.op) || exact_[id]))
        for (NodeId a : n.operands()) exact_[a] = 1;
    }
  }

  // ---- Fast math's folding (docs/dsl.md, "Precision"). A float value is kept as alpha + beta *
  // atom, alpha and beta uniform (from constants and params only: the same for every score, so
  // the compiler computes them once, out of the loops), so that chains of + - * / by uniform
  // values cost one multiply or FMA where they meet a non-uniform one: softcap's
  // cap * tanh(score / cap) is one multiply into tanh and one out. sigmoid, exp and log are
  // written here from ex2 / lg2 / rcp .approx so that their own constants fold too
  // (sigmoid(a * score) is one multiply into ex2).
  struct Coef {
    double c = 0;      // the value, when `name` is empty
    std::string name;  // else a uniform C++ value
    bool is(double v) const { return name.empty() && c == v; }
  };
  struct Lin {
    Coef alpha, beta;
    std::string atom;  // empty: the value is alpha
  };

  // Whether node `id` is a fast float op (fast_value, else expr's fast forms). Uniform ones too:
  // the exact forms' slow paths are calls, which cost registers around them in the loop.
  bool folds(NodeId id) const { return fast_ && !exact_[id] && g_[id].type == Type::Float; }
  // Reads nothing but constants and params (computed per node, in id order).
  bool uniform(NodeId id) const { return !uniform_.empty() && uniform_[id]; }
  void mark_uniform() {
    uniform_.assign(g_.size(), 0);
    for (NodeId id = 0; id < g_.size(); ++id) {
      const Node& n = g_[id];
      if (substituted(id) || n.op == Op::Input || n.op == Op::Load) continue;
      bool u = true;
      for (NodeId a : n.operands()) u = u && uniform_[a];
      uniform_[id] = u;
    }
  }

  Lin lin_of(NodeId id) const {
    if (!lin_.empty() && !lin_[id].atom.empty()) return lin_[id];
    const Node& n = g_[id];
    if (n.op == Op::Const && n.type == Type::Float) return {{n.fval, {}}, {}, {}};
    if (uniform(id)) return {{0, ref(id)}, {}, {}};
    return {{}, {1, {}}, ref(id)};
  }

  std::string coef_text(const Coef& k) const {
    return k.name.empty() ? float_literal(k.c) : k.name;
  }
  // A uniform value computed from others: a statement of its own (named, so that long chains
  // stay linear in text).
  Coef named(std::string init, std::string& out) {
    const std::string name = fmt::format("k{}", coefs_++);
    out += fmt::format("    const float {} = {};\n", name, init);
    return {0, name};
  }
  Coef add(const Coef& a, const Coef& b, std::string& out) {
    if (a.name.empty() && b.name.empty()) return {a.c + b.c, {}};
    if (a.is(0)) return b;
    if (b.is(0)) return a;
    return named(fmt::format("{} + {}", coef_text(a), coef_text(b)), out);
  }
  // (A zero alpha is the absence of a term: it stays absent, whatever it is multiplied by.)
  Coef mul(const Coef& a, const Coef& b, std::string& out) {
    if (a.name.empty() && b.name.empty()) return {a.c * b.c, {}};
    if (a.is(0) || b.is(0)) return {};
    if (a.is(1)) return b;
    if (b.is(1)) return a;
    if (a.is(-1)) return neg(b, out);
    if (b.is(-1)) return neg(a, out);
    return named(fmt::format("{} * {}", coef_text(a), coef_text(b)), out);
  }
  Coef neg(const Coef& a, std::string& out) {
    return a.name.empty() ? Coef{-a.c, {}} : named("-" + a.name, out);
  }
  Coef rcp(const Coef& a, std::string& out) {
    return a.name.empty() ? Coef{1 / a.c, {}}
                          : named(fmt::format("flexc_fast_rcp({})", a.name), out);
  }
  // A constant factor that is 0 or past float's range would change what a value is, not just its
  // rounding (score * 0.0 is NaN for an infinite score, exp(score * 3e38) folded inf * score),
  // and a subnormal one would lose bits: such a fold is not made.
  static bool sound(const Coef& k, bool nonzero) {
    if (!k.name.empty()) return true;
    const float f = static_cast<float>(k.c);
    return f == 0 ? !nonzero : std::isnormal(f);
  }
  Lin scaled(const Lin& x, const Coef& k, std::string& out) {
    return {mul(x.alpha, k, out), mul(x.beta, k, out), x.atom};
  }

  std::string render(const Lin& x) const {
    if (x.atom.empty()) return coef_text(x.alpha);
    const std::string term = x.beta.is(1)    ? x.atom
                             : x.beta.is(-1) ? "-" + x.atom
                                             : coef_text(x.beta) + " * " + x.atom;
    return x.alpha.is(0) ? term : coef_text(x.alpha) + " + " + term;
  }
  // An intermediate value of node `id`'s expansion (sigmoid's exponential and reciprocal).
  std::string aux(NodeId id, char tag, const std::string& init, std::string& out) const {
    const std::string name = fmt::format("{}{}", tag, id);
    out += fmt::format("    const float {} = {};\n", name, init);
    return name;
  }

  // Node `id`'s value when it folds (its operands' forms combined; empty: written as usual by
  // expr, an atom for its users). Statements for the uniform factors and the expansions go to
  // `out` first.
  std::string fast_value(const Node& n, NodeId id, std::string& out) {
    if (lin_.empty()) lin_.resize(g_.size());
    const auto x = [&](int i) { return lin_of(n.args[i]); };
    // Operand i times the constant k, folded where the product's factors stay sound.
    const auto times = [&](int i, double k) {
      const Lin s = scaled(x(i), {k, {}}, out);
      return sound(s.alpha, false) && sound(s.beta, !s.atom.empty())
                 ? s
                 : Lin{{}, {k, {}}, ref(n.args[i])};
    };
    std::optional<Lin> r;
    switch (n.op) {
      case Op::Add:
      case Op::Sub: {
        const Lin a = x(0);
        Lin b = x(1);
        if (n.op == Op::Sub)
          b = {neg(b.alpha, out), b.atom.empty() ? Coef{} : neg(b.beta, out), b.atom};
        if (a.atom.empty())
          r = Lin{add(a.alpha, b.alpha, out), b.beta, b.atom};
        else if (b.atom.empty())
          r = Lin{add(a.alpha, b.alpha, out), a.beta, a.atom};
        else if (a.atom == b.atom)
          r = Lin{add(a.alpha, b.alpha, out), add(a.beta, b.beta, out), a.atom};
        break;
      }
      case Op::Neg: {
        const Lin a = x(0);
        r = Lin{neg(a.alpha, out), neg(a.beta, out), a.atom};
        break;
      }
      case Op::Mul:
        if (x(0).atom.empty())
          r = scaled(x(1), x(0).alpha, out);
        else if (x(1).atom.empty())
          r = scaled(x(0), x(1).alpha, out);
        break;
      case Op::Div:
        if (x(1).atom.empty())
          r = scaled(x(0), rcp(x(1).alpha, out), out);
        else if (x(0).atom.empty())
          r = Lin{
              {}, x(0).alpha, aux(id, 'r', fmt::format("flexc_fast_rcp({})", ref(n.args[1])), out)};
        break;
      case Op::Exp:
        return fmt::format("flexc_fast_exp2({})", render(times(0, kLog2e)));
      case Op::Exp2:
        return fmt::format("flexc_fast_exp2({})", render(x(0)));
      case Op::Log:
        r = Lin{
            {}, {kLn2, {}}, aux(id, 'l', fmt::format("flexc_fast_log2({})", ref(n.args[0])), out)};
        break;
      case Op::Tanh:
        return fmt::format("{}({})",
                           approx_       ? "flexc_approx_tanh"
                           : tanh_forms_ ? "tanh_form"
                                         : "flexc_fast_tanh",
                           render(x(0)));
      case Op::Sigmoid: {
        // 1 / (1 + e^-x): 0 once 1 + e^-x passes 2^126 (the reciprocal flushes), never NaN.
        const std::string e =
            aux(id, 'e', fmt::format("flexc_fast_exp2({})", render(times(0, -kLog2e))), out);
        r = Lin{{}, {1, {}}, aux(id, 'r', fmt::format("flexc_fast_rcp(1.0f + {})", e), out)};
        break;
      }
      default:
        break;
    }
    if (!r || r->atom.empty() || !sound(r->alpha, false) || !sound(r->beta, true)) return {};
    lin_[id] = *r;
    return render(*r);
  }

  // 1 / c as a float literal when node `id` is a float constant c = +-2^k whose reciprocal is a
  // normal float, else empty. Dividing by c then is multiplying by 1 / c, bit for bit: both round
  // the same exact value x * 2^-k once (and agree on zeros, infinities and NaN).
  std::string exact_reciprocal(NodeId id) const {
    const Node& c = g_[id];
    if (c.op != Op::Const || c.type != Type::Float || !std::isfinite(c.fval) || c.fval == 0)
      return {};
    int e = 0;
    const double m = std::frexp(c.fval, &e);  // c = m * 2^e, |m| in [0.5, 1)
    if (std::fabs(m) != 0.5 || e - 1 < -126 || e - 1 > 126) return {};
    return float_literal(1.0 / c.fval);
  }

  // k when node `id` is the int constant 2^k (0 <= k <= 30), else -1.
  int log2_of(NodeId id) const {
    const Node& c = g_[id];
    if (c.op != Op::Const || c.type != Type::Int || c.ival <= 0 || c.ival > (1 << 30)) return -1;
    const auto v = static_cast<uint32_t>(c.ival);
    return (v & (v - 1)) == 0 ? std::countr_zero(v) : -1;
  }

  std::string offset_expr(const Node& n) const {
    if (n.slot >= decls_.captures.size())
      throw std::invalid_argument(
          fmt::format("emit_cuda: capture slot {} is not declared", n.slot));
    const CaptureDecl& c = decls_.captures[n.slot];
    if (c.dims.size() != n.nargs)
      throw std::invalid_argument(fmt::format("emit_cuda: capture slot {} has rank {}, not {}",
                                              n.slot, c.dims.size(), n.nargs));
    std::string s = fmt::format("flexc_at(a.captures[{}]", n.slot);
    for (size_t d = 0; d < n.nargs; ++d) {
      const Node& i = g_[n.args[d]];
      // In range by the hooks' contract: no integer modulo. A fixed extent is validated at launch,
      // so it is a constant here (a modulo by a constant is a multiply, or a mask).
      if (i.op == Op::Input && in_range(i.input, c.dims[d]))
        s += ", " + ref(n.args[d]);
      else if (c.dims[d].kind == Dim::Fixed)
        s += fmt::format(", flexc_wrap({}, {})", ref(n.args[d]), int_literal(c.dims[d].extent));
      else
        s += fmt::format(", flexc_wrap({}, a.captures[{}].shape[{}])", ref(n.args[d]), n.slot, d);
    }
    return s + ")";
  }

  std::string expr(const Node& n, NodeId id) const {
    const auto arg = [&](int i) { return ref(n.args[i]); };
    const auto call = [&](std::string_view f) {
      std::string s = std::string(f) + "(";
      for (int i = 0; i < n.nargs; ++i) s += (i ? ", " : "") + arg(i);
      return s + ")";
    };
    const auto infix = [&](std::string_view op) {
      return fmt::format("{} {} {}", arg(0), op, arg(1));
    };
    // Int ops and Float ops differ in name only; `operand` is the type the args were promoted to.
    const Type operand = n.nargs ? g_[n.args[n.op == Op::Select ? 1 : 0]].type : n.type;
    const bool f = operand == Type::Float;
    // Fast float math: contractible operators and approximate instructions, except where a
    // discrete outcome depends on the value (mark_exact). pow stays exact (the fast form is NaN
    // for negative bases). What fast_value folds or expands does not come here.
    if (folds(id)) {
      switch (n.op) {
        case Op::Add:
          return infix("+");
        case Op::Sub:
          return infix("-");
        case Op::Mul:
          return infix("*");
        case Op::Div:
          if (const std::string r = exact_reciprocal(n.args[1]); !r.empty())
            return fmt::format("{} * {}", arg(0), r);
          return call("flexc_fast_div");
        case Op::Log2:
          return call("flexc_fast_log2");
        case Op::Sqrt:
          return call("flexc_fast_sqrt");
        case Op::Rsqrt:
          return call("flexc_fast_rsqrt");
        case Op::Sin:
          return call("flexc_fast_sin");
        case Op::Cos:
          return call("flexc_fast_cos");
        default:
          break;
      }
    }
    switch (n.op) {
      case Op::Const:
      case Op::Input:
        return ref(id);
      case Op::Param:
        if (n.slot >= decls_.params.size() || n.slot >= kMaxParams)
          throw std::invalid_argument(
              fmt::format("emit_cuda: runtime param slot {} is not declared or not below {}",
                          n.slot, kMaxParams));
        return fmt::format("a.{}param[{}]", n.type == Type::Float ? 'f' : 'i', n.slot);
      case Op::Load:
        return fmt::format("{}{}(a.captures[{}], o{})", load_helper(decls_.captures[n.slot].dtype),
                           plain_ ? "<true>" : "", n.slot, id);
      case Op::Neg:
        return f ? "-" + arg(0) : call("flexc_neg");
      case Op::Not:
        return "!" + arg(0);
      case Op::BitNot:
        return "~" + arg(0);
      case Op::Add:
        return call(f ? "__fadd_rn" : "flexc_add");
      case Op::Sub:
        return call(f ? "__fsub_rn" : "flexc_sub");
      case Op::Mul:
        return call(f ? "__fmul_rn" : "flexc_mul");
      case Op::Div:
        if (const std::string r = exact_reciprocal(n.args[1]); !r.empty())
          return fmt::format("__fmul_rn({}, {})", arg(0), r);
        return call("__fdiv_rn");
      case Op::FloorDiv:
        // By a power of two, floored division is an arithmetic shift and floored modulo a mask
        // (-7 // 8 == -7 >> 3 == -1, -7 % 8 == -7 & 7 == 1): 1 instruction instead of ~6.
        if (const int k = f ? -1 : log2_of(n.args[1]); k >= 0)
          return fmt::format("{} >> {}", arg(0), k);
        return call(f ? "flexc_floordivf" : "flexc_floordiv");
      case Op::Mod:
        if (const int k = f ? -1 : log2_of(n.args[1]); k >= 0)
          return fmt::format("{} & {}", arg(0), (1 << k) - 1);
        return call(f ? "flexc_modf" : "flexc_mod");
      case Op::Shl:
        return call("flexc_shl");
      case Op::Shr:
        return call("flexc_shr");
      case Op::Lt:
        return infix("<");
      case Op::Le:
        return infix("<=");
      case Op::Gt:
        return infix(">");
      case Op::Ge:
        return infix(">=");
      case Op::Eq:
        return infix("==");
      case Op::Ne:
        return infix("!=");
      case Op::BitAnd:
        return infix("&");
      case Op::BitXor:
        return infix("^");
      case Op::BitOr:
        return infix("|");
      case Op::And:
        return infix("&&");
      case Op::Or:
        return infix("||");
      case Op::Select:
        return fmt::format("{} ? {} : {}", arg(0), arg(1), arg(2));
      case Op::Min:
        return call(f ? "flexc_minf" : "flexc_min");
      case Op::Max:
        return call(f ? "flexc_maxf" : "flexc_max");
      case Op::Abs:
        return call(f ? "fabsf" : "flexc_abs");
      case Op::Clamp:
        return call(f ? "flexc_clampf" : "flexc_clamp");
      case Op::Exp:
        return call("expf");
      case Op::Exp2:
        return call("exp2f");
      case Op::Log:
        return call("logf");
      case Op::Log2:
        return call("log2f");
      case Op::Sqrt:
        return call("sqrtf");
      case Op::Rsqrt:
        return call("flexc_rsqrtf");
      case Op::Tanh:
        return call("tanhf");
      case Op::Sigmoid:
        return call("flexc_sigmoidf");
      case Op::Sin:
        return call("sinf");
      case Op::Cos:
        return call("cosf");
      case Op::Pow:
        return call("powf");
      case Op::Floor:
        return f ? call("floorf") : arg(0);
      case Op::Ceil:
        return f ? call("ceilf") : arg(0);
      case Op::Sign:
        return call(f ? "flexc_signf" : "flexc_sign");
      case Op::ToFloat:
        return operand == Type::Bool ? arg(0) + " ? 1.0f : 0.0f" : call("__int2float_rn");
      case Op::ToInt:
        return f ? call("__float2int_rz") : operand == Type::Bool ? "(int)" + arg(0) : arg(0);
    }
    throw std::invalid_argument(fmt::format("emit_cuda: unknown op {}", static_cast<int>(n.op)));
  }

  static constexpr double kLog2e = 1.4426950408889634, kLn2 = 0.6931471805599453;

  const Graph& g_;
  const Decls& decls_;
  std::string_view marker_;
  bool fast_, approx_;
  bool plain_ = false, tanh_forms_ = false;
  std::vector<char> value_, offset_, exact_, context_, uniform_;
  std::vector<std::string> subst_;
  std::vector<Lin> lin_;
  int coefs_ = 0;
};

constexpr const char* kScoreParams =
    "const FlexcArgs& a, float score, int b, int h, int q_idx, int kv_idx, int q_len, int kv_len";
constexpr const char* kMaskParams =
    "const FlexcArgs& a, int b, int h, int q_idx, int kv_idx, int q_len, int kv_len";
constexpr const char* kGradParams =
    "const FlexcArgs& a, Sink& grads, float grad_score, float score, int b, int h, int q_idx, "
    "int kv_idx, int q_len, int kv_len";

std::string hook(const char* ret, const char* name, const char* params, const std::string& body) {
  return fmt::format("  __device__ static __forceinline__ {} {}({}) {{\n{}  }}\n", ret, name,
                     params, body);
}

// score_mod's hooks take tanh's form as their last argument (flexc_hooks.cuh, "Tanh forms");
// `uses` notes whether the body calls it.
struct TanhForm {
  bool* uses = nullptr;
};
constexpr const char* kTanhFormParam = "Tanh tanh_form = Tanh()";
std::string form_hook(const char* ret, const char* name, const std::string& params,
                      const std::string& body, TanhForm form) {
  if (!form.uses) return hook(ret, name, params.c_str(), body);
  *form.uses |= body.find("tanh_form(") != std::string::npos;
  return "  template <class Tanh = FlexcTanh>\n" +
         hook(ret, name, fmt::format("{}, {}", params, kTanhFormParam).c_str(), body);
}

// A function returning the value of `g.root`.
std::string value_hook(const Graph& g, const Decls& decls, std::string_view marker, FloatMath math,
                       const char* ret, const char* name, const char* params, TanhForm form = {}) {
  BodyWriter w(g, decls, marker, math);
  if (form.uses) w.tanh_forms();
  w.need_value(g.root);
  std::string body = w.write();
  body += fmt::format("    return {};\n", w.ref(g.root));
  return form_hook(ret, name, params, body, form);
}

// Column loads: a hook's capture loads whose indices read kv_idx but neither q_idx nor the score
// (score_mod's per-key bias, mask_mod's document id of the key), at most kMaxColumnLoads of each
// hook's, in node order. The Hopper kernel's loader warps stage them for a whole kv tile in shared
// memory (templates/tile/attention_tile.cuh, StagedColumns), once per column; score_mod_cols and
// mask_mod_cols read them from there.
std::vector<NodeId> column_loads(const Graph& g) {
  std::vector<NodeId> out;
  const std::vector<char> used = reachable(g, g.root);
  for (NodeId id = 0; id <= g.root && out.size() < size_t(kMaxColumnLoads); ++id) {
    if (!used[id] || g[id].op != Op::Load) continue;
    const Deps d = dependencies(g, id);
    if (d.reads(Input::KvIdx) && !d.reads(Input::QIdx) && !d.reads(Input::Score))
      out.push_back(id);
  }
  return out;
}

// A value of type t as the 32-bit word the kernels carry it in (columns_hook reads it back).
std::string as_word(Type t, const std::string& value) {
  return t == Type::Float ? fmt::format("__float_as_uint({})", value)
                          : fmt::format("(unsigned){}", value);
}

// Loads of `g` as 32-bit words into cv[] (score_columns: the column loads; score_tiles: the tile
// loads, element by element), which the `_cols` twin of its value hook reads back.
std::string column_loader(const Graph& g, const Decls& decls, std::string_view marker,
                          const std::vector<NodeId>& loads, const char* name) {
  BodyWriter w(g, decls, marker, FloatMath::Exact);
  w.plain_loads();
  for (NodeId id : loads) w.need_value(id);
  std::string body = w.write();
  for (size_t k = 0; k < loads.size(); ++k)
    body += fmt::format("    cv[{}] = {};\n", k, as_word(g[loads[k]].type, w.ref(loads[k])));
  return hook("void", name,
              "const FlexcArgs& a, int b, int h, int q_idx, int kv_idx, int q_len, int kv_len, "
              "unsigned* cv",
              body);
}

// The dim of load `id` that input `in` (kv_idx or q_idx) itself indexes, at a dim of its range
// (KV_LEN, Q_LEN), with every other index but dim `skip` free of `in`; -1 when the load is not of
// that form. Consecutive keys (queries) are then consecutive elements (rows of one stride).
int index_dim(const Graph& g, const Decls& decls, NodeId id, Input in, int skip = -1) {
  const Node& n = g[id];
  const CaptureDecl& c = decls.captures.at(n.slot);
  int dim = -1;
  for (int d = 0; d < n.nargs; ++d) {
    if (d == skip) continue;
    const Node& i = g[n.args[d]];
    if (i.op == Op::Input && i.input == in && dim < 0 && in_range(in, c.dims[d]))
      dim = d;
    else if (dependencies(g, n.args[d]).reads(in))
      return -1;
  }
  return dim;
}

// Element type codes the kernels switch on: 0 float32, 1 bf16, 2 fp16, 3 int32, 4 bool.
int type_code(DType t) {
  return t == DType::F32 ? 0 : t == DType::BF16 ? 1 : t == DType::F16 ? 2 : t == DType::I32 ? 3 : 4;
}

// Where a tile load reads: the capture slot, its kv dim (indexed by kv_idx itself), its element
// type, its q dim (q_dim; -1: none).
struct TileLayout {
  size_t slot, dim;
  int type, qdim;
};

// Tile loads: score_mod's loads of a 16-bit capture indexed by q_idx and by kv_idx itself
// (index_dim: a [Q_LEN, KV_LEN] bias, or [B, H, Q_LEN, KV_LEN]), not by the score; at most
// kMaxTileLoads. The Hopper kernel loads a thread's whole share of the tile ahead of its scores,
// two adjacent keys in one 32-bit load from each row's offset at kv_idx = 0 (or element by element
// where that does not apply), instead of a gather with its address arithmetic per score. One:
// their words stay in registers across the wait.
constexpr size_t kMaxTileLoads = 1;

struct TileLoad {
  NodeId id;
  TileLayout layout;
};
std::vector<TileLoad> tile_loads(const Graph& g, const Decls& decls) {
  std::vector<TileLoad> out;
  const std::vector<char> used = reachable(g, g.root);
  for (NodeId id = 0; id <= g.root && out.size() < kMaxTileLoads; ++id) {
    if (!used[id] || g[id].op != Op::Load) continue;
    const Deps d = dependencies(g, id);
    const DType t = decls.captures.at(g[id].slot).dtype;
    if (!d.reads(Input::KvIdx) || !d.reads(Input::QIdx) || d.reads(Input::Score) ||
        (t != DType::BF16 && t != DType::F16))
      continue;
    const int dim = index_dim(g, decls, id, Input::KvIdx);
    if (dim >= 0)
      out.push_back(
          {id, {g[id].slot, size_t(dim), type_code(t), index_dim(g, decls, id, Input::QIdx, dim)}});
  }
  return out;
}

// Each load's element offset (called with kv_idx = 0 on the fast paths): `name` is
// score_tile_offsets.
std::string load_offsets(const Graph& g, const Decls& decls, std::string_view marker,
                         const std::vector<NodeId>& loads, const char* name) {
  BodyWriter w(g, decls, marker, FloatMath::Exact);
  for (NodeId id : loads) w.need_offset(id);
  std::string body = w.write();
  for (size_t k = 0; k < loads.size(); ++k) body += fmt::format("    o[{}] = o{};\n", k, loads[k]);
  return hook("void", name,
              "const FlexcArgs& a, int b, int h, int q_idx, int kv_idx, int q_len, int kv_len, "
              "long long* o",
              body);
}

// `loads` (the column loads, the tile loads, then the relative terms) read from cv[].
std::string columns_hook(const Graph& g, const Decls& decls, std::string_view marker,
                         FloatMath math, const std::vector<NodeId>& loads, const char* ret,
                         const char* name, const char* params, TanhForm form = {}) {
  BodyWriter w(g, decls, marker, math);
  if (form.uses) w.tanh_forms();
  // Exact where score_mod is, though the loads' and terms' own operands are not written here: a
  // value both inside a relative term (under a floor, say) and outside it is exact in both.
  w.exact_as_in(g.root);
  for (size_t k = 0; k < loads.size(); ++k) {
    const Type t = g[loads[k]].type;
    w.substitute(loads[k], t == Type::Float ? fmt::format("__uint_as_float(cv[{}])", k)
                           : t == Type::Int ? fmt::format("(int)cv[{}]", k)
                                            : fmt::format("cv[{}] != 0u", k));
  }
  w.need_value(g.root);
  std::string body = w.write();
  body += fmt::format("    return {};\n", w.ref(g.root));
  return form_hook(ret, name, fmt::format("{}, const unsigned* cv", params), body, form);
}

// Relative terms: the parts of score_mod that read q_idx and kv_idx only through their difference
// (`kv_idx - q_idx` or `q_idx - kv_idx`), and b, h, the lengths, params and captures otherwise: a
// T5 bucketed bias, a decay in |q_idx - kv_idx|, a relative-position table. A tile of R rows and
// C columns holds only R + C - 1 differences, so the forward kernels tabulate each term once per
// tile in shared memory (templates/tile/attention_tile.cuh, RelTable) and score_mod_cols reads it
// back: one shared load per score instead of the term's math. Terms are the largest such
// subexpressions (used by a node that reads the score or an index directly), at most kMaxRelTerms,
// those whose per-score work weighs at least kRelMinCost: two operations (alibi's slope[h] *
// (kv_idx - q_idx), a conversion and a multiply, ran 6-13% faster from the table; docs/perf.md).
constexpr int kRelMinCost = 2;

bool is_difference(const Graph& g, const Node& n) {
  if (n.op != Op::Sub) return false;
  const auto is = [&](NodeId id, Input i) { return g[id].op == Op::Input && g[id].input == i; };
  return (is(n.args[0], Input::KvIdx) && is(n.args[1], Input::QIdx)) ||
         (is(n.args[0], Input::QIdx) && is(n.args[1], Input::KvIdx));
}

// A rough per-score instruction weight of one operation of a relative term.
int rel_cost(const Graph& g, const Node& n) {
  switch (n.op) {
    case Op::Load:
    case Op::Div:
    case Op::Exp:
    case Op::Exp2:
    case Op::Log:
    case Op::Log2:
    case Op::Sqrt:
    case Op::Rsqrt:
    case Op::Tanh:
    case Op::Sigmoid:
    case Op::Sin:
    case Op::Cos:
    case Op::Pow:
      return 4;
    case Op::FloorDiv:
    case Op::Mod: {  // by a power of two: a shift or a mask (BodyWriter::expr)
      const Node& c = g[n.args[1]];
      const bool pow2 = n.type == Type::Int && c.op == Op::Const && c.ival > 0 &&
                        c.ival <= (1 << 30) && (c.ival & (c.ival - 1)) == 0;
      return pow2 ? 1 : 4;
    }
    default:
      return 1;
  }
}

// What each node reads of the score and the indices: nothing (kFixed), kv_idx and q_idx only
// through their difference (kRel), or more (kOther).
enum RelKind : char { kFixed, kRel, kOther };  // ordered: a node is the max of its operands

std::vector<char> rel_kinds(const Graph& g) {
  std::vector<char> kind(g.size(), kFixed);
  for (NodeId id = 0; id < g.size(); ++id) {
    const Node& n = g[id];
    if (n.op == Op::Input)
      kind[id] = n.input == Input::Score || n.input == Input::QIdx || n.input == Input::KvIdx
                     ? kOther
                     : kFixed;
    else if (is_difference(g, n))
      kind[id] = kRel;
    else
      for (NodeId a : n.operands()) kind[id] = std::max(kind[id], kind[a]);
  }
  return kind;
}

// Fast float math: a float sum whose operands include two or more relative terms adds those
// first (score + a(d) - b(d) -> (a(d) - b(d)) + score), so that they tabulate as one term, one
// shared load per score instead of one per term (int_heavy's two). The rounding of the sum
// changes, as a contracted FMA's does; exact math keeps the written order, and so does fast math
// where the sum decides something discrete.
Graph group_relative_terms(const Graph& g) {
  const std::vector<char> kind = rel_kinds(g);
  const std::vector<char> used = reachable(g, g.root);
  // A sum that decides something discrete stays as written, as fast math leaves it.
  std::vector<char> exact(g.size(), 0);
  for (NodeId id = static_cast<NodeId>(g.size()); id-- > 0;)
    if (used[id] && (decides_discrete(g[id].op) || exact[id]))
      for (NodeId a : g[id].operands()) exact[a] = 1;
  const auto is_sum = [&](NodeId id) {
    const Node& n = g[id];
    return (n.op == Op::Add || n.op == Op::Sub) && n.type == Type::Float && kind[id] == kOther &&
           !exact[id];
  };
  // A sum's operands with their signs, in order, through the sums it is made of.
  const auto flatten = [&](auto&& self, NodeId at, bool minus,
                           std::vector<std::pair<NodeId, bool>>& leaves) -> void {
    if (!is_sum(at)) {
      leaves.emplace_back(at, minus);
      return;
    }
    self(self, g[at].args[0], minus, leaves);
    self(self, g[at].args[1], g[at].op == Op::Sub ? !minus : minus, leaves);
  };
  const auto grouped = [&](NodeId id, std::vector<std::pair<NodeId, bool>>& rel,
                           std::vector<std::pair<NodeId, bool>>& rest) {
    if (!is_sum(id)) return false;
    std::vector<std::pair<NodeId, bool>> leaves;
    flatten(flatten, id, false, leaves);
    for (const auto& leaf : leaves) (kind[leaf.first] == kRel ? rel : rest).push_back(leaf);
    return rel.size() >= 2;
  };
  bool any = false;
  for (NodeId id = 0; id < g.size() && !any; ++id) {
    std::vector<std::pair<NodeId, bool>> rel, rest;
    any = used[id] && grouped(id, rel, rest);
  }
  if (!any) return g;  // the same graph, node for node
  Graph out;
  std::vector<int64_t> copied(g.size(), -1);
  const auto copy = [&](auto&& self, NodeId id) -> NodeId {
    if (copied[id] >= 0) return static_cast<NodeId>(copied[id]);
    std::vector<std::pair<NodeId, bool>> rel, rest;  // (node, subtracted)
    NodeId r;
    if (grouped(id, rel, rest)) {
      // The added terms first, so that none needs a negation: a + c - b, or -(b + c) overall.
      std::stable_partition(rel.begin(), rel.end(), [](const auto& l) { return !l.second; });
      bool negated = rel.front().second;  // r holds minus the sum
      r = self(self, rel.front().first);
      for (size_t k = 1; k < rel.size(); ++k)
        r = out.binary(rel[k].second && !negated ? Op::Sub : Op::Add, r, self(self, rel[k].first));
      for (const auto& [leaf, minus] : rest) {
        const NodeId x = self(self, leaf);
        if (negated && !minus) {
          r = out.binary(Op::Sub, x, r), negated = false;  // -s + x = x - s
        } else {
          r = out.binary(negated == minus ? Op::Add : Op::Sub, r, x);  // -s - x = -(s + x)
        }
      }
      if (negated) r = out.unary(Op::Neg, r);
    } else {
      Node n = g[id];
      for (uint8_t k = 0; k < n.nargs; ++k) n.args[k] = self(self, n.args[k]);
      r = out.add(n);
    }
    copied[id] = r;
    return r;
  };
  out.root = copy(copy, g.root);
  return out;
}

// score_mod as the hooks are written from it: simplified, and under fast math with a sum's
// relative terms grouped.
Graph score_graph(const EmitInput& in) {
  const Graph g = simplify(*in.score);
  return in.score_math == FloatMath::Exact ? g : group_relative_terms(g);
}

std::vector<NodeId> relative_terms(const Graph& g) {
  const std::vector<char> kind = rel_kinds(g);
  std::vector<int> cost(g.size(), 0);
  for (NodeId id = 0; id < g.size(); ++id) {
    if (kind[id] != kRel || is_difference(g, g[id])) continue;
    cost[id] = rel_cost(g, g[id]);
    for (NodeId a : g[id].operands()) cost[id] = std::min(cost[id] + cost[a], 1 << 20);
  }
  const std::vector<char> used = reachable(g, g.root);
  std::vector<char> term(g.size(), 0);
  if (kind[g.root] == kRel) term[g.root] = 1;
  for (NodeId id = 0; id <= g.root; ++id)
    if (used[id] && kind[id] == kOther)
      for (NodeId a : g[id].operands())
        if (kind[a] == kRel) term[a] = 1;
  std::vector<NodeId> out;
  for (NodeId id = 0; id <= g.root; ++id)
    if (term[id] && cost[id] >= kRelMinCost) out.push_back(id);
  std::stable_sort(out.begin(), out.end(), [&](NodeId a, NodeId b) { return cost[a] > cost[b]; });
  if (out.size() > size_t(kMaxRelTerms)) out.resize(kMaxRelTerms);
  std::sort(out.begin(), out.end());
  return out;
}

// The relative terms at difference d = kv_idx - q_idx as 32-bit words in tv[] (score_mod_cols
// reads them back after the column and tile loads).
std::string rel_terms_hook(const Graph& g, const Decls& decls, FloatMath math,
                           const std::vector<NodeId>& terms) {
  BodyWriter w(g, decls, "score_mod", math);
  w.exact_as_in(g.root);
  for (NodeId id = 0; id < g.size(); ++id)
    if (is_difference(g, g[id]))
      w.substitute(id, g[g[id].args[0]].input == Input::KvIdx ? "d" : "flexc_neg(d)");
  for (NodeId id : terms) w.need_value(id);
  std::string body = w.write();
  for (size_t k = 0; k < terms.size(); ++k)
    body += fmt::format("    tv[{}] = {};\n", k, as_word(g[terms[k]].type, w.ref(terms[k])));
  return hook("void", "score_rel_terms",
              "const FlexcArgs& a, int b, int h, int d, int q_len, int kv_len, unsigned* tv",
              body);
}

bool tiles_share_heads(const Graph& score, const std::vector<TileLoad>& tiles) {
  return !tiles.empty() && std::none_of(tiles.begin(), tiles.end(), [&](const TileLoad& t) {
    return dependencies(score, t.id).reads(Input::H);
  });
}

// The rowless score (fast precision): score_mod less its *row terms*, the additive terms that
// read neither the score nor kv_idx (`qb[h, q_idx]` in `score + qb[h, q_idx]`), and divided by
// its *units*, a positive constant factor of what is left (`30.0` in `30.0 * tanh(score /
// 30.0)`). A row's softmax is the same over the rowless scores in those units: the row terms
// only shift its LSE. So the forward and backward kernels compute the rowless score per score,
// scale it in their exponent, and add the row terms to each row's LSE once (templates/
// attention_tile.cuh: add_row_terms, row_lse_log2): no add or multiply per score for them.
// Exact precision keeps score_mod's rounding order, so it never splits.
struct Rowless {
  Graph rest;  // the rowless score (the score's graph, nodes added after it)
  std::vector<std::pair<NodeId, bool>> terms;  // the row terms, each with whether it is negated
  float units = 1;
};

// The terms of the sum at `id` (through float + - and unary -), each with whether it is negated.
void sum_terms(const Graph& g, NodeId id, bool neg, std::vector<std::pair<NodeId, bool>>& out) {
  const Node& n = g[id];
  if (n.type == Type::Float && (n.op == Op::Add || n.op == Op::Sub)) {
    sum_terms(g, n.args[0], neg, out);
    sum_terms(g, n.args[1], n.op == Op::Sub ? !neg : neg, out);
  } else if (n.type == Type::Float && n.op == Op::Neg) {
    sum_terms(g, n.args[0], !neg, out);
  } else {
    out.push_back({id, neg});
  }
}

// The sum of `terms` added to `g` (0.0 for none): the added ones first, then the negated.
NodeId sum_of(Graph& g, const std::vector<std::pair<NodeId, bool>>& terms) {
  std::optional<NodeId> acc;
  for (const bool neg : {false, true})
    for (const auto& [id, n] : terms) {
      if (n != neg) continue;
      acc = !acc ? (neg ? g.unary(Op::Neg, id) : id) : g.binary(neg ? Op::Sub : Op::Add, *acc, id);
    }
  return acc ? *acc : g.constant_float(0.0);
}

std::optional<Rowless> rowless_score(const Graph& score, FloatMath math) {
  if (math == FloatMath::Exact) return std::nullopt;
  std::vector<std::pair<NodeId, bool>> terms, rest;
  Rowless out{score, {}};
  sum_terms(score, score.root, false, terms);
  for (const auto& t : terms) {
    const Deps d = dependencies(score, t.first);
    (d.reads(Input::Score) || d.reads(Input::KvIdx) ? rest : out.terms).push_back(t);
  }
  if (!out.terms.empty()) out.rest.root = sum_of(out.rest, rest);
  // Positive constant factors of the rest, while their product stays a normal float.
  double units = 1;
  for (;;) {
    const Node& n = out.rest[out.rest.root];
    if (n.type != Type::Float || (n.op != Op::Mul && n.op != Op::Div)) break;
    const auto positive = [&](int i) {
      const Node& c = out.rest[n.args[i]];
      return c.op == Op::Const && c.type == Type::Float && c.fval > 0 && std::isfinite(c.fval);
    };
    const int k = positive(1) ? 1 : n.op == Op::Mul && positive(0) ? 0 : -1;
    if (k < 0) break;
    const double u =
        n.op == Op::Div ? units / out.rest[n.args[1]].fval : units * out.rest[n.args[k]].fval;
    if (!std::isnormal(static_cast<float>(u))) break;
    units = u;
    out.rest.root = n.args[1 - k];
  }
  out.units = static_cast<float>(units);
  if (out.terms.empty() && out.units == 1) return std::nullopt;
  return out;
}

constexpr const char* kRowParams =
    "const FlexcArgs& a, float base, int b, int h, int q_idx, int kv_idx, int q_len, int kv_len";

// row_terms: `base` (a row's LSE) plus the row terms, summed with their rounding errors carried
// (flexc_sum2), so that the LSE is rounded once, at the end. Written as score_mod's, they
// would round once more than per score, where the errors average out over the row's keys:
// a row shifted by thousands had its LSE 1.4x further from float64 than exact precision's.
std::string row_terms_hook(const Graph& g, const Decls& decls, FloatMath math,
                           const std::vector<std::pair<NodeId, bool>>& terms) {
  BodyWriter w(g, decls, "score_mod", math);
  for (const auto& t : terms) w.need_value(t.first);
  std::string body = w.write() + "    float s = base, c = 0.0f;\n";
  for (const auto& [id, neg] : terms)
    body += fmt::format("    flexc_sum2(s, c, {});\n",
                        neg ? fmt::format("-({})", w.ref(id)) : w.ref(id));
  return hook("float", "row_terms", kRowParams, body + "    return __fadd_rn(s, c);\n");
}

// The variant name may hold anything: keep it to characters that cannot end the comment.
std::string sanitise(std::string_view name) {
  std::string s;
  for (char c : name)
    s += (std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.' ||
          c == ' ')
             ? c
             : '?';
  return s;
}

}  // namespace

std::string emit_cuda_variant(const EmitInput& in) {
  if (!in.score || !in.mask || !in.decls)
    throw std::invalid_argument("emit_cuda: score, mask and decls are required");
  const Decls& decls = *in.decls;
  if (decls.captures.size() > kMaxCaptures)
    throw std::invalid_argument(fmt::format("a variant may capture at most {} tensors, not {}",
                                            kMaxCaptures, decls.captures.size()));

  const Graph score = score_graph(in);
  const Graph mask = simplify(*in.mask);

  // d score_mod / d score, and d score_mod / d loaded value for every differentiable load (its
  // Load node says where the gradient goes); each simplified, next to the nodes it reads.
  Graph dscore = score;
  dscore.root = simplify_into(dscore, derivative_wrt_score(dscore, dscore.root));
  const Node& droot = dscore[dscore.root];
  const bool grad_is_one = droot.op == Op::Const && droot.type == Type::Float && droot.fval == 1.0;
  Graph cg = score;
  std::vector<LoadDerivative> loads = derivatives_wrt_loads(cg, cg.root);
  for (LoadDerivative& ld : loads) ld.derivative = simplify_into(cg, ld.derivative);

  // Whether any capture gradient reads the score (the kernels then keep the pre-mod scores).
  bool grads_read_score = false;
  for (const LoadDerivative& ld : loads)
    grads_read_score |= dependencies(cg, ld.derivative).reads(Input::Score);
  const Deps mdeps = dependencies(mask, mask.root);
  const std::vector<NodeId> score_cols = column_loads(score);
  const std::vector<NodeId> mask_cols = column_loads(mask);
  const std::vector<TileLoad> tiles = tile_loads(score, decls);
  std::vector<NodeId> tile_ids;
  std::vector<TileLayout> tile_layout;
  for (const TileLoad& t : tiles) tile_ids.push_back(t.id), tile_layout.push_back(t.layout);
  const std::vector<NodeId> rel_terms = relative_terms(score);
  const std::optional<Rowless> split = rowless_score(score, in.score_math);
  // One of a layout's fields as a function of the load's number k (0 past the loads).
  const auto field = [&](const std::vector<TileLayout>& l, auto member) {
    std::string s;
    for (size_t k = 0; k < l.size(); ++k) s += fmt::format("k == {} ? {} : ", k, int(l[k].*member));
    return s + "0";
  };
  // score_mod's hooks first: the header says whether they call tanh_form.
  const FloatMath math = in.score_math;
  bool tanh_forms = false;
  const TanhForm form{&tanh_forms};
  std::vector<NodeId> read_from_cv = score_cols;
  read_from_cv.insert(read_from_cv.end(), tile_ids.begin(), tile_ids.end());
  read_from_cv.insert(read_from_cv.end(), rel_terms.begin(), rel_terms.end());
  std::string score_hooks =
      value_hook(score, decls, "score_mod", math, "float", "score_mod", kScoreParams, form);
  score_hooks +=
      value_hook(dscore, decls, "score_mod", math, "float", "score_mod_grad", kScoreParams, form);
  score_hooks += columns_hook(score, decls, "score_mod", math, read_from_cv, "float",
                              "score_mod_cols", kScoreParams, form);
  if (split) {
    score_hooks += value_hook(split->rest, decls, "score_mod", math, "float", "score_mod_rowless",
                              kScoreParams, form);
    score_hooks += columns_hook(split->rest, decls, "score_mod", math, read_from_cv, "float",
                                "score_mod_rowless_cols", kScoreParams, form);
  } else {
    constexpr const char* kArgs = "a, score, b, h, q_idx, kv_idx, q_len, kv_len";
    score_hooks += form_hook("float", "score_mod_rowless", kScoreParams,
                             fmt::format("    return score_mod({}, tanh_form);\n", kArgs), form);
    score_hooks += form_hook(
        "float", "score_mod_rowless_cols", fmt::format("{}, const unsigned* cv", kScoreParams),
        fmt::format("    return score_mod_cols({}, cv, tanh_form);\n", kArgs), form);
  }

  std::string out = fmt::format(
      "// Generated by flexc from variant '{}' ({} float math in score_mod). Do not edit: flexc\n"
      "// regenerates it.\n"
      "#pragma once\n"
      "#include \"flexc_hooks.cuh\"\n\n"
      "struct FlexcVariant {{\n"
      "  static constexpr bool kIdentityScore = {};\n"
      "  static constexpr bool kMaskAlwaysTrue = {};\n"
      "  static constexpr bool kMaskReadsB = {};\n"
      "  static constexpr bool kMaskReadsH = {};\n"
      "  static constexpr bool kScoreGradIsOne = {};\n"
      "  static constexpr bool kHasCaptureGrads = {};\n"
      "  static constexpr int kCaptureGradLoads = {};\n"
      "  static constexpr bool kCaptureGradsReadScore = {};\n"
      "  static constexpr int kScoreColumnLoads = {};\n"
      "  static constexpr int kMaskColumnLoads = {};\n"
      "  static constexpr int kScoreTileLoads = {};\n"
      "  static constexpr bool kScoreTilesShareHeads = {};\n"
      "  __device__ static constexpr int score_tile_slot(int k) {{ return {}; }}\n"
      "  __device__ static constexpr int score_tile_dim(int k) {{ return {}; }}\n"
      "  __device__ static constexpr int score_tile_type(int k) {{ return {}; }}\n"
      "  __device__ static constexpr int score_tile_qdim(int k) {{ return {}; }}\n"
      "  static constexpr int kScoreRelTerms = {};\n"
      "  static constexpr bool kRowless = {};\n"
      "  static constexpr bool kRowTerms = {};\n"
      "  static constexpr bool kRowlessIdentity = {};\n"
      "  static constexpr float kRowlessUnits = {};\n"
      "  static constexpr bool kTanhForms = {};\n\n",
      sanitise(in.variant_name),
      in.score_math == FloatMath::Exact  ? "exact"
      : in.score_math == FloatMath::Fast ? "fast"
                                         : "approx",
      is_identity_score(score, score.root), is_all_true_mask(mask, mask.root),
      mdeps.reads(Input::B), mdeps.reads(Input::H), grad_is_one, !loads.empty(), loads.size(),
      grads_read_score, score_cols.size(), mask_cols.size(), tiles.size(),
      tiles_share_heads(score, tiles), field(tile_layout, &TileLayout::slot),
      field(tile_layout, &TileLayout::dim), field(tile_layout, &TileLayout::type),
      field(tile_layout, &TileLayout::qdim), rel_terms.size(), split.has_value(),
      split && !split->terms.empty(),
      split ? is_identity_score(split->rest, split->rest.root)
            : is_identity_score(score, score.root),
      float_literal(split ? split->units : 1.0f), tanh_forms);

  out += score_hooks;
  out += value_hook(mask, decls, "mask_mod", FloatMath::Exact, "bool", "mask_mod", kMaskParams);
  out += column_loader(score, decls, "score_mod", score_cols, "score_columns");
  out += column_loader(mask, decls, "mask_mod", mask_cols, "mask_columns");
  out += column_loader(score, decls, "score_mod", tile_ids, "score_tiles");
  out += load_offsets(score, decls, "score_mod", tile_ids, "score_tile_offsets");
  out += rel_terms_hook(score, decls, math, rel_terms);
  out += columns_hook(mask, decls, "mask_mod", FloatMath::Exact, mask_cols, "bool",
                      "mask_mod_cols", kMaskParams);
  out += split ? row_terms_hook(score, decls, math, split->terms)
               : hook("float", "row_terms", kRowParams, "    return base;\n");

  BodyWriter w(cg, decls, "score_mod", math);
  for (const LoadDerivative& ld : loads) {
    w.need_offset(ld.load);
    w.need_value(ld.derivative);
  }
  std::string body = w.write();
  for (size_t k = 0; k < loads.size(); ++k)
    body += fmt::format("    grads.add({}, a.captures[{}], o{}, grad_score, {});\n", k,
                        cg[loads[k].load].slot, loads[k].load, w.ref(loads[k].derivative));
  out += "  template <class Sink>\n" + hook("void", "accumulate_capture_grads", kGradParams, body);
  out += "};\n";
  return out;
}

LaunchFacts launch_facts(const EmitInput& in) {
  if (!in.score || !in.decls) throw std::invalid_argument("launch_facts: score and decls are required");
  const Graph score = score_graph(in);
  const int mask_cols = in.mask ? static_cast<int>(column_loads(simplify(*in.mask)).size()) : 0;
  const std::vector<TileLoad> tiles = tile_loads(score, *in.decls);
  LaunchFacts f{tiles_share_heads(score, tiles), static_cast<int>(relative_terms(score).size()),
                static_cast<int>(column_loads(score).size()) + mask_cols};
  if (!tiles.empty()) {
    f.score_tile_slot = static_cast<int>(tiles[0].layout.slot);
    f.score_tile_kv_dim = static_cast<int>(tiles[0].layout.dim);
    f.score_tile_q_dim = tiles[0].layout.qdim;
  }
  const std::optional<Rowless> split = rowless_score(score, in.score_math);
  f.forward_identity = split ? is_identity_score(split->rest, split->rest.root)
                             : is_identity_score(score, score.root);
  return f;
}

}  // namespace flexc::dsl
