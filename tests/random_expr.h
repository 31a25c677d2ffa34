// Random well-typed expressions over the Graph builders, for property tests (interval soundness,
// simplifier equivalence, interpreter vs emitter). Deterministic for a given seed and options.
//
//   flexc::dsl::testing::RandomExprOptions opt;
//   opt.decls = &decls;  // its params and captures may appear
//   flexc::dsl::testing::RandomExpr gen(seed, opt);
//   Graph g;
//   g.root = gen.bool_expr(g);
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "dsl/ir.h"

namespace flexc::dsl::testing {

struct RandomExprOptions {
  // Which built-in inputs may appear (indexed by Input). Score is off: masks cannot read it.
  std::array<bool, kNumInputs> inputs = {false, true, true, true, true, true, true};
  // Params and captures that may appear, by slot (null: none). Const params are used like
  // runtime ones; the caller decides what it declares.
  const Decls* decls = nullptr;
  // Operators that may appear; empty: all. Leaves (Const, Input, Param, Load) are always allowed.
  std::vector<Op> ops;
  int max_depth = 4;
  // Integer literals are drawn from [int_lo, int_hi]; with probability `extreme_prob` one of the
  // int32 extremes (or a value near them) is used instead, to exercise wrap-around.
  int64_t int_lo = -8, int_hi = 8;
  double extreme_prob = 0.03;
  // Probability that an interior position becomes a leaf before max_depth is reached.
  double leaf_prob = 0.25;
};

class RandomExpr {
 public:
  explicit RandomExpr(uint64_t seed, RandomExprOptions options = {})
      : rng_(seed), opt_(std::move(options)) {}

  NodeId bool_expr(Graph& g) { return gen(g, Type::Bool, opt_.max_depth); }
  NodeId int_expr(Graph& g) { return gen(g, Type::Int, opt_.max_depth); }
  NodeId float_expr(Graph& g) { return gen(g, Type::Float, opt_.max_depth); }
  NodeId expr(Graph& g, Type t, int depth) { return gen(g, t, depth); }

  std::mt19937_64& rng() { return rng_; }
  const RandomExprOptions& options() const { return opt_; }

  // Uniform integer in [lo, hi] and a coin with probability p, from this generator's stream.
  int64_t uniform(int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng_);
  }
  bool chance(double p) { return std::uniform_real_distribution<double>(0, 1)(rng_) < p; }

 private:
  bool allowed(Op op) const {
    return opt_.ops.empty() || std::find(opt_.ops.begin(), opt_.ops.end(), op) != opt_.ops.end();
  }

  template <size_t N>
  bool pick(const std::array<Op, N>& candidates, Op& out) {
    std::array<Op, N> ok{};
    size_t n = 0;
    for (Op op : candidates)
      if (allowed(op)) ok[n++] = op;
    if (n == 0) return false;
    out = ok[static_cast<size_t>(uniform(0, static_cast<int64_t>(n) - 1))];
    return true;
  }

  NodeId int_literal(Graph& g) {
    if (chance(opt_.extreme_prob)) {
      constexpr int64_t mx = std::numeric_limits<int32_t>::max();
      constexpr int64_t mn = std::numeric_limits<int32_t>::min();
      static constexpr std::array<int64_t, 6> extremes = {mx, mx - 1, mn, mn + 1, 1 << 30, 31};
      return g.constant_int(extremes[static_cast<size_t>(uniform(0, extremes.size() - 1))]);
    }
    return g.constant_int(uniform(opt_.int_lo, opt_.int_hi));
  }

  NodeId float_literal(Graph& g) {
    static constexpr std::array<double, 10> specials = {0.0, -0.0, 0.5,  -1.5, 3.0,
                                                        1e-3, 100.0, -7.25, 1e30, 2.0};
    return g.constant_float(specials[static_cast<size_t>(uniform(0, specials.size() - 1))]);
  }

  // Slots of declared params / captures whose value type is `t`.
  std::vector<uint16_t> params_of(Type t) const {
    std::vector<uint16_t> out;
    if (!opt_.decls) return out;
    for (size_t i = 0; i < opt_.decls->params.size(); ++i)
      if (opt_.decls->params[i].type == t) out.push_back(static_cast<uint16_t>(i));
    return out;
  }
  std::vector<uint16_t> captures_of(Type t) const {
    std::vector<uint16_t> out;
    if (!opt_.decls) return out;
    for (size_t i = 0; i < opt_.decls->captures.size(); ++i)
      if (dtype_value_type(opt_.decls->captures[i].dtype) == t)
        out.push_back(static_cast<uint16_t>(i));
    return out;
  }

  NodeId load(Graph& g, uint16_t slot, Type t, int depth) {
    const size_t rank = opt_.decls->captures[slot].dims.size();
    std::array<NodeId, kMaxArgs> idx{};
    for (size_t i = 0; i < rank; ++i) idx[i] = gen(g, Type::Int, std::max(0, depth - 1));
    return g.load(slot, t, std::span<const NodeId>(idx.data(), rank));
  }

  NodeId leaf(Graph& g, Type t, int depth) {
    const std::vector<uint16_t> params = params_of(t);
    const std::vector<uint16_t> caps = captures_of(t);
    std::vector<Input> inputs;
    for (int i = 0; i < kNumInputs; ++i) {
      const auto in = static_cast<Input>(i);
      const Type it = in == Input::Score ? Type::Float : Type::Int;
      if (opt_.inputs[i] && t == it) inputs.push_back(in);
    }
    // Weights: literals 2, inputs 4 (they make expressions depend on the point), params 1, loads 1.
    const int64_t w_lit = 2, w_in = inputs.empty() ? 0 : 4, w_par = params.empty() ? 0 : 1,
                  w_cap = caps.empty() ? 0 : 1;
    int64_t r = uniform(0, w_lit + w_in + w_par + w_cap - 1);
    if ((r -= w_lit) < 0) {
      if (t == Type::Bool) return g.constant_bool(chance(0.5));
      return t == Type::Int ? int_literal(g) : float_literal(g);
    }
    if ((r -= w_in) < 0) return g.input(inputs[static_cast<size_t>(uniform(0, inputs.size() - 1))]);
    if ((r -= w_par) < 0) return g.param(params[static_cast<size_t>(uniform(0, params.size() - 1))], t);
    return load(g, caps[static_cast<size_t>(uniform(0, caps.size() - 1))], t, depth);
  }

  // An operand of a float op: usually Float, sometimes Int (exercises promotion).
  NodeId numeric(Graph& g, Type t, int depth) {
    if (t == Type::Float && chance(0.3)) return gen(g, Type::Int, depth);
    return gen(g, t, depth);
  }

  NodeId gen(Graph& g, Type t, int depth) {
    if (depth <= 0 || chance(opt_.leaf_prob)) return leaf(g, t, depth);
    const int d = depth - 1;
    Op op{};
    switch (t) {
      case Type::Bool: {
        static constexpr std::array<Op, 12> ops = {Op::Lt, Op::Le, Op::Gt,    Op::Ge,
                                                   Op::Eq, Op::Ne, Op::And,   Op::Or,
                                                   Op::Not, Op::Select, Op::BitAnd, Op::BitOr};
        if (!pick(ops, op)) return leaf(g, t, depth);
        switch (op) {
          case Op::Not: return g.unary(op, gen(g, t, d));
          case Op::And: case Op::Or: case Op::BitAnd: case Op::BitOr:
            return g.binary(op, gen(g, t, d), gen(g, t, d));
          case Op::Select: return g.ternary(op, gen(g, t, d), gen(g, t, d), gen(g, t, d));
          default: {
            // Comparisons: mostly of ints (what masks compare), sometimes of floats.
            const Type ct = chance(0.8) ? Type::Int : Type::Float;
            return g.binary(op, numeric(g, ct, d), numeric(g, ct, d));
          }
        }
      }
      case Type::Int: {
        // Add appears twice: offsets like `q_idx + c` are what masks are made of.
        static constexpr std::array<Op, 20> ops = {
            Op::Neg,    Op::BitNot, Op::Abs,    Op::Sign,   Op::ToInt,  Op::Add,   Op::Sub,
            Op::Mul,    Op::FloorDiv, Op::Mod,  Op::Shl,    Op::Shr,    Op::BitAnd, Op::BitXor,
            Op::BitOr,  Op::Min,    Op::Max,    Op::Clamp,  Op::Select, Op::Add};
        if (!pick(ops, op)) return leaf(g, t, depth);
        switch (op) {
          case Op::Neg: case Op::BitNot: case Op::Abs: case Op::Sign:
            return g.unary(op, gen(g, t, d));
          case Op::ToInt: return g.unary(op, gen(g, Type::Float, d));
          case Op::Clamp: return g.ternary(op, gen(g, t, d), gen(g, t, d), gen(g, t, d));
          case Op::Select: return g.ternary(op, gen(g, Type::Bool, d), gen(g, t, d), gen(g, t, d));
          default: return g.binary(op, gen(g, t, d), gen(g, t, d));
        }
      }
      case Type::Float: {
        // Add appears twice, as for Int.
        static constexpr std::array<Op, 28> ops = {
            Op::Neg,  Op::Abs,  Op::Exp,   Op::Exp2,  Op::Log,     Op::Log2,     Op::Sqrt,
            Op::Rsqrt, Op::Tanh, Op::Sigmoid, Op::Sin, Op::Cos,    Op::Floor,    Op::Ceil,
            Op::Sign, Op::ToFloat, Op::Add, Op::Sub,  Op::Mul,     Op::Div,      Op::FloorDiv,
            Op::Mod,  Op::Min,  Op::Max,   Op::Pow,   Op::Clamp,   Op::Select,   Op::Add};
        if (!pick(ops, op)) return leaf(g, t, depth);
        switch (op) {
          case Op::ToFloat: return g.to_float(gen(g, Type::Int, d));
          case Op::Neg: case Op::Abs: case Op::Exp: case Op::Exp2: case Op::Log: case Op::Log2:
          case Op::Sqrt: case Op::Rsqrt: case Op::Tanh: case Op::Sigmoid: case Op::Sin:
          case Op::Cos: case Op::Floor: case Op::Ceil: case Op::Sign:
            return g.unary(op, gen(g, t, d));
          case Op::Clamp:
            return g.ternary(op, numeric(g, t, d), gen(g, t, d), numeric(g, t, d));
          case Op::Select: return g.ternary(op, gen(g, Type::Bool, d), gen(g, t, d), numeric(g, t, d));
          // Div promotes both sides to Float itself; either side may be Int.
          default: return g.binary(op, numeric(g, t, d), gen(g, t, d));
        }
      }
    }
    return leaf(g, t, depth);
  }

  std::mt19937_64 rng_;
  RandomExprOptions opt_;
};

}  // namespace flexc::dsl::testing
