// IR passes: interpreter semantics, simplifier, dependencies, derivatives.
#include <bit>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <random>

#include "dsl/analysis.h"
#include "dsl/frontend.h"
#include "random_expr.h"
#include "test_random.h"

using namespace flexc::dsl;

namespace {

constexpr int64_t kIntMin = std::numeric_limits<int32_t>::min();
constexpr int64_t kIntMax = std::numeric_limits<int32_t>::max();
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNan = std::numeric_limits<double>::quiet_NaN();

using flexc::testing::rng;
double uniform(double lo, double hi) {
  return std::uniform_real_distribution<double>(lo, hi)(rng());
}
int64_t uniform_int(int64_t lo, int64_t hi) {
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng());
}

bool same_bits(const Value& a, const Value& b) {
  if (a.type != b.type) return false;
  if (a.type != Type::Float) return a.i == b.i;
  if (std::isnan(a.f) || std::isnan(b.f)) return std::isnan(a.f) && std::isnan(b.f);
  return std::bit_cast<uint64_t>(a.f) == std::bit_cast<uint64_t>(b.f);
}

std::string show(const Value& v) {
  if (v.type == Type::Float) return std::to_string(v.f) + (std::signbit(v.f) ? " (sign set)" : "");
  return std::string(type_name(v.type)) + " " + std::to_string(v.i);
}

// Inputs by name for EvalEnv.ints.
EvalEnv env_at(int64_t b, int64_t h, int64_t q, int64_t kv, double score = 0) {
  EvalEnv e;
  e.ints[static_cast<int>(Input::B)] = b;
  e.ints[static_cast<int>(Input::H)] = h;
  e.ints[static_cast<int>(Input::QIdx)] = q;
  e.ints[static_cast<int>(Input::KvIdx)] = kv;
  e.ints[static_cast<int>(Input::QLen)] = 1024;
  e.ints[static_cast<int>(Input::KvLen)] = 2048;
  e.score = score;
  return e;
}

Value eval_at(const Graph& g, NodeId root, const EvalEnv& env, Precision p = Precision::F64) {
  std::vector<Value> scratch;
  return evaluate(g, root, env, p, scratch);
}

// `op` applied to two runtime ints (q_idx, kv_idx), so nothing is folded.
Value int_binary(Op op, int64_t a, int64_t b) {
  Graph g;
  const NodeId r = g.binary(op, g.input(Input::QIdx), g.input(Input::KvIdx));
  return eval_at(g, r, env_at(0, 0, a, b));
}

// `op` applied to two runtime floats: score and a Float param.
Value float_binary(Op op, double a, double b, Precision p = Precision::F64) {
  Graph g;
  const NodeId r = g.binary(op, g.input(Input::Score), g.param(0, Type::Float));
  const double params[1] = {b};
  EvalEnv e = env_at(0, 0, 0, 0, a);
  e.params = params;
  return eval_at(g, r, e, p);
}

Value float_unary(Op op, double a, Precision p = Precision::F64) {
  Graph g;
  const NodeId r = g.unary(op, g.input(Input::Score));
  return eval_at(g, r, env_at(0, 0, 0, 0, a), p);
}

}  // namespace

TEST_CASE("interpreter: integer semantics", "[analysis][interp]") {
  struct Row {
    Op op;
    int64_t a, b, want;
  };
  const Row rows[] = {
      // floored division and modulo, including negatives and zero divisors
      {Op::FloorDiv, 7, 2, 3},         {Op::FloorDiv, -7, 2, -4},     {Op::FloorDiv, 7, -2, -4},
      {Op::FloorDiv, -7, -2, 3},       {Op::FloorDiv, -6, 2, -3},     {Op::FloorDiv, 5, 0, 0},
      {Op::FloorDiv, -5, 0, 0},        {Op::FloorDiv, kIntMin, -1, kIntMin},
      {Op::Mod, 7, 2, 1},              {Op::Mod, -7, 2, 1},           {Op::Mod, 7, -2, -1},
      {Op::Mod, -7, -2, -1},           {Op::Mod, -6, 3, 0},           {Op::Mod, 5, 0, 0},
      {Op::Mod, kIntMin, -1, 0},       {Op::Mod, -1, kIntMax, kIntMax - 1},
      // int32 wrap-around
      {Op::Add, kIntMax, 1, kIntMin},  {Op::Sub, kIntMin, 1, kIntMax},
      {Op::Mul, kIntMin, -1, kIntMin},
      {Op::Mul, 65536, 65536, 0},      {Op::Mul, 46341, 46341, -2147479015},
      // shifts: count modulo 32, >> arithmetic
      {Op::Shl, 1, 33, 2},             {Op::Shl, 1, 31, kIntMin},     {Op::Shl, 1, -1, kIntMin},
      {Op::Shl, 3, 32, 3},             {Op::Shr, -8, 1, -4},          {Op::Shr, -1, 40, -1},
      {Op::Shr, kIntMin, 31, -1},      {Op::Shr, 256, 36, 16},
      // bitwise, min/max
      {Op::BitAnd, -4, 7, 4},          {Op::BitOr, 8, 3, 11},         {Op::BitXor, -1, 5, -6},
      {Op::Min, -3, 2, -3},            {Op::Max, -3, 2, 2},
  };
  for (const Row& r : rows) {
    INFO(op_name(r.op) << "(" << r.a << ", " << r.b << ")");
    const Value v = int_binary(r.op, r.a, r.b);
    CHECK(v.type == Type::Int);
    CHECK(v.i == r.want);
  }
  // comparisons give Bool
  CHECK(int_binary(Op::Lt, -1, 0).type == Type::Bool);
  CHECK(int_binary(Op::Lt, -1, 0).i == 1);
  CHECK(int_binary(Op::Ge, -1, 0).i == 0);

  // unary: wrap of - and abs at INT_MIN, ~, sign
  Graph g;
  const NodeId q = g.input(Input::QIdx);
  const NodeId neg = g.unary(Op::Neg, q), abs = g.unary(Op::Abs, q), bnot = g.unary(Op::BitNot, q),
               sign = g.unary(Op::Sign, q);
  CHECK(eval_at(g, neg, env_at(0, 0, kIntMin, 0)).i == kIntMin);
  CHECK(eval_at(g, abs, env_at(0, 0, kIntMin, 0)).i == kIntMin);
  CHECK(eval_at(g, abs, env_at(0, 0, -5, 0)).i == 5);
  CHECK(eval_at(g, bnot, env_at(0, 0, 5, 0)).i == -6);
  CHECK(eval_at(g, sign, env_at(0, 0, -5, 0)).i == -1);
  CHECK(eval_at(g, sign, env_at(0, 0, 0, 0)).i == 0);
  CHECK(eval_at(g, sign, env_at(0, 0, 9, 0)).i == 1);
  // inputs are int32: a value outside wraps as the kernel's int would
  CHECK(eval_at(g, q, env_at(0, 0, kIntMax + 1, 0)).i == kIntMin);
}

TEST_CASE("interpreter: float semantics and promotion", "[analysis][interp]") {
  // true division of ints gives a float; ints promote in mixed arithmetic
  Graph g;
  const NodeId q = g.input(Input::QIdx), kv = g.input(Input::KvIdx);
  const NodeId div = g.binary(Op::Div, q, kv);
  CHECK(g[div].type == Type::Float);
  CHECK(eval_at(g, div, env_at(0, 0, 7, 2)).f == 3.5);
  CHECK(eval_at(g, div, env_at(0, 0, -7, 2)).f == -3.5);
  const NodeId mixed = g.binary(Op::Add, q, g.constant_float(0.5));
  CHECK(g[mixed].type == Type::Float);
  CHECK(eval_at(g, mixed, env_at(0, 0, 3, 0)).f == 3.5);
  const NodeId cmp = g.binary(Op::Lt, q, g.constant_float(2.5));
  CHECK(eval_at(g, cmp, env_at(0, 0, 2, 0)).i == 1);
  CHECK(eval_at(g, cmp, env_at(0, 0, 3, 0)).i == 0);

  // float // is floor(a / b), % is a - b * floor(a / b)
  CHECK(float_binary(Op::FloorDiv, -7.0, 2.0).f == -4.0);
  CHECK(float_binary(Op::FloorDiv, 7.5, -2.0).f == -4.0);
  CHECK(float_binary(Op::Mod, -7.0, 2.0).f == 1.0);
  CHECK(float_binary(Op::Mod, 7.5, -2.0).f == -0.5);
  CHECK(float_binary(Op::Mod, 5.25, 2.0).f == 1.25);
  CHECK(std::isinf(float_binary(Op::FloorDiv, 1.0, 0.0).f));
  CHECK(std::isnan(float_binary(Op::Mod, 1.0, 0.0).f));

  // min / max ignore a NaN operand (fminf / fmaxf); -0.0 < +0.0
  CHECK(float_binary(Op::Min, kNan, 1.0).f == 1.0);
  CHECK(float_binary(Op::Min, 1.0, kNan).f == 1.0);
  CHECK(float_binary(Op::Max, kNan, -1.0).f == -1.0);
  CHECK(std::isnan(float_binary(Op::Max, kNan, kNan).f));
  CHECK(std::signbit(float_binary(Op::Min, 0.0, -0.0).f));
  CHECK(std::signbit(float_binary(Op::Min, -0.0, 0.0).f));
  CHECK_FALSE(std::signbit(float_binary(Op::Max, -0.0, 0.0).f));
  CHECK_FALSE(std::signbit(float_binary(Op::Max, 0.0, -0.0).f));

  // sign keeps ±0 and NaN
  CHECK(float_unary(Op::Sign, -3.5).f == -1.0);
  CHECK(float_unary(Op::Sign, 1e-30).f == 1.0);
  CHECK(std::signbit(float_unary(Op::Sign, -0.0).f));
  CHECK(float_unary(Op::Sign, -0.0).f == 0.0);
  CHECK(std::isnan(float_unary(Op::Sign, kNan).f));
  CHECK(float_unary(Op::Floor, -2.5).f == -3.0);
  CHECK(float_unary(Op::Ceil, -2.5).f == -2.0);
  CHECK(float_unary(Op::Sigmoid, 0.0).f == 0.5);
  CHECK(float_unary(Op::Rsqrt, 4.0).f == 0.5);
  CHECK(float_unary(Op::Abs, -0.0).f == 0.0);
  CHECK_FALSE(std::signbit(float_unary(Op::Abs, -0.0).f));

  // int(): truncation toward zero, saturation, NaN -> 0
  const std::pair<double, int64_t> to_int[] = {
      {2.7, 2}, {-2.7, -2}, {-0.5, 0}, {1e30, kIntMax}, {-1e30, kIntMin}, {kInf, kIntMax},
      {-kInf, kIntMin}, {kNan, 0}, {2147483647.0, kIntMax}, {2147483648.0, kIntMax},
      {-2147483648.0, kIntMin}, {-2147483649.0, kIntMin}};
  for (auto [x, want] : to_int) {
    INFO("int(" << x << ")");
    CHECK(float_unary(Op::ToInt, x).i == want);
  }

  // clamp = min(max(x, lo), hi)
  Graph c;
  const NodeId cl = c.ternary(Op::Clamp, c.input(Input::Score), c.constant_float(-1.0),
                              c.constant_float(2.0));
  CHECK(eval_at(c, cl, env_at(0, 0, 0, 0, 5.0)).f == 2.0);
  CHECK(eval_at(c, cl, env_at(0, 0, 0, 0, -5.0)).f == -1.0);
  CHECK(eval_at(c, cl, env_at(0, 0, 0, 0, 0.25)).f == 0.25);
  CHECK(eval_at(c, cl, env_at(0, 0, 0, 0, kNan)).f == -1.0);
}

TEST_CASE("interpreter: F32 rounds every float op, F64 does not", "[analysis][interp]") {
  const double s = uniform(0.5, 2.0);
  // (s + 1e-8) - s: lost entirely in float32, kept in float64
  Graph g;
  const NodeId sc = g.input(Input::Score);
  const NodeId r = g.binary(Op::Sub, g.binary(Op::Add, sc, g.constant_float(1e-8)), sc);
  const double f64 = eval_at(g, r, env_at(0, 0, 0, 0, s)).f;
  const double f32 = eval_at(g, r, env_at(0, 0, 0, 0, s), Precision::F32).f;
  CHECK(f64 == Approx(1e-8).epsilon(1e-6));
  const float sf = static_cast<float>(s);
  CHECK(f32 == static_cast<double>((sf + 1e-8f) - sf));

  // float math functions in F32
  for (Op op : {Op::Exp, Op::Tanh, Op::Log, Op::Sqrt, Op::Sin}) {
    INFO(op_name(op));
    const double x = uniform(0.1, 3.0);
    const float xf = static_cast<float>(x);
    const float want = op == Op::Exp    ? std::exp(xf)
                       : op == Op::Tanh ? std::tanh(xf)
                       : op == Op::Log  ? std::log(xf)
                       : op == Op::Sqrt ? std::sqrt(xf)
                                        : std::sin(xf);
    CHECK(float_unary(op, x, Precision::F32).f == static_cast<double>(want));
    CHECK(float_unary(op, x).f != static_cast<double>(want));  // float64 differs
  }

  // promotion of a large int: exact in F64, rounded to float32 in F32
  Graph p;
  const NodeId pf = p.to_float(p.input(Input::QIdx));
  CHECK(eval_at(p, pf, env_at(0, 0, 16777217, 0)).f == 16777217.0);
  CHECK(eval_at(p, pf, env_at(0, 0, 16777217, 0), Precision::F32).f == 16777216.0);

  // constants and float params enter as float32 values in F32
  CHECK(float_binary(Op::Mul, 1.0, 0.1).f == 0.1);
  CHECK(float_binary(Op::Mul, 1.0, 0.1, Precision::F32).f == static_cast<double>(0.1f));

  // F32Approx: F32 with tanh's result to 11 significant bits (tanh.approx's error), nothing else
  for (int i = 0; i < 100; ++i) {
    const double x = uniform(-4.0, 4.0);
    const double t32 = float_unary(Op::Tanh, x, Precision::F32).f;
    const double t11 = float_unary(Op::Tanh, x, Precision::F32Approx).f;
    INFO(x << ": " << t32 << " -> " << t11);
    CHECK(std::fabs(t11 - t32) <= std::ldexp(std::fabs(t32), -11));
    int e = 0;
    const double m = std::frexp(t11, &e);
    CHECK(std::ldexp(m, 11) == std::round(std::ldexp(m, 11)));  // 11 bits
    CHECK(float_unary(Op::Exp, x, Precision::F32Approx).f ==
          float_unary(Op::Exp, x, Precision::F32).f);
  }
  CHECK(float_unary(Op::Tanh, 0.0, Precision::F32Approx).f == 0.0);
  CHECK(float_unary(Op::Tanh, 20.0, Precision::F32Approx).f == 1.0);
}

namespace {

// Owns captured tensors for an EvalEnv.
struct Captures {
  std::vector<std::vector<uint8_t>> storage;
  std::vector<HostTensor> tensors;

  template <class T>
  void add(DType dt, const std::vector<T>& data, std::vector<int64_t> shape,
           std::vector<int64_t> strides = {}) {
    storage.emplace_back(data.size() * sizeof(T));
    std::memcpy(storage.back().data(), data.data(), data.size() * sizeof(T));
    tensors.push_back(HostTensor{dt, nullptr, std::move(shape), std::move(strides)});
    for (size_t i = 0; i < tensors.size(); ++i) tensors[i].data = storage[i].data();
  }
};

int64_t wrap_index(int64_t i, int64_t dim) { return ((i % dim) + dim) % dim; }

}  // namespace

TEST_CASE("interpreter: capture indexing wraps, strides, ranks 1-4", "[analysis][interp]") {
  for (int rank = 1; rank <= 4; ++rank) {
    for (bool strided : {false, true}) {
      INFO("rank " << rank << (strided ? " strided" : " contiguous"));
      std::vector<int64_t> shape(rank), strides;
      for (auto& d : shape) d = uniform_int(1, 5);
      // Strided: a view whose dims are laid out in reverse order with padding, as a
      // transposed slice of a bigger tensor would be.
      int64_t size = 1;
      if (strided) {
        strides.assign(rank, 0);
        for (int k = 0; k < rank; ++k) {
          strides[k] = size;
          size *= shape[k] + 1;
        }
      } else {
        for (auto d : shape) size *= d;
      }
      std::vector<float> data(size);
      for (auto& x : data) x = static_cast<float>(uniform(-10, 10));
      Captures caps;
      caps.add(DType::F32, data, shape, strides);

      Graph g;
      const NodeId idx[4] = {g.input(Input::B), g.input(Input::H), g.input(Input::QIdx),
                             g.input(Input::KvIdx)};
      const NodeId ld = g.load(0, Type::Float, std::span(idx, rank));
      std::vector<Value> scratch;
      for (int trial = 0; trial < 200; ++trial) {
        int64_t in[4];
        for (auto& i : in)
          i = trial % 4 == 0 ? uniform_int(kIntMin, kIntMax) : uniform_int(-12, 12);
        EvalEnv e = env_at(in[0], in[1], in[2], in[3]);
        e.captures = caps.tensors;
        int64_t off = 0;
        for (int k = 0; k < rank; ++k) {
          const int64_t w = wrap_index(in[k], shape[k]);
          off = strided ? off + w * strides[k] : off * shape[k] + w;
        }
        CHECK(evaluate(g, ld, e, Precision::F64, scratch).f == static_cast<double>(data[off]));
      }
    }
  }
}

TEST_CASE("interpreter: capture dtypes decode", "[analysis][interp]") {
  Graph g;
  const NodeId i0 = g.input(Input::KvIdx);
  const NodeId lf = g.load(0, Type::Float, std::span(&i0, 1));
  const NodeId li = g.load(1, Type::Int, std::span(&i0, 1));
  const NodeId lb = g.load(2, Type::Bool, std::span(&i0, 1));

  const auto decode = [&](DType dt, uint16_t bits) {
    Captures caps;
    caps.add(dt, std::vector<uint16_t>{bits}, {1});
    caps.add(DType::I32, std::vector<int32_t>{0}, {1});
    caps.add(DType::Bool, std::vector<uint8_t>{0}, {1});
    EvalEnv e = env_at(0, 0, 0, 0);
    e.captures = caps.tensors;
    return eval_at(g, lf, e).f;
  };
  // bf16: the top half of a float32
  CHECK(decode(DType::BF16, 0x3F80) == 1.0);
  CHECK(decode(DType::BF16, 0xC040) == -3.0);
  CHECK(decode(DType::BF16, 0x3E20) == 0.15625);
  CHECK(decode(DType::BF16, 0xFF80) == -kInf);
  CHECK(std::isnan(decode(DType::BF16, 0x7FC0)));
  CHECK(decode(DType::BF16, 0x0001) == std::ldexp(1.0, -133));
  for (int t = 0; t < 1000; ++t) {
    const float f = static_cast<float>(uniform(-1e6, 1e6));
    const auto hi = static_cast<uint16_t>(std::bit_cast<uint32_t>(f) >> 16);
    CHECK(decode(DType::BF16, hi) == static_cast<double>(std::bit_cast<float>(uint32_t{hi} << 16)));
  }
  // fp16: known values, then every bit pattern against the compiler's _Float16 where it has one
  CHECK(decode(DType::F16, 0x3C00) == 1.0);
  CHECK(decode(DType::F16, 0xC000) == -2.0);
  CHECK(decode(DType::F16, 0x3555) == 0.333251953125);
  CHECK(decode(DType::F16, 0x7BFF) == 65504.0);
  CHECK(decode(DType::F16, 0x0001) == std::ldexp(1.0, -24));
  CHECK(decode(DType::F16, 0x03FF) == 1023 * std::ldexp(1.0, -24));
  CHECK(decode(DType::F16, 0x7C00) == kInf);
  CHECK(decode(DType::F16, 0xFC00) == -kInf);
  CHECK(std::isnan(decode(DType::F16, 0x7E00)));
  CHECK(std::signbit(decode(DType::F16, 0x8000)));
#if defined(__FLT16_MAX__)
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const double want = static_cast<double>(std::bit_cast<_Float16>(static_cast<uint16_t>(bits)));
    const double got = decode(DType::F16, static_cast<uint16_t>(bits));
    if (!same_bits(Value{Type::Float, 0, got}, Value{Type::Float, 0, want}))
      FAIL("fp16 bits " << bits << ": got " << got << ", want " << want);
  }
#endif

  // int32 and bool (a byte, nonzero = true)
  Captures caps;
  caps.add(DType::F32, std::vector<float>{0}, {1});
  caps.add(DType::I32, std::vector<int32_t>{-5, kIntMax, 7}, {3});
  caps.add(DType::Bool, std::vector<uint8_t>{0, 1, 2, 255}, {4});
  EvalEnv e = env_at(0, 0, 0, 0);
  e.captures = caps.tensors;
  const int64_t ints[] = {-5, kIntMax, 7};
  const int64_t bools[] = {0, 1, 1, 1};
  for (int64_t i = -8; i < 8; ++i) {
    e.ints[static_cast<int>(Input::KvIdx)] = i;
    CHECK(eval_at(g, li, e).i == ints[wrap_index(i, 3)]);
    CHECK(eval_at(g, lb, e).type == Type::Bool);
    CHECK(eval_at(g, lb, e).i == bools[wrap_index(i, 4)]);
  }
}

TEST_CASE("interpreter: an environment that does not fit is an error", "[analysis][interp]") {
  Graph g;
  const NodeId i0 = g.input(Input::KvIdx);
  const NodeId lf = g.load(0, Type::Float, std::span(&i0, 1));
  const NodeId par = g.binary(Op::Add, lf, g.param(0, Type::Float));
  EvalEnv e = env_at(0, 0, 0, 0);
  CHECK_THROWS_WITH(eval_at(g, lf, e), Catch::Contains("capture slot 0"));
  Captures caps;
  caps.add(DType::I32, std::vector<int32_t>{1}, {1});
  e.captures = caps.tensors;
  CHECK_THROWS_WITH(eval_at(g, lf, e), Catch::Contains("int32"));
  Captures ok;
  ok.add(DType::F32, std::vector<float>{1}, {1});
  e.captures = ok.tensors;
  CHECK(eval_at(g, lf, e).f == 1.0);
  CHECK_THROWS_WITH(eval_at(g, par, e), Catch::Contains("param slot 0"));
  Captures empty;
  empty.add(DType::F32, std::vector<float>{1}, {0});
  e.captures = empty.tensors;
  CHECK_THROWS_WITH(eval_at(g, lf, e), Catch::Contains("empty dimension"));
}

// ---- mods as text

namespace {

// What the text-based tests declare, with host tensors to evaluate against (H = 4).
struct World {
  Decls decls;
  Captures caps;
  std::vector<double> params;

  World() {
    const Dim H{Dim::H, 0};
    decls.captures = {
        {"slope", DType::F32, {H}},
        {"bias", DType::F32, {H, Dim{Dim::Fixed, 129}}},
        {"table", DType::F32, {Dim{Dim::Fixed, 4}, Dim{Dim::Fixed, 4}}},
        {"half_bias", DType::BF16, {H}},
        {"ids", DType::I32, {Dim{Dim::KvLen, 0}}},
    };
    decls.params = {{"scale", Type::Float, 0.5, false}, {"window", Type::Int, 16, false}};
    params = {uniform(0.25, 1.0), 16};
    const auto floats = [](size_t n) {
      std::vector<float> v(n);
      for (auto& x : v) x = static_cast<float>(uniform(-2, 2));
      return v;
    };
    caps.add(DType::F32, floats(4), {4});
    caps.add(DType::F32, floats(4 * 129), {4, 129});
    caps.add(DType::F32, floats(16), {4, 4});
    std::vector<uint16_t> hb(4);
    for (auto& x : hb)
      x = static_cast<uint16_t>(std::bit_cast<uint32_t>(static_cast<float>(uniform(-2, 2))) >> 16);
    caps.add(DType::BF16, hb, {4});
    std::vector<int32_t> ids(64);
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i / 16);
    caps.add(DType::I32, ids, {64});
  }

  Mod parse(ModKind kind, std::string_view text) const {
    return parse_mod(kind, text, decls, kind == ModKind::Score ? "score_mod" : "mask_mod");
  }

  EvalEnv env(int64_t b, int64_t h, int64_t q, int64_t kv, double score) const {
    EvalEnv e = env_at(b, h, q, kv, score);
    e.ints[static_cast<int>(Input::QLen)] = 64;
    e.ints[static_cast<int>(Input::KvLen)] = 64;
    e.params = params;
    e.captures = caps.tensors;
    return e;
  }
  EvalEnv random_env() const {
    return env(uniform_int(0, 1), uniform_int(0, 3), uniform_int(0, 63), uniform_int(0, 63),
               uniform(-8, 8));
  }
};

double eval_f(const Graph& g, NodeId root, const EvalEnv& e, Precision p = Precision::F64) {
  std::vector<Value> scratch;
  return evaluate(g, root, e, p, scratch).f;
}

std::string simplified_text(const World& w, ModKind kind, std::string_view text) {
  const Graph s = simplify(w.parse(kind, text).graph);
  return to_text(s, s.root, w.decls);
}

}  // namespace

TEST_CASE("interpreter: semantics through the front end", "[analysis][interp]") {
  const World w;
  struct Row {
    const char* text;
    int64_t q, kv;
    double want;
  };
  const Row rows[] = {
      {"float((q_idx - kv_idx) % 2)", 0, 1, 1},         // floored: -1 % 2 == 1
      {"float((q_idx - kv_idx) // 4)", 0, 1, -1},       // floored: -1 // 4 == -1
      {"float(q_idx // (kv_idx - 3))", 5, 3, 0},  // x // 0 == 0 (zero at run time)
      {"float(q_idx % (kv_idx - 3))", 5, 3, 0},   // x % 0 == 0
      {"q_idx / kv_idx", 7, 2, 3.5},                     // true division
      {"q_idx + 0.25", 7, 2, 7.25},                      // promotion
      {"float(int(-2.5 * q_idx))", 1, 0, -2},           // truncation
      {"float(q_idx * 65536 * 32768)", 1, 0, -2147483648.0},  // wrap
      {"float(-1 >> q_idx)", 40, 0, -1},                // arithmetic shift, count % 32
      {"float(q_idx << kv_idx)", 3, 33, 6},
      {"where(q_idx >= kv_idx, score, -inf)", 1, 2, -kInf},
      {"float(q_len - kv_len)", 0, 0, 0},
      {"-7.0 % 2.0 + score * 0.0", 0, 0, 1},
      {"min(q_idx, kv_idx) + max(score, 2.0)", 4, 9, 6},
      {"slope[h + 4] - slope[h - 4]", 0, 0, 0},          // index wraps
  };
  for (const Row& r : rows) {
    INFO(r.text);
    const Mod m = w.parse(ModKind::Score, r.text);
    for (Precision p : {Precision::F64, Precision::F32}) {
      CHECK(eval_f(m.graph, m.graph.root, w.env(0, 1, r.q, r.kv, 0.5), p) == r.want);
    }
  }
}

TEST_CASE("simplify: exact identities only", "[analysis][simplify]") {
  const World w;
  const auto score = [&](std::string_view t) { return simplified_text(w, ModKind::Score, t); };
  const auto mask = [&](std::string_view t) { return simplified_text(w, ModKind::Mask, t); };
  // float identities that hold for every value, signed zeros and NaN included
  CHECK(score("score * 1.0") == "score");
  CHECK(score("1.0 * score") == "score");
  CHECK(score("score / 1.0") == "score");
  CHECK(score("score - 0.0") == "score");
  CHECK(score("score + -0.0") == "score");
  CHECK(score("-(-score)") == "score");
  CHECK(score("score * -1.0") == "-score");
  CHECK(score("score - -scale") == "score + scale");
  CHECK(score("-score * -scale") == "score * scale");
  // ... and those that do not: -0.0 + 0.0 == +0.0, NaN * 0.0, inf - inf, NaN != NaN
  CHECK(score("score + 0.0") == "score + 0.0");
  CHECK(score("score * 0.0") == "score * 0.0");
  CHECK(score("score - score") == "score - score");
  CHECK(score("0.0 - score") == "0.0 - score");
  CHECK(score("where(score == score, score, 0.0)") == "score == score ? score : 0.0");
  CHECK(score("min(score, score)") == "score");
  // integer identities (int32 wrap-around makes them exact)
  CHECK(score("score + float(q_idx * 0)") == "score + 0.0");
  CHECK(score("score + float(q_idx - q_idx)") == "score + 0.0");
  CHECK(score("score * float(1 * (q_idx + 0) // 1)") == "score * float(q_idx)");
  CHECK(score("score * float((0 - q_idx) << 32)") == "score * float(-q_idx)");
  CHECK(score("score * float(~~q_idx ^ 0)") == "score * float(q_idx)");
  CHECK(score("score * float(q_idx << 16 >> 64)") == "score * float(q_idx << 16)");
  CHECK(score("score * float(q_idx % 1)") == "score * 0.0");
  CHECK(score("where(q_idx == q_idx, score, 0.0)") == "score");
  // constant folding: exact float folds, every int fold, no transcendental folds
  CHECK(score("score * (2.0 * 3.0)") == "score * 6.0");
  CHECK(score("score * (2.0 * 3.25 - 0.5)") == "score * 6.0");
  CHECK(score("score * float(3)") == "score * 3.0");
  CHECK(score("score + float(7 // -2 + 7 % -2)") == "score + -5.0");
  CHECK(score("score * float((1 << 31) - 1)") == "score * float(2147483647)");
  CHECK(score("score * float(16777217)") == "score * float(16777217)");
  CHECK(score("score * (0.1 * 3.0)") == "score * (0.1 * 3.0)");
  CHECK(score("score * 0.1") == "score * 0.1");
  CHECK(score("score + exp(0.0)") == "score + exp(0.0)");
  CHECK(score("score + sqrt(4.0)") == "score + sqrt(4.0)");
  CHECK(score("score + min(2.0, -inf) + max(nan, 1.0)") == "score + -inf + 1.0");
  CHECK(score("where(2 > 1, score, -inf)") == "score");
  // logic
  CHECK(mask("true && q_idx >= kv_idx") == "q_idx >= kv_idx");
  CHECK(mask("q_idx >= kv_idx && true") == "q_idx >= kv_idx");
  CHECK(mask("false || q_idx >= kv_idx") == "q_idx >= kv_idx");
  CHECK(mask("false && q_idx >= kv_idx") == "false");
  CHECK(mask("q_idx >= kv_idx || true") == "true");
  CHECK(mask("q_idx == q_idx") == "true");
  CHECK(mask("q_idx != q_idx || b < b") == "false");
  CHECK(mask("!(q_idx < kv_idx)") == "q_idx >= kv_idx");
  CHECK(mask("!!(q_idx < kv_idx)") == "q_idx < kv_idx");
  CHECK(mask("!(float(q_idx) < 1.5)") == "!(float(q_idx) < 1.5)");
  CHECK(mask("where(q_idx > kv_idx, true, false)") == "q_idx > kv_idx");
  CHECK(mask("where(q_idx > kv_idx, false, true)") == "q_idx <= kv_idx");
  CHECK(mask("where(!(b > 0), q_idx > 1, h > 1)") == "b <= 0 ? q_idx > 1 : h > 1");
  CHECK(mask("where(!(float(b) > 0.5), q_idx > 1, h > 1)") == "float(b) > 0.5 ? h > 1 : q_idx > 1");
  CHECK(mask("where(b > 0, where(h > 0, q_idx > 1, kv_idx > 1), kv_idx > 1)") ==
        "b > 0 && h > 0 ? q_idx > 1 : kv_idx > 1");
  CHECK(mask("where(b > 0, q_idx > 1, where(h > 0, q_idx > 1, kv_idx > 1))") ==
        "b > 0 || h > 0 ? q_idx > 1 : kv_idx > 1");
}

TEST_CASE("simplify: keeps only reachable nodes and their source ranges", "[analysis][simplify]") {
  const World w;
  const Mod m = w.parse(ModKind::Score, "let unused = exp(score) * 3.0; tanh(score) * 1.0 + q_idx");
  const Graph s = simplify(m.graph);
  CHECK(to_text(s, s.root, w.decls) == "tanh(score) + float(q_idx)");
  CHECK(s.size() == 5);  // score, tanh, q_idx, float(q_idx), +
  const Node& root = s[s.root];
  const Node& before = m.graph[m.graph.root];
  CHECK(root.src.begin == before.src.begin);
  CHECK(root.src.end == before.src.end);
  CHECK_FALSE(root.src.empty());
  // the surviving tanh keeps its own range
  const Node& th = s[root.args[0]];
  REQUIRE(th.op == Op::Tanh);
  CHECK(m.source.substr(th.src.begin, th.src.end - th.src.begin) == "tanh(score)");
}

namespace {

// The checker's typing rules that the passes rely on (the generator does not always follow them:
// it may put an int input where a bool is wanted).
bool well_typed(const Graph& g) {
  for (const Node& n : g.nodes()) {
    const auto arg = [&](int k) { return g[n.args[k]].type; };
    switch (n.op) {
      case Op::Not: case Op::And: case Op::Or:
        for (int k = 0; k < n.nargs; ++k)
          if (arg(k) != Type::Bool) return false;
        break;
      case Op::Select:
        if (arg(0) != Type::Bool || arg(1) != n.type || arg(2) != n.type) return false;
        break;
      case Op::BitAnd: case Op::BitOr: case Op::BitXor:
        if (arg(0) != arg(1) || arg(0) == Type::Float) return false;
        break;
      case Op::Shl: case Op::Shr: case Op::BitNot: case Op::Load:
        for (int k = 0; k < n.nargs; ++k)
          if (arg(k) != Type::Int) return false;
        break;
      case Op::Const: case Op::Input: case Op::Param: case Op::ToFloat:
      case Op::Eq: case Op::Ne:
        break;
      default:  // arithmetic and ordering on numbers
        for (int k = 0; k < n.nargs; ++k)
          if (arg(k) == Type::Bool) return false;
    }
  }
  return true;
}

}  // namespace

TEST_CASE("simplify: random expressions keep their values bit for bit", "[analysis][simplify]") {
  Decls decls;
  decls.params = {{"pf", Type::Float, 0, false}, {"pi", Type::Int, 0, false}};
  decls.captures = {{"cf", DType::F32, {Dim{Dim::Fixed, 3}}},
                    {"ci", DType::I32, {Dim{Dim::Fixed, 2}, Dim{Dim::Fixed, 3}}},
                    {"cb", DType::Bool, {Dim{Dim::Fixed, 4}}},
                    {"ch", DType::BF16, {Dim{Dim::H, 0}}}};
  Captures caps;
  caps.add(DType::F32, std::vector<float>{1.5f, -0.0f, 1e-3f}, {3});
  caps.add(DType::I32, std::vector<int32_t>{0, -1, 7, int32_t(kIntMin), int32_t(kIntMax), 3},
           {2, 3});
  caps.add(DType::Bool, std::vector<uint8_t>{0, 1, 0, 2}, {4});
  caps.add(DType::BF16, std::vector<uint16_t>{0x3F80, 0x7FC0, 0xFF80, 0x8000}, {4});
  const double float_specials[] = {0.0, -0.0, kInf, -kInf, kNan, 1e-3, 3.0, -7.25, 1e30};
  const int64_t int_specials[] = {0, -1, 1, kIntMin, kIntMax, 31, 32};

  std::vector<Value> s1, s2;
  int changed = 0, points = 0, ill_typed = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    testing::RandomExprOptions opt;
    opt.decls = &decls;
    opt.max_depth = 2 + trial % 4;
    const Type t = trial % 3 == 0 ? Type::Bool : trial % 3 == 1 ? Type::Int : Type::Float;
    if (t == Type::Float) opt.inputs[static_cast<int>(Input::Score)] = true;
    testing::RandomExpr gen(rng()(), opt);
    Graph g;
    g.root = gen.expr(g, t, opt.max_depth);
    if (!well_typed(g)) {
      ++ill_typed;
      continue;
    }
    const Graph s = simplify(g);
    INFO("expression: " << to_text(g, g.root, decls));
    INFO("simplified: " << to_text(s, s.root, decls));
    if (s.size() != g.size()) ++changed;
    // only reachable nodes, and simplifying again changes nothing
    std::vector<char> used(s.size(), 0);
    used[s.root] = 1;
    for (const Node& n : s.nodes())
      for (NodeId a : n.operands()) used[a] = 1;
    CHECK(std::count(used.begin(), used.end(), 0) == 0);
    const Graph s2g = simplify(s);
    CHECK(s2g.size() == s.size());
    CHECK(to_text(s2g, s2g.root, decls) == to_text(s, s.root, decls));

    for (int pt = 0; pt < 20; ++pt) {
      const auto pick_int = [&] {
        return uniform_int(0, 3) == 0 ? int_specials[uniform_int(0, 6)] : uniform_int(-10, 10);
      };
      const auto pick_float = [&] {
        return uniform_int(0, 3) == 0 ? float_specials[uniform_int(0, 8)] : uniform(-10, 10);
      };
      const double params[2] = {pick_float(), static_cast<double>(pick_int())};
      EvalEnv e = env_at(pick_int(), pick_int(), pick_int(), pick_int(), pick_float());
      e.ints[static_cast<int>(Input::QLen)] = pick_int();
      e.ints[static_cast<int>(Input::KvLen)] = pick_int();
      e.params = params;
      e.captures = caps.tensors;
      for (Precision p : {Precision::F64, Precision::F32}) {
        const Value a = evaluate(g, e, p, s1), b = evaluate(s, e, p, s2);
        INFO((p == Precision::F32 ? "F32" : "F64") << ": " << show(a) << " vs " << show(b));
        CHECK(same_bits(a, b));
        ++points;
      }
    }
  }
  // the generator must give the simplifier something to do
  INFO(ill_typed << " ill-typed expressions skipped");
  CHECK(changed > 300);
  CHECK(points > 2000 * 20 * 2);
}

TEST_CASE("dependencies and the identity / all-true facts", "[analysis][deps]") {
  const World w;
  const Mod causal = w.parse(ModKind::Mask, "q_idx >= kv_idx");
  Deps d = dependencies(causal.graph, causal.graph.root);
  CHECK(d.reads(Input::QIdx));
  CHECK(d.reads(Input::KvIdx));
  CHECK_FALSE(d.reads(Input::B));
  CHECK_FALSE(d.reads(Input::H));
  CHECK_FALSE(d.reads(Input::Score));
  CHECK(d.params.empty());
  CHECK(d.captures.empty());

  const Mod t5 = w.parse(
      ModKind::Score,
      "let rel = clamp(q_idx - kv_idx, -64, 64) + 64;\n"
      "score * scale + bias[h, rel] + table[rel % 4, ids[kv_idx] % 4] + slope[h]");
  d = dependencies(t5.graph, t5.graph.root);
  CHECK(d.reads(Input::Score));
  CHECK(d.reads(Input::H));
  CHECK_FALSE(d.reads(Input::B));
  CHECK_FALSE(d.reads(Input::QLen));
  CHECK(d.params == std::vector<uint16_t>{0});
  CHECK(d.captures == std::vector<uint16_t>{0, 1, 2, 4});

  const Mod win = w.parse(ModKind::Mask, "q_idx - kv_idx <= window && kv_len > 0");
  d = dependencies(win.graph, win.graph.root);
  CHECK(d.params == std::vector<uint16_t>{1});
  CHECK(d.reads(Input::KvLen));

  const auto fact = [&](bool (*f)(const Graph&, NodeId), ModKind kind, std::string_view t) {
    const Mod m = w.parse(kind, t);
    return f(m.graph, m.graph.root);
  };
  const auto identity = [&](std::string_view t) {
    return fact(is_identity_score, ModKind::Score, t);
  };
  CHECK(identity("score"));
  CHECK(identity("score * 1.0"));
  CHECK(identity("let s = score; where(b == b, s, -inf) / 1.0"));
  CHECK_FALSE(identity("score + 0.0"));
  CHECK_FALSE(identity("score * scale"));
  CHECK_FALSE(identity("where(q_idx >= kv_idx, score, -inf)"));

  const auto all_true = [&](std::string_view t) {
    return fact(is_all_true_mask, ModKind::Mask, t);
  };
  CHECK(all_true("true"));
  CHECK(all_true("q_idx == q_idx || b > 0"));
  CHECK(all_true("!(1 > 2)"));
  CHECK_FALSE(all_true("q_idx >= 0"));
  CHECK_FALSE(all_true("false"));
  CHECK_FALSE(all_true("float(q_idx) == float(q_idx)"));
}

// ---- derivatives

namespace {

// Real score_mods and ones that reach every derivative rule.
const char* const kScoreMods[] = {
    "score",
    "score + slope[h] * (kv_idx - q_idx)",  // alibi
    "30.0 * tanh(score / 30.0)",            // softcap
    "score * score",
    "exp(score)",
    "where(q_idx >= kv_idx, score, -inf)",
    "pow(score, 3.0)",
    "pow(2.0, score)",
    "pow(abs(score) + 1.0, score / 3.0)",
    "sigmoid(score) * score",
    "log(abs(score) + 1.0)",
    "min(score, 2.0) + max(score, -1.0) * clamp(score, -3.0, 4.0)",
    "score + bias[h, clamp(q_idx - kv_idx, -64, 64) + 64]",  // T5 bias table
    "sqrt(score * score + 1.0) + rsqrt(score * score + 1.0)",
    "exp2(score / 4.0) - log2(score * score + 1.0)",
    "sin(score) * cos(score / 2.0)",
    "score % 3.0 + score // 2.0 + floor(score) + ceil(score) + 7.0 % (abs(score) + 1.0)",
    "sign(score) * score / (1.0 + score * score)",
    "let t = tanh(score * scale); t * t + score * table[q_idx % 4, kv_idx % 4]",
    "clamp(score, slope[h], slope[h] + 2.0) * 2.0",
    "clamp(score / 4.0, slope[h], table[h, 0])",  // lo > hi at some points
    "min(score * slope[h], max(slope[h], -score))",
    "where(score > slope[h], score * slope[h], exp(slope[h]))",
    "score + half_bias[h] * float(int(score) < 0)",
    "score * float(q_idx - kv_idx) / 64.0 - q_len",
    "score / (slope[h] + 10.0) + -score",
    "pow(slope[h] + 10.0, score / 8.0)",
    "score % (slope[h] + 10.0) - floor(table[0, h]) * score",
    "let s = score * scale; s * sigmoid(s) + float(ids[kv_idx]) * bias[h, int(score) + 64]",
};

// Central difference of f at x with step h, or nullopt where f is not smooth around x (a kink or
// a jump within the step, seen as disagreeing one-sided differences) or not finite.
template <class F>
std::optional<double> central_difference(F f, double x, double h_up, double h_down) {
  const double fp = f(x + h_up), fm = f(x - h_down), f0 = f(x);
  if (!std::isfinite(fp) || !std::isfinite(fm) || !std::isfinite(f0)) return std::nullopt;
  const double fwd = (fp - f0) / h_up, bwd = (f0 - fm) / h_down;
  if (std::abs(fwd - bwd) > 1e-3 * std::max({1.0, std::abs(fwd), std::abs(bwd)}))
    return std::nullopt;
  return (fp - fm) / (h_up + h_down);
}

bool close(double analytic, double fd, double rel) {
  return std::abs(analytic - fd) <= rel * std::max(1.0, std::abs(analytic));
}

}  // namespace

TEST_CASE("derivative w.r.t. score matches finite differences", "[analysis][derive]") {
  const World w;
  for (const char* text : kScoreMods) {
    INFO("score_mod: " << text);
    Mod m = w.parse(ModKind::Score, text);
    Graph& g = m.graph;
    const NodeId root = g.root;
    const NodeId d = derivative_wrt_score(g, root);
    INFO("derivative: " << to_text(g, d, w.decls));
    int checked = 0;
    for (int pt = 0; pt < 300; ++pt) {
      EvalEnv e = w.random_env();
      const double s = e.score, h = 1e-5 * std::max(1.0, std::abs(s));
      const auto f = [&](double x) {
        EvalEnv ex = e;
        ex.score = x;
        return eval_f(g, root, ex);
      };
      const auto fd = central_difference(f, s, h, h);
      if (!fd) continue;
      ++checked;
      const double a = eval_f(g, d, e);
      INFO("at score " << s << ": derivative " << a << ", finite difference " << *fd);
      CHECK(close(a, *fd, 1e-5));
    }
    // kinks, jumps and -inf are rare except where the mod masks half the points
    CHECK(checked >= 100);
  }
}

TEST_CASE("derivatives w.r.t. loaded capture values match finite differences",
          "[analysis][derive]") {
  World w;
  int with_loads = 0;
  for (const char* text : kScoreMods) {
    INFO("score_mod: " << text);
    Mod m = w.parse(ModKind::Score, text);
    Graph& g = m.graph;
    const NodeId root = g.root;
    const std::vector<LoadDerivative> lds = derivatives_wrt_loads(g, root);
    with_loads += !lds.empty();
    std::vector<NodeId> loads;  // every float load, listed or not
    for (NodeId id = 0; id <= root; ++id)
      if (g[id].op == Op::Load && g[id].type == Type::Float) loads.push_back(id);
    for (const LoadDerivative& ld : lds) {
      CHECK(std::find(loads.begin(), loads.end(), ld.load) != loads.end());
      CHECK(g[ld.derivative].type == Type::Float);
    }
    for (int pt = 0; pt < 100; ++pt) {
      const EvalEnv e = w.random_env();
      // the element each load reads here
      const auto element = [&](NodeId load) {
        const Node& n = g[load];
        const HostTensor& t = w.caps.tensors[n.slot];
        int64_t off = 0;
        for (int k = 0; k < n.nargs; ++k) {
          std::vector<Value> scratch;
          const int64_t i = evaluate(g, n.args[k], e, Precision::F64, scratch).i;
          off = off * t.shape[k] + wrap_index(i, t.shape[k]);
        }
        return std::pair<uint16_t, int64_t>(n.slot, off);
      };
      std::vector<std::pair<uint16_t, int64_t>> elements;
      for (NodeId l : loads) elements.push_back(element(l));
      std::sort(elements.begin(), elements.end());
      elements.erase(std::unique(elements.begin(), elements.end()), elements.end());
      for (auto [slot, off] : elements) {
        // only float32 captures can be nudged finely enough
        if (w.caps.tensors[slot].dtype != DType::F32) continue;
        double analytic = 0;
        for (const LoadDerivative& ld : lds)
          if (element(ld.load) == std::pair(slot, off)) analytic += eval_f(g, ld.derivative, e);
        float* x = reinterpret_cast<float*>(w.caps.storage[slot].data()) + off;
        const float x0 = *x;
        const float up = static_cast<float>(x0 + std::ldexp(1.0, -12)),
                    down = static_cast<float>(x0 - std::ldexp(1.0, -12));
        const auto f = [&](double v) {
          *x = static_cast<float>(v);
          return eval_f(g, root, e);
        };
        const auto fd = central_difference(f, x0, double(up) - x0, x0 - double(down));
        *x = x0;
        if (!fd) continue;
        INFO("capture " << slot << " element " << off << " = " << x0 << " at score " << e.score
                        << ": derivative " << analytic << ", finite difference " << *fd);
        CHECK(close(analytic, *fd, 1e-4));
      }
    }
  }
  CHECK(with_loads >= 8);
}

TEST_CASE("derivatives print readably", "[analysis][derive]") {
  const World w;
  const auto d_score = [&](std::string_view text) {
    Mod m = w.parse(ModKind::Score, text);
    const NodeId d = derivative_wrt_score(m.graph, m.graph.root);
    return to_text(m.graph, d, w.decls);
  };
  CHECK(d_score("score") == "1.0");
  CHECK(d_score("score + slope[h] * (kv_idx - q_idx)") == "1.0");
  CHECK(d_score("score + bias[h, clamp(q_idx - kv_idx, -64, 64) + 64]") == "1.0");
  CHECK(d_score("float(q_idx) * 2.0") == "0.0");
  CHECK(d_score("30.0 * tanh(score / 30.0)") ==
        "30.0 * (1.0 - tanh(score / 30.0) * tanh(score / 30.0)) / 30.0");
  CHECK(d_score("where(q_idx >= kv_idx, score, -inf)") == "q_idx >= kv_idx ? 1.0 : 0.0");
  CHECK(d_score("score * score") == "score + score");
  CHECK(d_score("exp(score)") == "exp(score)");
  CHECK(d_score("score * scale") == "scale");
  // clamp = min(max(score, lo), hi) with fminf / fmaxf's NaN rule: a NaN score clamps to lo.
  CHECK(d_score("clamp(score, -3.0, 4.0)") ==
        "4.0 < max(score, -3.0) || max(score, -3.0) != max(score, -3.0) || (-3.0 > score || "
        "score != score) ? 0.0 : 1.0");
  // A NaN operand of max is ignored, so the derivative follows the other one.
  CHECK(d_score("max(score, 0.0 * inf)") == "nan > score || score != score ? 0.0 : 1.0");
  CHECK(d_score("abs(score)") == "sign(score)");
  CHECK(d_score("pow(score, 2.0)") == "2.0 * pow(score, 1.0)");

  const auto d_loads = [&](std::string_view text) {
    Mod m = w.parse(ModKind::Score, text);
    std::vector<std::string> out;
    for (const LoadDerivative& ld : derivatives_wrt_loads(m.graph, m.graph.root))
      out.push_back(to_text(m.graph, ld.load, w.decls) + ": " +
                    to_text(m.graph, ld.derivative, w.decls));
    return out;
  };
  CHECK(d_loads("score + slope[h] * (kv_idx - q_idx)") ==
        std::vector<std::string>{"slope[h]: float(kv_idx - q_idx)"});
  CHECK(d_loads("score + bias[h, clamp(q_idx - kv_idx, -64, 64) + 64]") ==
        std::vector<std::string>{"bias[h, clamp(q_idx - kv_idx, -64, 64) + 64]: 1.0"});
  CHECK(d_loads("score * slope[h] + table[0, 1] * slope[h]") ==
        std::vector<std::string>{"slope[h]: score + table[0, 1]", "table[0, 1]: slope[h]"});
  CHECK(d_loads("score + floor(slope[h])").empty());
  CHECK(d_loads("score + float(slope[h] > 0.0)").empty());
  CHECK(d_loads("score").empty());
}
