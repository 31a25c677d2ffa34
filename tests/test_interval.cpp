// Interval evaluation of masks (dsl/interval.cpp): sound against exhaustive evaluation on random
// expressions and boxes, exact on the catalogue's masks wherever a tile is not cut by the mask.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cstring>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <limits>
#include <optional>
#include <random>
#include <span>

#include "dsl/analysis.h"
#include "dsl/frontend.h"
#include "random_expr.h"
#include "test_random.h"

using namespace flexc::dsl;

namespace {

constexpr int64_t kIntMin = std::numeric_limits<int32_t>::min();
constexpr int64_t kIntMax = std::numeric_limits<int32_t>::max();

using flexc::testing::fresh_seed;

// Captured tensors held for both the interpreter (HostTensor) and capture_range (min / max over
// an index box).
struct Captures {
  std::vector<std::vector<double>> values;  // by slot, row-major, as the interpreter reads them
  std::vector<std::vector<int32_t>> i32;
  std::vector<std::vector<float>> f32;
  std::vector<std::vector<uint8_t>> b8;
  std::vector<HostTensor> host;
  std::vector<std::vector<int64_t>> shapes;

  // Adds a tensor of `dtype` and `shape` filled by `gen()` (called once per element).
  template <class Gen>
  void add(DType dtype, std::vector<int64_t> shape, Gen gen) {
    int64_t count = 1;
    for (int64_t d : shape) count *= d;
    std::vector<double> v(count);
    for (double& x : v) x = gen();
    i32.emplace_back();
    f32.emplace_back();
    b8.emplace_back();
    HostTensor t;
    t.dtype = dtype;
    t.shape = shape;
    for (double x : v) {
      if (dtype == DType::I32) i32.back().push_back(static_cast<int32_t>(x));
      if (dtype == DType::F32) f32.back().push_back(static_cast<float>(x));
      if (dtype == DType::Bool) b8.back().push_back(x != 0);
    }
    values.push_back(std::move(v));
    shapes.push_back(std::move(shape));
    host.push_back(t);
  }

  // Data pointers are taken last: the vectors above no longer move.
  void finish() {
    for (size_t s = 0; s < host.size(); ++s)
      host[s].data = host[s].dtype == DType::I32   ? static_cast<const void*>(i32[s].data())
                     : host[s].dtype == DType::F32 ? static_cast<const void*>(f32[s].data())
                                                   : static_cast<const void*>(b8[s].data());
  }

  std::optional<std::pair<double, double>> range(uint16_t slot, std::span<const IntRange> idx) const {
    const std::vector<int64_t>& shape = shapes.at(slot);
    REQUIRE(idx.size() == shape.size());
    for (size_t k = 0; k < idx.size(); ++k) {
      REQUIRE(idx[k].lo >= 0);
      REQUIRE(idx[k].hi < shape[k]);
      REQUIRE(idx[k].lo <= idx[k].hi);
    }
    double lo = std::numeric_limits<double>::infinity(), hi = -lo;
    std::array<int64_t, kMaxArgs> at{};
    for (size_t k = 0; k < idx.size(); ++k) at[k] = idx[k].lo;
    for (;;) {
      int64_t flat = 0;
      for (size_t k = 0; k < idx.size(); ++k) flat = flat * shape[k] + at[k];
      const double v = values[slot][flat];
      if (std::isnan(v)) return std::nullopt;
      lo = std::min(lo, v);
      hi = std::max(hi, v);
      size_t k = idx.size();
      while (k > 0 && at[k - 1] == idx[k - 1].hi) {
        at[k - 1] = idx[k - 1].lo;
        --k;
      }
      if (k == 0) break;
      ++at[k - 1];
    }
    return std::pair{lo, hi};
  }
};

struct Box {
  IntRange b, h, q, kv;
};

std::string show(const Box& x, int64_t q_len, int64_t kv_len) {
  return fmt::format("b [{}, {}], h [{}, {}], q_idx [{}, {}], kv_idx [{}, {}], q_len {}, kv_len {}",
                     x.b.lo, x.b.hi, x.h.lo, x.h.hi, x.q.lo, x.q.hi, x.kv.lo, x.kv.hi, q_len,
                     kv_len);
}

const char* show(Verdict v) {
  return v == Verdict::AlwaysTrue ? "AlwaysTrue" : v == Verdict::AlwaysFalse ? "AlwaysFalse" : "Unknown";
}

// What is true over a box, by evaluating every point.
struct Truth {
  bool any_true = false, any_false = false;
};

// Everything one mask is evaluated against: sizes, param values, captures.
struct World {
  int64_t q_len = 0, kv_len = 0;
  std::vector<double> params;
  Captures caps;
  bool with_capture_range = true;

  IntervalEnv env(const Box& x) const {
    IntervalEnv e;
    e.b = x.b;
    e.h = x.h;
    e.q_idx = x.q;
    e.kv_idx = x.kv;
    e.q_len = q_len;
    e.kv_len = kv_len;
    e.params = params;
    e.capture_shapes = caps.shapes;
    if (with_capture_range)
      e.capture_range = [this](uint16_t slot, std::span<const IntRange> idx) {
        return caps.range(slot, idx);
      };
    return e;
  }

  Truth exhaustive(const Graph& g, NodeId root, const Box& x, Precision p,
                   std::vector<Value>& scratch) const {
    EvalEnv e;
    e.ints[static_cast<int>(Input::QLen)] = q_len;
    e.ints[static_cast<int>(Input::KvLen)] = kv_len;
    e.params = params;
    e.captures = caps.host;
    Truth t;
    for (int64_t b = x.b.lo; b <= x.b.hi; ++b)
      for (int64_t h = x.h.lo; h <= x.h.hi; ++h)
        for (int64_t q = x.q.lo; q <= x.q.hi; ++q)
          for (int64_t kv = x.kv.lo; kv <= x.kv.hi; ++kv) {
            e.ints[static_cast<int>(Input::B)] = b;
            e.ints[static_cast<int>(Input::H)] = h;
            e.ints[static_cast<int>(Input::QIdx)] = q;
            e.ints[static_cast<int>(Input::KvIdx)] = kv;
            (evaluate(g, root, e, p, scratch).i ? t.any_true : t.any_false) = true;
          }
    return t;
  }
};

// A range of `width` + 1 values at a random place: mostly small indices, sometimes negative or
// at the ends of the int32 range (where + and * wrap).
IntRange random_range(testing::RandomExpr& gen, int64_t max_width) {
  const int64_t w = gen.uniform(0, max_width);
  const int64_t where = gen.uniform(0, 19);
  int64_t lo = gen.uniform(-12, 60);
  if (where == 0) lo = kIntMax - w - gen.uniform(0, 4);
  if (where == 1) lo = kIntMin + gen.uniform(0, 4);
  return {lo, lo + w};
}

Decls random_decls() {
  Decls d;
  d.params = {{"n", Type::Int, 0, false}, {"f", Type::Float, 0, false}};
  d.captures = {{"ci", DType::I32, {Dim{Dim::Fixed, 5}}},
                {"cm", DType::I32, {Dim{Dim::Fixed, 3}, Dim{Dim::Fixed, 4}}},
                {"cb", DType::Bool, {Dim{Dim::Fixed, 7}}},
                {"cf", DType::F32, {Dim{Dim::Fixed, 6}}}};
  return d;
}

void random_world(testing::RandomExpr& gen, World& w) {
  w.q_len = gen.uniform(1, 64);
  w.kv_len = gen.uniform(1, 64);
  w.params = {static_cast<double>(gen.uniform(-10, 40)), gen.uniform(-300, 300) / 100.0};
  w.with_capture_range = gen.chance(0.8);
  w.caps = Captures{};
  const auto small_int = [&] { return static_cast<double>(gen.uniform(-6, 6)); };
  w.caps.add(DType::I32, {5}, small_int);
  w.caps.add(DType::I32, {3, 4}, small_int);
  w.caps.add(DType::Bool, {7}, [&] { return static_cast<double>(gen.chance(0.5)); });
  const bool with_nan = gen.chance(0.1);
  w.caps.add(DType::F32, {6}, [&] {
    return with_nan && gen.chance(0.2) ? std::numeric_limits<double>::quiet_NaN()
                                       : gen.uniform(-400, 400) / 64.0;
  });
  w.caps.finish();
}

}  // namespace

TEST_CASE("interval verdicts are sound on random masks and boxes", "[interval]") {
  const Decls decls = random_decls();
  testing::RandomExprOptions opt;
  opt.decls = &decls;
  opt.int_lo = -6;
  opt.int_hi = 12;
  testing::RandomExpr gen(fresh_seed(), opt);
  World w;
  std::vector<Value> scratch;
  int64_t checked = 0, decided = 0;
  for (int iter = 0; iter < 4000; ++iter) {
    Graph g;
    g.root = gen.expr(g, Type::Bool, static_cast<int>(gen.uniform(1, 5)));
    random_world(gen, w);
    IntervalEvaluator ev(g, g.root);
    for (int k = 0; k < 4; ++k) {
      const Box x{random_range(gen, 1), random_range(gen, 1), random_range(gen, 7),
                  random_range(gen, 7)};
      const IntervalEnv env = w.env(x);
      const Verdict v = ev.verdict(env);
      REQUIRE(v == interval_verdict(g, g.root, env));  // reuse changes nothing
      ++checked;
      if (v == Verdict::Unknown) continue;
      ++decided;
      for (Precision p : {Precision::F64, Precision::F32}) {
        const Truth t = w.exhaustive(g, g.root, x, p, scratch);
        const bool wrong = v == Verdict::AlwaysTrue ? t.any_false : t.any_true;
        if (wrong)
          FAIL_CHECK(fmt::format("{} for `{}` on {} (params n = {}, f = {}; {} evaluation)",
                                 show(v), to_text(g, g.root, decls), show(x, w.q_len, w.kv_len),
                                 w.params[0], w.params[1], p == Precision::F64 ? "f64" : "f32"));
      }
    }
  }
  // The property is only worth something if verdicts are often decided.
  INFO(decided << " of " << checked << " verdicts decided");
  CHECK(decided * 3 > checked);
}

namespace {

Box tile(int64_t q0, int64_t q1, int64_t k0, int64_t k1) {
  return Box{{0, 0}, {0, 0}, {q0, q1}, {k0, k1}};
}

// A mask on one box and the verdict it must get (nullopt: only soundness is checked).
struct Expect {
  const char* src;
  Box box;
  std::optional<Verdict> want;
};

// Checks each verdict against `want` and against exhaustive evaluation in both precisions.
void check_all(std::span<const Expect> cases, const Decls& decls, const World& w) {
  std::vector<Value> scratch;
  for (const Expect& c : cases) {
    const Mod m = parse_mod(ModKind::Mask, c.src, decls, "mask_mod");
    const Verdict v = interval_verdict(m.graph, m.graph.root, w.env(c.box));
    INFO(c.src << " on " << show(c.box, w.q_len, w.kv_len) << ": " << show(v));
    if (c.want) CHECK(v == *c.want);
    for (Precision p : {Precision::F64, Precision::F32}) {
      const Truth t = w.exhaustive(m.graph, m.graph.root, c.box, p, scratch);
      CHECK(!(v == Verdict::AlwaysTrue && t.any_false));
      CHECK(!(v == Verdict::AlwaysFalse && t.any_true));
    }
  }
}

World small_world() {
  World w;
  w.q_len = w.kv_len = 64;
  return w;
}

constexpr Verdict kTrue = Verdict::AlwaysTrue, kFalse = Verdict::AlwaysFalse,
                  kUnknown = Verdict::Unknown;

}  // namespace

TEST_CASE("float results cover both the float64 oracle and a float32 kernel", "[interval]") {
  const Expect cases[] = {
      // 1 + 1e-8 is 1 in float32 and 0.99999999 rounds to 1: true in float64, false in float32.
      {"float(q_idx) + 1e-8 > 0.99999999", tile(1, 1, 0, 3), kUnknown},
      // 2^24 + 1 is not a float32.
      {"float(q_idx + 16777216) > 16777216.0", tile(1, 1, 0, 0), kUnknown},
      // Beyond the float32 range: infinite in a kernel (inf * 0 is NaN), finite in the oracle.
      {"exp(float(q_idx)) * 0.0 == 0.0", tile(100, 101, 0, 0), kUnknown},
      // Decided where rounding cannot matter.
      {"float(q_idx) * 0.5 >= float(kv_idx)", tile(40, 47, 0, 19), kTrue},
      {"sqrt(float(q_idx)) >= 0.0 && exp(float(kv_idx)) > 0.0", tile(0, 9, 0, 9), kTrue},
      {"sigmoid(float(q_idx)) <= 1.0 && tanh(float(kv_idx)) >= -1.0", tile(0, 40, 0, 40), kTrue},
      // NaN compares false: sqrt of a negative, 0 / 0.
      {"sqrt(float(q_idx) - 5.0) >= 0.0", tile(0, 3, 0, 0), {}},
      {"float(q_idx) / float(kv_idx) < 2.0", tile(0, 1, 0, 1), {}},
  };
  check_all(cases, {}, small_world());
}

TEST_CASE("int32 wrap-around, floored division and modulo", "[interval]") {
  const Expect cases[] = {
      // q_idx + INT_MAX wraps to negative for q_idx >= 1: decided exactly on either side.
      {"q_idx + 2147483647 < 0", tile(1, 9, 0, 0), kTrue},
      {"q_idx + 2147483647 < 0", tile(0, 9, 0, 0), kUnknown},
      {"q_idx * 65536 * 65536 == 0", tile(0, 9, 0, 0), kTrue},
      {"(q_idx << 30) + (kv_idx << 30) < 0", tile(1, 1, 1, 1), kTrue},
      // True everywhere, but beyond intervals and affine forms.
      {"(q_idx << 31) + (q_idx << 31) == 0", tile(0, 40, 0, 0), {}},
      // Floored: -7 // 2 == -4, -7 % 2 == 1; x // 0 == x % 0 == 0.
      {"(q_idx - 7) // 2 == -4 && (q_idx - 7) % 2 == 1", tile(0, 0, 0, 0), kTrue},
      {"q_idx // kv_idx <= 30 && q_idx % kv_idx >= 0", tile(0, 30, 0, 5), kTrue},
      {"q_idx % (kv_idx - 3) <= 0", tile(0, 30, 0, 3), kTrue},
      // A coordinate that occurs twice: exact through the affine form.
      {"q_idx - kv_idx + kv_idx == q_idx", tile(0, 63, 0, 63), kTrue},
      {"2 * q_idx - kv_idx - q_idx >= 0", tile(64, 127, 0, 63), kTrue},
      {"(q_idx - kv_idx) * 3 // 3 > -1", tile(64, 127, 0, 64), kTrue},
      // Bitwise on mixed signs.
      {"(q_idx - 20 & kv_idx) >= 0 && (q_idx - 20 | 3) < 32", tile(0, 40, 0, 63), kTrue},
  };
  check_all(cases, {}, small_world());
}

TEST_CASE("&&, || and ?: look at one operand where the other decides", "[interval]") {
  const Box all = tile(0, 15, 0, 15);
  const Expect cases[] = {
      {"q_idx >= kv_idx || q_idx < kv_idx", all, kTrue},
      {"q_idx > kv_idx && kv_idx > q_idx", all, kFalse},
      {"!(q_idx < 5) && q_idx < 5", all, kFalse},
      {"min(q_idx, kv_idx) >= 3 && q_idx < 3", all, kFalse},
      {"abs(q_idx - kv_idx) < 2 && q_idx - kv_idx > 5", all, kFalse},
      {"where(q_idx >= kv_idx, q_idx - kv_idx, kv_idx - q_idx) >= 0", all, kTrue},
      // Where either operand of || holds, the region is the hull of both parts.
      {"(kv_idx > 10 || kv_idx < 3) && kv_idx < 5", all, kUnknown},
      {"(kv_idx > 10 || kv_idx < 3) && kv_idx < 5 && kv_idx > 2", all, kFalse},
  };
  check_all(cases, {}, small_world());
}

TEST_CASE("captured tensors: index wrap, value ranges, missing information", "[interval]") {
  Decls decls;
  decls.captures = {{"t", DType::I32, {Dim{Dim::Fixed, 10}}}};
  decls.params = {{"n", Type::Int, 0, false}};
  World w = small_world();
  w.params = {3};
  w.caps.add(DType::I32, {10}, [i = 0]() mutable { return static_cast<double>(i++); });
  w.caps.finish();
  // t[i] == i % 10: the box [12, 15] reads [2, 5]; [8, 12] wraps and reads everything.
  const Expect with_ranges[] = {
      {"t[q_idx] >= 2 && t[q_idx] <= 5", tile(12, 15, 0, 0), kTrue},
      {"t[q_idx - 20] < 6", tile(12, 15, 0, 0), kTrue},
      {"t[q_idx] >= 8", tile(8, 12, 0, 0), kUnknown},
      {"t[q_idx] >= 0", tile(8, 12, 0, 0), kTrue},
      {"q_idx < n", tile(0, 2, 0, 0), kTrue},
  };
  check_all(with_ranges, decls, w);
  // Without capture_range a capture may hold anything; without its value, so may a param.
  w.with_capture_range = false;
  const Expect without[] = {{"t[q_idx] >= 0", tile(8, 12, 0, 0), kUnknown}};
  check_all(without, decls, w);
  w.params = {};
  const Mod m = parse_mod(ModKind::Mask, "q_idx < n", decls, "mask_mod");
  CHECK(interval_verdict(m.graph, m.graph.root, w.env(tile(0, 2, 0, 0))) == kUnknown);
}

namespace {

struct CatalogueMask {
  std::string src;
  bool exact = true;  // decided on every tile the mask does not cut
};

}  // namespace

TEST_CASE("the catalogue's masks are decided on every tile they do not cut", "[interval]") {
  // The catalogue's masks (examples/variants/, compositions written out) and other spellings.
  Decls decls;
  for (const char* name : {"window", "dilation", "chunk", "prefix", "num_global", "radius",
                           "sinks", "width", "height"})
    decls.params.push_back({name, Type::Int, 0, false});
  decls.captures = {{"doc", DType::I32, {Dim{Dim::B}, Dim{Dim::KvLen}}},
                    {"doc1", DType::I32, {Dim{Dim::KvLen}}}};
  const std::string causal = "q_idx >= kv_idx";
  const std::vector<CatalogueMask> masks = {
      {causal},
      {"q_idx + kv_len - q_len >= kv_idx"},
      {causal + " && q_idx - kv_idx < window"},
      {"q_idx - kv_idx <= window && q_idx >= kv_idx"},
      {"kv_idx > q_idx - window && q_idx >= kv_idx"},
      {"abs(q_idx - kv_idx) <= window"},
      {"let d = q_idx + kv_len - q_len - kv_idx; d >= 0 && d <= window"},
      {"kv_idx < prefix || " + causal},
      {causal + " && q_idx - kv_idx < window * dilation && (q_idx - kv_idx) % dilation == 0"},
      {"abs(q_idx - kv_idx) <= window && (q_idx - kv_idx) % 3 == 0"},
      {"abs(q_idx - kv_idx) <= 100 && (q_idx - kv_idx) % 256 == 0"},
      {"abs(q_idx - kv_idx) <= 200 && (q_idx - kv_idx) % 256 == 0"},
      {"q_idx // chunk >= kv_idx // chunk"},
      {"q_idx // chunk == kv_idx // chunk"},
      {"q_idx // 128 == kv_idx // 128"},
      {"q_idx < num_global || kv_idx < num_global || abs(q_idx - kv_idx) <= radius"},
      {"kv_idx < 64 || q_idx < 64 || abs(q_idx - kv_idx) <= 63"},
      {causal + " && (kv_idx < sinks || q_idx - kv_idx < window)"},
      {"kv_idx < sinks || (q_idx >= kv_idx && q_idx - kv_idx < window)"},
      {"doc1[q_idx] == doc1[kv_idx]"},
      {"doc[b, q_idx] == doc[b, kv_idx]"},
      {"doc[b, q_idx] == doc[b, kv_idx] && " + causal},
      // 2D neighbourhood: decided where it can be, checked for soundness everywhere.
      {"let q_row = q_idx // width; let kv_row = kv_idx // width;"
       "let row = clamp(q_row, radius, height - 1 - radius);"
       "let col = clamp(q_idx % width, radius, width - 1 - radius);"
       "abs(row - kv_row) <= radius && abs(col - kv_idx % width) <= radius",
       false},
      {"abs(q_idx % width - kv_idx % width) <= radius && "
       "abs(q_idx // width - kv_idx // width) <= radius",
       false},
  };
  testing::RandomExpr gen(fresh_seed());
  const std::pair<int64_t, int64_t> sizes[] = {{384, 384}, {300, 520}, {520, 300}, {200, 777}};
  const std::pair<int64_t, int64_t> tiles[] = {{128, 128}, {64, 128}};
  int64_t decided = 0, inexact_tiles = 0, inexact_decided = 0;
  for (const auto& [q_len, kv_len] : sizes) {
    World w;
    w.q_len = q_len;
    w.kv_len = kv_len;
    const int64_t width = gen.uniform(8, 40);
    w.params = {static_cast<double>(gen.uniform(40, 200)),         // window
                static_cast<double>(gen.uniform(1, 4)),            // dilation
                static_cast<double>(gen.uniform(50, 300)),         // chunk
                static_cast<double>(gen.uniform(1, 300)),          // prefix
                static_cast<double>(gen.uniform(1, 100)),          // num_global
                static_cast<double>(gen.uniform(1, 4)),            // radius
                static_cast<double>(gen.uniform(1, 8)),            // sinks
                static_cast<double>(width),                        // width
                static_cast<double>((kv_len + width - 1) / width)};  // height
    // Documents of random lengths, numbered in order (two batches, then one), long enough for
    // q_idx too: an index that wraps reads ids of both ends, which no interval separates.
    const int64_t n = std::max(q_len, kv_len);
    int64_t id = 0, left = 0;
    const auto next_doc = [&]() {
      if (left-- == 0) {
        ++id;
        left = gen.uniform(1, 150);
      }
      return static_cast<double>(id);
    };
    w.caps.add(DType::I32, {2, n}, next_doc);
    w.caps.add(DType::I32, {n}, next_doc);
    w.caps.finish();
    for (const CatalogueMask& mask : masks) {
      const Mod m = parse_mod(ModKind::Mask, mask.src, decls, "mask_mod");
      const Graph& g = m.graph;
      const bool reads_b = dependencies(g, g.root).reads(Input::B);
      IntervalEvaluator ev(g, g.root);
      std::vector<Value> scratch;
      for (int64_t b = 0; b < (reads_b ? 2 : 1); ++b) {
        // The truth of every element once, then per tile.
        std::vector<uint8_t> truth(q_len * kv_len);
        for (int64_t q = 0; q < q_len; ++q) {
          EvalEnv e;
          e.ints = {0, b, 0, q, 0, q_len, kv_len};
          e.params = w.params;
          e.captures = w.caps.host;
          for (int64_t kv = 0; kv < kv_len; ++kv) {
            e.ints[static_cast<int>(Input::KvIdx)] = kv;
            truth[q * kv_len + kv] = evaluate(g, g.root, e, Precision::F64, scratch).i != 0;
          }
        }
        for (const auto& [tq, tk] : tiles)
          for (int64_t q0 = 0; q0 < q_len; q0 += tq)
            for (int64_t k0 = 0; k0 < kv_len; k0 += tk) {
              const Box x{{b, b}, {0, 0}, {q0, std::min(q0 + tq, q_len) - 1},
                          {k0, std::min(k0 + tk, kv_len) - 1}};
              bool any_t = false, any_f = false;
              for (int64_t q = x.q.lo; q <= x.q.hi; ++q)
                for (int64_t kv = x.kv.lo; kv <= x.kv.hi; ++kv)
                  (truth[q * kv_len + kv] ? any_t : any_f) = true;
              const Verdict want = !any_f ? Verdict::AlwaysTrue
                                   : !any_t ? Verdict::AlwaysFalse
                                            : Verdict::Unknown;
              const Verdict got = ev.verdict(w.env(x));
              decided += got != Verdict::Unknown;
              if (!mask.exact && want != Verdict::Unknown) {
                ++inexact_tiles;
                inexact_decided += got == want;
                if (got == Verdict::Unknown) continue;
              }
              if (got != want)
                FAIL_CHECK(fmt::format("`{}` on {} (params {}): {}, truth {}", mask.src,
                                       show(x, q_len, kv_len), fmt::join(w.params, ", "),
                                       show(got), show(want)));
            }
      }
    }
  }
  CHECK(decided > 0);
  WARN("2D neighbourhood: " << inexact_decided << " of " << inexact_tiles
                            << " uncut tiles decided");
}
