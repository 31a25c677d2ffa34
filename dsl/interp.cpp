// The CPU interpreter: the oracle every kernel is checked against. Semantics: dsl/ir.h, and the
// choices listed at `evaluate` in dsl/analysis.h.
#include <bit>
#include <cmath>
#include <cstring>
#include <fmt/format.h>
#include <limits>
#include <stdexcept>

#include "dsl/analysis.h"

namespace flexc::dsl {
namespace {

constexpr int64_t kIntMin = std::numeric_limits<int32_t>::min();
constexpr int64_t kIntMax = std::numeric_limits<int32_t>::max();

int64_t wrap32(int64_t v) { return static_cast<int32_t>(static_cast<uint32_t>(v)); }

int64_t saturating_int(double x) {
  if (std::isnan(x)) return 0;
  if (x >= static_cast<double>(kIntMax)) return kIntMax;
  if (x <= static_cast<double>(kIntMin)) return kIntMin;
  return static_cast<int64_t>(x);  // truncates toward zero
}

template <bool F32>
double round_to(double x) {
  if constexpr (F32)
    return static_cast<float>(x);
  else
    return x;
}

// A float function in the evaluation's precision: float math functions for F32.
template <bool F32, class Fn>
double math(Fn fn, double x) {
  if constexpr (F32)
    return fn(static_cast<float>(x));
  else
    return fn(x);
}

Value fval(double f) { return Value{Type::Float, 0, f}; }
Value ival(Type t, int64_t i) { return Value{t, i, 0}; }

double fmin_cuda(double a, double b) {
  if (std::isnan(a)) return b;
  if (std::isnan(b)) return a;
  if (a != b) return a < b ? a : b;
  return std::signbit(a) ? a : b;
}

double fmax_cuda(double a, double b) {
  if (std::isnan(a)) return b;
  if (std::isnan(b)) return a;
  if (a != b) return a > b ? a : b;
  return std::signbit(a) ? b : a;
}

int64_t floor_div(int64_t a, int64_t b) {
  if (b == 0) return 0;
  int64_t q = a / b;
  if (a % b != 0 && ((a < 0) != (b < 0))) --q;
  return wrap32(q);  // INT_MIN // -1 wraps
}

int64_t floor_mod(int64_t a, int64_t b) {
  if (b == 0) return 0;
  int64_t r = a % b;
  if (r != 0 && ((r < 0) != (b < 0))) r += b;
  return r;
}

float half_to_float(uint16_t h) {
  const int sign = h >> 15, biased = (h >> 10) & 0x1f, mant = h & 0x3ff;
  float v;
  if (biased == 0)
    v = std::ldexp(static_cast<float>(mant), -24);  // zero or subnormal
  else if (biased == 31)
    v = mant ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  else
    v = std::ldexp(static_cast<float>(mant | 0x400), biased - 25);
  return sign ? -v : v;
}

float bf16_to_float(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

[[noreturn]] void bad_env(const std::string& what) {
  throw std::invalid_argument("evaluate: " + what);
}

template <bool F32>
Value load(const Node& n, const Value* vals, const EvalEnv& env) {
  if (n.slot >= env.captures.size()) bad_env(fmt::format("no tensor for capture slot {}", n.slot));
  const HostTensor& t = env.captures[n.slot];
  if (t.shape.size() != n.nargs || (!t.strides.empty() && t.strides.size() != n.nargs) ||
      dtype_value_type(t.dtype) != n.type)
    bad_env(fmt::format("capture slot {} has a {} tensor of rank {}; the mod reads a {} of rank {}",
                        n.slot, dtype_name(t.dtype), t.shape.size(), type_name(n.type), n.nargs));
  if (t.data == nullptr) bad_env(fmt::format("capture slot {} has no data", n.slot));
  for (int k = 0; k < n.nargs; ++k)
    if (t.shape[k] <= 0) bad_env(fmt::format("capture slot {} has an empty dimension", n.slot));
  const int64_t offset = load_offset(n, vals, t.shape, t.strides);
  switch (t.dtype) {
    case DType::F32: return fval(static_cast<const float*>(t.data)[offset]);
    case DType::BF16: return fval(bf16_to_float(static_cast<const uint16_t*>(t.data)[offset]));
    case DType::F16: return fval(half_to_float(static_cast<const uint16_t*>(t.data)[offset]));
    case DType::I32: return ival(Type::Int, static_cast<const int32_t*>(t.data)[offset]);
    case DType::Bool: return ival(Type::Bool, static_cast<const uint8_t*>(t.data)[offset] != 0);
  }
  return {};
}

// Applies a non-leaf node to its operands; `a(k)` is operand k's value.
template <bool F32, class Arg>
Value apply(const Node& n, const Arg& a) {
  const Type t = n.type;
  const bool flt = t == Type::Float;
  const auto compare = [&](auto pred) {
    const Value &x = a(0), &y = a(1);
    return ival(Type::Bool, x.type == Type::Float ? pred(x.f, y.f) : pred(x.i, y.i));
  };
  switch (n.op) {
    case Op::Neg: return flt ? fval(-a(0).f) : ival(t, wrap32(-a(0).i));
    case Op::Not: return ival(t, !a(0).i);
    case Op::BitNot: return ival(t, ~a(0).i);
    case Op::Add:
      return flt ? fval(round_to<F32>(a(0).f + a(1).f)) : ival(t, wrap32(a(0).i + a(1).i));
    case Op::Sub:
      return flt ? fval(round_to<F32>(a(0).f - a(1).f)) : ival(t, wrap32(a(0).i - a(1).i));
    case Op::Mul:
      return flt ? fval(round_to<F32>(a(0).f * a(1).f)) : ival(t, wrap32(a(0).i * a(1).i));
    case Op::Div: return fval(round_to<F32>(a(0).f / a(1).f));
    case Op::FloorDiv:
      if (flt) return fval(std::floor(round_to<F32>(a(0).f / a(1).f)));
      return ival(t, floor_div(a(0).i, a(1).i));
    case Op::Mod:
      if (flt) {
        const double x = a(0).f, y = a(1).f;
        const double q = std::floor(round_to<F32>(x / y));
        return fval(round_to<F32>(x - round_to<F32>(y * q)));
      }
      return ival(t, floor_mod(a(0).i, a(1).i));
    case Op::Shl:
      return ival(t, wrap32(static_cast<int64_t>(static_cast<uint32_t>(a(0).i) << (a(1).i & 31))));
    case Op::Shr: return ival(t, static_cast<int32_t>(a(0).i) >> (a(1).i & 31));
    case Op::Lt: return compare([](auto x, auto y) { return x < y; });
    case Op::Le: return compare([](auto x, auto y) { return x <= y; });
    case Op::Gt: return compare([](auto x, auto y) { return x > y; });
    case Op::Ge: return compare([](auto x, auto y) { return x >= y; });
    case Op::Eq: return compare([](auto x, auto y) { return x == y; });
    case Op::Ne: return compare([](auto x, auto y) { return x != y; });
    case Op::BitAnd: return ival(t, a(0).i & a(1).i);
    case Op::BitXor: return ival(t, a(0).i ^ a(1).i);
    case Op::BitOr: return ival(t, a(0).i | a(1).i);
    case Op::And: return ival(t, a(0).i && a(1).i);
    case Op::Or: return ival(t, a(0).i || a(1).i);
    case Op::Select: return a(0).i ? a(1) : a(2);
    case Op::Min: return flt ? fval(fmin_cuda(a(0).f, a(1).f)) : ival(t, std::min(a(0).i, a(1).i));
    case Op::Max: return flt ? fval(fmax_cuda(a(0).f, a(1).f)) : ival(t, std::max(a(0).i, a(1).i));
    case Op::Clamp:
      if (flt) return fval(fmin_cuda(fmax_cuda(a(0).f, a(1).f), a(2).f));
      return ival(t, std::min(std::max(a(0).i, a(1).i), a(2).i));
    case Op::Abs:
      return flt ? fval(std::fabs(a(0).f)) : ival(t, wrap32(a(0).i < 0 ? -a(0).i : a(0).i));
    case Op::Exp: return fval(math<F32>([](auto x) { return std::exp(x); }, a(0).f));
    case Op::Exp2: return fval(math<F32>([](auto x) { return std::exp2(x); }, a(0).f));
    case Op::Log: return fval(math<F32>([](auto x) { return std::log(x); }, a(0).f));
    case Op::Log2: return fval(math<F32>([](auto x) { return std::log2(x); }, a(0).f));
    case Op::Sqrt: return fval(math<F32>([](auto x) { return std::sqrt(x); }, a(0).f));
    case Op::Rsqrt:
      return fval(math<F32>([](auto x) { return decltype(x)(1) / std::sqrt(x); }, a(0).f));
    case Op::Tanh: return fval(math<F32>([](auto x) { return std::tanh(x); }, a(0).f));
    case Op::Sigmoid:
      return fval(math<F32>(
          [](auto x) { return decltype(x)(1) / (decltype(x)(1) + std::exp(-x)); }, a(0).f));
    case Op::Sin: return fval(math<F32>([](auto x) { return std::sin(x); }, a(0).f));
    case Op::Cos: return fval(math<F32>([](auto x) { return std::cos(x); }, a(0).f));
    case Op::Pow:
      if constexpr (F32)
        return fval(std::pow(static_cast<float>(a(0).f), static_cast<float>(a(1).f)));
      else
        return fval(std::pow(a(0).f, a(1).f));
    case Op::Floor: return flt ? fval(std::floor(a(0).f)) : a(0);
    case Op::Ceil: return flt ? fval(std::ceil(a(0).f)) : a(0);
    case Op::Sign:
      if (flt) {
        const double x = a(0).f;
        return fval(x > 0 ? 1.0 : x < 0 ? -1.0 : x);
      }
      return ival(t, (a(0).i > 0) - (a(0).i < 0));
    case Op::ToFloat: return fval(round_to<F32>(static_cast<double>(a(0).i)));
    case Op::ToInt: return ival(t, a(0).type == Type::Float ? saturating_int(a(0).f) : a(0).i);
    case Op::Const: case Op::Input: case Op::Param: case Op::Load: break;
  }
  throw std::invalid_argument(fmt::format("evaluate_op: '{}' is a leaf", op_name(n.op)));
}

// F32Approx's rounding point: tanh's float32 result to 11 significant bits (to nearest, ties away
// from zero), tanh.approx's error; every other result as F32 computes it.
Value approximated(const Node& n, Value v) {
  if (n.op != Op::Tanh || v.f == 0 || !std::isfinite(v.f)) return v;
  int e = 0;
  const double m = std::frexp(v.f, &e);  // |m| in [0.5, 1)
  v.f = std::ldexp(std::round(std::ldexp(m, 11)), e - 11);
  return v;
}

template <bool F32>
Value run(const Graph& g, NodeId root, const EvalEnv& env, std::vector<Value>& vals,
          bool approx = false) {
  if (root >= g.size())
    bad_env(fmt::format("root {} is not in a graph of {} nodes", root, g.size()));
  vals.resize(root + 1);
  const Node* nodes = g.nodes().data();
  for (NodeId id = 0; id <= root; ++id) {
    const Node& n = nodes[id];
    Value& out = vals[id];
    switch (n.op) {
      case Op::Const:
        out = n.type == Type::Float ? fval(round_to<F32>(n.fval))
              : n.type == Type::Int ? ival(Type::Int, wrap32(n.ival))
                                    : ival(Type::Bool, n.ival != 0);
        break;
      case Op::Input:
        out = n.input == Input::Score
                  ? fval(round_to<F32>(env.score))
                  : ival(Type::Int, wrap32(env.ints[static_cast<int>(n.input)]));
        break;
      case Op::Param: {
        if (n.slot >= env.params.size()) bad_env(fmt::format("no value for param slot {}", n.slot));
        const double p = env.params[n.slot];
        out = n.type == Type::Float ? fval(round_to<F32>(p)) : ival(n.type, saturating_int(p));
        break;
      }
      case Op::Load: out = load<F32>(n, vals.data(), env); break;
      default:
        out = apply<F32>(n, [&](int k) -> const Value& { return vals[n.args[k]]; });
        if (approx) out = approximated(n, out);
    }
  }
  return vals[root];
}

}  // namespace

int64_t load_offset(const Node& load, const Value* vals, std::span<const int64_t> shape,
                    std::span<const int64_t> strides) {
  int64_t offset = 0;
  for (int k = 0; k < load.nargs; ++k) {
    const int64_t dim = shape[k];
    int64_t i = vals[load.args[k]].i % dim;
    if (i < 0) i += dim;
    offset = strides.empty() ? offset * dim + i : offset + i * strides[k];
  }
  return offset;
}

Value evaluate(const Graph& g, NodeId root, const EvalEnv& env, Precision p,
               std::vector<Value>& scratch) {
  return p == Precision::F64 ? run<false>(g, root, env, scratch)
                             : run<true>(g, root, env, scratch, p == Precision::F32Approx);
}

Value evaluate(const Graph& g, const EvalEnv& env, Precision p, std::vector<Value>& scratch) {
  return evaluate(g, g.root, env, p, scratch);
}

Value evaluate(const Graph& g, const EvalEnv& env, Precision p) {
  std::vector<Value> scratch;
  return evaluate(g, g.root, env, p, scratch);
}

Value evaluate_op(const Node& n, std::span<const Value> args, Precision p) {
  if (args.size() != n.nargs)
    throw std::invalid_argument(fmt::format("evaluate_op: '{}' takes {} operands, got {}",
                                            op_name(n.op), n.nargs, args.size()));
  const auto arg = [&](int k) -> const Value& { return args[k]; };
  if (p == Precision::F64) return apply<false>(n, arg);
  const Value v = apply<true>(n, arg);
  return p == Precision::F32Approx ? approximated(n, v) : v;
}

}  // namespace flexc::dsl
