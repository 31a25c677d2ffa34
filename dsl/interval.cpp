// Interval evaluation of a mask over a box of (b, h, q_idx, kv_idx): the BlockMask builder's
// full / empty / partial tile verdicts. Semantics: dsl/ir.h and the notes at `evaluate`.
//
// An Int value is kept both as a hull [lo, hi] and as an affine form over the box coordinates
// plus an interval remainder, so that comparisons of linear expressions (q_idx >= kv_idx,
// q_idx - kv_idx <= W) are decided exactly from the box's corners, however often a coordinate
// occurs. Where an &&, || or ?: stays undecided, an operand is evaluated again on the part of the
// box where the other operand has the value that matters: the box narrowed by that operand's
// comparisons, plus the linear constraints themselves. That makes
// `kv_idx < G || q_idx < G || abs(q_idx - kv_idx) <= W` all true on a tile where the window
// holds for kv_idx, q_idx >= G, and `abs(d) <= W && d % D == 0` all false where the part of the
// tile inside the window holds no multiple of D. Nesting is bounded by kLevels and a work budget,
// so the cost stays linear in the graph.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <limits>

#include "dsl/analysis.h"

namespace flexc::dsl {
namespace {

using i128 = __int128;

constexpr int kVars = 4;             // affine coordinates: b, h, q_idx, kv_idx
constexpr int kLevels = 4;           // the box itself and up to three nested narrowings
constexpr int kMaxConstraints = 8;   // linear constraints a narrowed region carries
constexpr int kMaxNarrowDepth = 32;  // recursion bound when deriving constraints
constexpr int64_t kI32Min = std::numeric_limits<int32_t>::min();
constexpr int64_t kI32Max = std::numeric_limits<int32_t>::max();
constexpr int64_t kAffineLimit = int64_t(1) << 62;  // coefficients / remainders kept in int64
constexpr i128 kUnbounded = i128(1) << 100;         // beyond any linear value of the box
constexpr double kInf = std::numeric_limits<double>::infinity();
// Every float result except the exact ones (neg, abs, min, max, floor, ceil, sign, select) is
// widened by this relative margin plus kAbsMargin. It covers float32 rounding of every step,
// CUDA's math functions (fast-math intrinsics included) and flush-to-zero, so that one interval
// holds both the float64 oracle's value and the kernel's.
constexpr double kRelMargin = 1.0 / 1024;
constexpr double kAbsMargin = 1e-30;

int var_of(Input in) {
  switch (in) {
    case Input::B: return 0;
    case Input::H: return 1;
    case Input::QIdx: return 2;
    case Input::KvIdx: return 3;
    default: return -1;
  }
}

template <class T>
T floor_div(T a, T b) {  // b != 0
  T q = a / b;
  if (a % b != 0 && ((a < 0) != (b < 0))) --q;
  return q;
}
template <class T>
T ceil_div(T a, T b) {
  return -floor_div<T>(-a, b);
}

int64_t clamp_i32(double v) {
  if (std::isnan(v) || v <= static_cast<double>(kI32Min)) return kI32Min;
  if (v >= static_cast<double>(kI32Max)) return kI32Max;
  return static_cast<int64_t>(v);
}

// int(x): truncation toward zero, saturating.
int64_t saturating_int(double x) { return clamp_i32(std::trunc(x)); }

// ---- the abstract values

struct Val {
  // Bool: which values occur.
  bool may_f = true, may_t = true;
  // Int: the value lies in [lo, hi] and in sum(c[i] * x[i]) + [rlo, rhi], x = the box coordinates.
  // A value without a useful affine form has c = 0 and [rlo, rhi] = [lo, hi].
  int64_t lo = kI32Min, hi = kI32Max, rlo = kI32Min, rhi = kI32Max;
  std::array<int64_t, kVars> c{};
  // Float: the value lies in [flo, fhi] or is NaN where `nan`.
  double flo = -kInf, fhi = kInf;
  bool nan = true;
};

Val bool_val(bool may_f, bool may_t) {
  Val v;
  v.may_f = may_f;
  v.may_t = may_t;
  return v;
}

Val int_range(int64_t lo, int64_t hi) {
  Val v;
  v.lo = v.rlo = lo;
  v.hi = v.rhi = hi;
  return v;
}

Val int_point(int64_t k) { return int_range(k, k); }

Val float_range(double lo, double hi, bool nan) {
  Val v;
  v.flo = lo;
  v.fhi = hi;
  v.nan = nan;
  return v;
}

Val float_full() { return float_range(-kInf, kInf, true); }

// A float constant or param: the oracle's value and the kernel's float32 rounding of it (beyond
// the float range, FLT_MAX or infinity).
Val float_entry(double x) {
  if (std::isnan(x)) return float_full();
  if (x > FLT_MAX) return float_range(FLT_MAX, kInf, false);
  if (x < -FLT_MAX) return float_range(-kInf, -FLT_MAX, false);
  const double f = static_cast<float>(x);
  return float_range(std::min(x, f), std::max(x, f), false);
}

// A float result computed by an inexact operation: widened, and infinite beyond the float range.
Val inexact(double lo, double hi, bool nan) {
  if (std::isfinite(lo)) lo -= std::fabs(lo) * kRelMargin + kAbsMargin;
  if (std::isfinite(hi)) hi += std::fabs(hi) * kRelMargin + kAbsMargin;
  if (hi > FLT_MAX) hi = kInf;
  if (lo < -FLT_MAX) lo = -kInf;
  return float_range(lo, hi, nan);
}

bool is_point(const Val& v) { return v.lo == v.hi; }
bool has_affine(const Val& v) {
  return std::any_of(v.c.begin(), v.c.end(), [](int64_t x) { return x != 0; });
}

// Sets the affine part from wide values, or drops it when they do not fit.
void set_affine(Val& v, const std::array<i128, kVars>& c, i128 rlo, i128 rhi) {
  bool fits = rlo >= -kAffineLimit && rhi <= kAffineLimit;
  for (i128 x : c) fits = fits && x >= -kAffineLimit && x <= kAffineLimit;
  if (!fits) {
    v.c = {};
    v.rlo = v.lo;
    v.rhi = v.hi;
    return;
  }
  for (int i = 0; i < kVars; ++i) v.c[i] = static_cast<int64_t>(c[i]);
  v.rlo = static_cast<int64_t>(rlo);
  v.rhi = static_cast<int64_t>(rhi);
}

// ---- regions: a box and linear constraints on it

struct Constraint {
  std::array<int64_t, kVars> c{};
  i128 lo = 0, hi = 0;  // lo <= sum(c[i] * x[i]) <= hi
};

struct Region {
  std::array<int64_t, kVars> lo{}, hi{};
  std::array<Constraint, kMaxConstraints> con{};
  int ncon = 0;

  bool same_as(const Region& o) const {
    if (lo != o.lo || hi != o.hi || ncon != o.ncon) return false;
    for (int k = 0; k < ncon; ++k)
      if (con[k].lo != o.con[k].lo || con[k].hi != o.con[k].hi) return false;
    return true;
  }
};

struct Range128 {
  i128 lo, hi;
};

// Range of sum(c[i] * x[i]) over the box, leaving out coordinate `skip`.
Range128 linear_range(const std::array<int64_t, kVars>& c, const Region& r, int skip = -1) {
  Range128 out{0, 0};
  for (int i = 0; i < kVars; ++i) {
    if (i == skip || c[i] == 0) continue;
    const i128 a = i128(c[i]) * r.lo[i], b = i128(c[i]) * r.hi[i];
    out.lo += std::min(a, b);
    out.hi += std::max(a, b);
  }
  return out;
}

// Tightens an Int value's hull by its affine form over the region (box and constraints), and its
// remainder by the hull. The value is the mathematical one: no wrap-around yet.
void tighten(Val& v, const Region& r) {
  if (!has_affine(v)) {
    v.lo = std::max(v.lo, v.rlo);
    v.hi = std::min(v.hi, v.rhi);
    if (v.lo > v.hi) v.hi = v.lo;  // only in an empty region, where any value is right
    v.rlo = v.lo;
    v.rhi = v.hi;
    return;
  }
  Range128 lin = linear_range(v.c, r);
  for (int k = 0; k < r.ncon; ++k) {
    const Constraint& con = r.con[k];
    int j = 0;
    while (con.c[j] == 0) ++j;
    if (v.c[j] % con.c[j] != 0) continue;
    const int64_t m = v.c[j] / con.c[j];
    if (m == 0 || m > (1 << 30) || m < -(1 << 30)) continue;
    bool match = true;
    for (int i = 0; i < kVars; ++i) match = match && i128(v.c[i]) == i128(m) * con.c[i];
    if (!match) continue;
    const i128 a = m * con.lo, b = m * con.hi;
    lin.lo = std::max(lin.lo, std::min(a, b));
    lin.hi = std::min(lin.hi, std::max(a, b));
  }
  const i128 lo = std::max(i128(v.lo), lin.lo + v.rlo), hi = std::min(i128(v.hi), lin.hi + v.rhi);
  if (lo > hi) {  // only in an empty region, where any value is right
    v.hi = v.lo;
  } else {
    v.lo = static_cast<int64_t>(lo);
    v.hi = static_cast<int64_t>(hi);
  }
  v.rlo = static_cast<int64_t>(std::max(i128(v.rlo), i128(v.lo) - lin.hi));
  v.rhi = static_cast<int64_t>(std::min(i128(v.rhi), i128(v.hi) - lin.lo));
}

constexpr int64_t kSpan = int64_t(1) << 32;

// int32 wrap-around of a mathematical result: exact when the whole range lies in one window of
// 2^32 values. Else the affine form with its coefficients reduced modulo 2^32 (which moves the
// value by multiples of 2^32 only) may still lie in one window; failing that, the full range.
void wrap(Val& v, const Region& r) {
  if (v.lo >= kI32Min && v.hi <= kI32Max) return;
  const auto window = [](i128 x) { return floor_div<i128>(x - kI32Min, kSpan); };
  i128 lo = v.lo, hi = v.hi;
  std::array<i128, kVars> c = {v.c[0], v.c[1], v.c[2], v.c[3]};
  i128 rlo = v.rlo, rhi = v.rhi;
  if (window(lo) != window(hi)) {
    if (!has_affine(v)) {
      v = int_range(kI32Min, kI32Max);
      return;
    }
    for (i128& x : c) x -= window(x) * kSpan;
    const i128 rk = window(rlo) * kSpan;
    rlo -= rk;
    rhi -= rk;
    std::array<int64_t, kVars> c64;
    for (int i = 0; i < kVars; ++i) c64[i] = static_cast<int64_t>(c[i]);
    const Range128 lin = linear_range(c64, r);
    lo = lin.lo + rlo;
    hi = lin.hi + rhi;
    if (window(lo) != window(hi)) {
      v = int_range(kI32Min, kI32Max);
      return;
    }
  }
  const i128 shift = window(lo) * kSpan;
  v.lo = static_cast<int64_t>(lo - shift);
  v.hi = static_cast<int64_t>(hi - shift);
  set_affine(v, c, rlo - shift, rhi - shift);
}

void finish(Val& v, const Region& r) {
  tighten(v, r);
  wrap(v, r);
}

// ---- Int operations, on finished operands; each result is finished by the caller

Val i_scale(const Val& a, int64_t k) {
  Val v = int_range(std::min(a.lo * k, a.hi * k), std::max(a.lo * k, a.hi * k));
  const i128 r1 = i128(a.rlo) * k, r2 = i128(a.rhi) * k;
  set_affine(v, {i128(a.c[0]) * k, i128(a.c[1]) * k, i128(a.c[2]) * k, i128(a.c[3]) * k},
             std::min(r1, r2), std::max(r1, r2));
  return v;
}

// a + sign * b
Val i_add(const Val& a, const Val& b, int sign) {
  Val v = sign > 0 ? int_range(a.lo + b.lo, a.hi + b.hi) : int_range(a.lo - b.hi, a.hi - b.lo);
  std::array<i128, kVars> c;
  for (int i = 0; i < kVars; ++i) c[i] = i128(a.c[i]) + i128(sign) * b.c[i];
  if (sign > 0)
    set_affine(v, c, i128(a.rlo) + b.rlo, i128(a.rhi) + b.rhi);
  else
    set_affine(v, c, i128(a.rlo) - b.rhi, i128(a.rhi) - b.rlo);
  return v;
}

Val i_mul(const Val& a, const Val& b) {
  if (is_point(b)) return i_scale(a, b.lo);
  if (is_point(a)) return i_scale(b, a.lo);
  const int64_t p[4] = {a.lo * b.lo, a.lo * b.hi, a.hi * b.lo, a.hi * b.hi};
  return int_range(*std::min_element(p, p + 4), *std::max_element(p, p + 4));
}

Val join_int(const Val& a, const Val& b) {
  Val v = int_range(std::min(a.lo, b.lo), std::max(a.hi, b.hi));
  if (a.c == b.c) {
    v.c = a.c;
    v.rlo = std::min(a.rlo, b.rlo);
    v.rhi = std::max(a.rhi, b.rhi);
  }
  return v;
}

// Floored division (x // 0 == 0), before wrap-around.
Val i_floordiv(const Val& a, const Val& b) {
  if (is_point(b)) {
    const int64_t k = b.lo;
    if (k == 0) return int_point(0);
    const int64_t x = floor_div(a.lo, k), y = floor_div(a.hi, k);
    Val v = int_range(std::min(x, y), std::max(x, y));
    // An affine form whose coefficients are multiples of k stays affine.
    if (std::all_of(a.c.begin(), a.c.end(), [k](int64_t c) { return c % k == 0; })) {
      const int64_t r1 = floor_div(a.rlo, k), r2 = floor_div(a.rhi, k);
      set_affine(v, {a.c[0] / k, a.c[1] / k, a.c[2] / k, a.c[3] / k}, std::min(r1, r2),
                 std::max(r1, r2));
    }
    return v;
  }
  // Separately monotonic in each operand on each sign of the divisor: the corners bound it.
  int64_t lo = std::numeric_limits<int64_t>::max(), hi = std::numeric_limits<int64_t>::min();
  const auto part = [&](int64_t d1, int64_t d2) {
    for (int64_t x : {a.lo, a.hi})
      for (int64_t d : {d1, d2}) {
        lo = std::min(lo, floor_div(x, d));
        hi = std::max(hi, floor_div(x, d));
      }
  };
  if (b.lo < 0) part(b.lo, std::min<int64_t>(b.hi, -1));
  if (b.hi > 0) part(std::max<int64_t>(b.lo, 1), b.hi);
  if (b.lo <= 0 && b.hi >= 0) {
    lo = std::min<int64_t>(lo, 0);
    hi = std::max<int64_t>(hi, 0);
  }
  return int_range(lo, hi);
}

// Floored modulo (x % 0 == 0).
Val i_mod(const Val& a, const Val& b) {
  if (is_point(b)) {
    const int64_t k = b.lo;
    if (k == 0) return int_point(0);
    const int64_t p = floor_div(a.lo, k);
    if (p == floor_div(a.hi, k)) return i_add(a, int_point(k * p), -1);  // one period: a - k*p
    return k > 0 ? int_range(0, k - 1) : int_range(k + 1, 0);
  }
  int64_t lo = std::numeric_limits<int64_t>::max(), hi = std::numeric_limits<int64_t>::min();
  const auto add = [&](int64_t l, int64_t h) {
    lo = std::min(lo, l);
    hi = std::max(hi, h);
  };
  if (b.hi > 0) {  // positive divisors: [0, d - 1], and x itself where 0 <= x < d
    const int64_t d1 = std::max<int64_t>(b.lo, 1);
    if (a.lo >= 0)
      add(a.hi < d1 ? a.lo : 0, std::min(a.hi, b.hi - 1));
    else
      add(0, b.hi - 1);
  }
  if (b.lo < 0) {  // negative divisors: [d + 1, 0], and x itself where d < x <= 0
    const int64_t d2 = std::min<int64_t>(b.hi, -1);
    if (a.hi <= 0)
      add(std::max(a.lo, b.lo + 1), a.lo > d2 ? a.hi : 0);
    else
      add(b.lo + 1, 0);
  }
  if (b.lo <= 0 && b.hi >= 0) add(0, 0);
  return int_range(lo, hi);
}

// Shift counts are taken modulo 32: calls fn(s) for each count the range allows.
template <class Fn>
void for_each_count(const Val& b, Fn fn) {
  if (b.hi - b.lo >= 31) {
    for (int s = 0; s < 32; ++s) fn(s);
    return;
  }
  for (int64_t x = b.lo; x <= b.hi; ++x) fn(static_cast<int>(x & 31));
}

int64_t bit_mask(int64_t v) {  // smallest 2^k - 1 >= v (v >= 0)
  int64_t m = 0;
  while (m < v) m = m * 2 + 1;
  return m;
}

// Bitwise op on sign-definite ranges [xl, xh], [yl, yh] (each entirely < 0 or >= 0).
std::pair<int64_t, int64_t> bitwise_part(Op op, int64_t xl, int64_t xh, int64_t yl, int64_t yh) {
  const bool xn = xh < 0, yn = yh < 0;
  if (xn && yn) {  // via complements, which are >= 0: ~x & ~y == ~(x | y), ...
    const auto [l, h] = bitwise_part(op == Op::BitAnd ? Op::BitOr
                                     : op == Op::BitOr ? Op::BitAnd
                                                       : Op::BitXor,
                                     ~xh, ~xl, ~yh, ~yl);
    return op == Op::BitXor ? std::pair{l, h} : std::pair{~h, ~l};
  }
  if (xn != yn) {  // p >= 0, n < 0
    const int64_t ph = xn ? yh : xh, nl = xn ? xl : yl;
    switch (op) {
      case Op::BitAnd: return {0, ph};
      case Op::BitOr: return {nl, -1};
      default: return {~bit_mask(std::max(ph, ~nl)), -1};  // ~(p ^ ~n)
    }
  }
  switch (op) {
    case Op::BitAnd: return {0, std::min(xh, yh)};
    case Op::BitOr: return {std::max(xl, yl), bit_mask(std::max(xh, yh))};
    default: return {0, bit_mask(std::max(xh, yh))};
  }
}

Val i_bitwise(Op op, const Val& a, const Val& b) {
  if (is_point(a) && is_point(b)) {
    const int64_t x = a.lo, y = b.lo;
    return int_point(op == Op::BitAnd ? (x & y) : op == Op::BitOr ? (x | y) : (x ^ y));
  }
  int64_t lo = std::numeric_limits<int64_t>::max(), hi = std::numeric_limits<int64_t>::min();
  const auto parts = [](const Val& v, std::array<std::pair<int64_t, int64_t>, 2>& out) {
    int n = 0;
    if (v.lo < 0) out[n++] = {v.lo, std::min<int64_t>(v.hi, -1)};
    if (v.hi >= 0) out[n++] = {std::max<int64_t>(v.lo, 0), v.hi};
    return n;
  };
  std::array<std::pair<int64_t, int64_t>, 2> pa, pb;
  const int na = parts(a, pa), nb = parts(b, pb);
  for (int i = 0; i < na; ++i)
    for (int j = 0; j < nb; ++j) {
      const auto [l, h] = bitwise_part(op, pa[i].first, pa[i].second, pb[j].first, pb[j].second);
      lo = std::min(lo, l);
      hi = std::max(hi, h);
    }
  return int_range(lo, hi);
}

int64_t sign_of(int64_t x) { return (x > 0) - (x < 0); }

// ---- Float operations

Val f_neg(const Val& a) { return float_range(-a.fhi, -a.flo, a.nan); }

Val f_add(const Val& a, const Val& b) {
  const bool nan = a.nan || b.nan || (a.fhi == kInf && b.flo == -kInf) ||
                   (a.flo == -kInf && b.fhi == kInf);
  double lo = a.flo + b.flo, hi = a.fhi + b.fhi;
  if (std::isnan(lo)) lo = -kInf;
  if (std::isnan(hi)) hi = kInf;
  return inexact(lo, hi, nan);
}

bool contains_zero(const Val& a) { return a.flo <= 0 && a.fhi >= 0; }
bool has_inf(const Val& a) { return std::isinf(a.flo) || std::isinf(a.fhi); }

Val f_mul(const Val& a, const Val& b) {
  const double p[4] = {a.flo * b.flo, a.flo * b.fhi, a.fhi * b.flo, a.fhi * b.fhi};
  if (std::any_of(p, p + 4, [](double x) { return std::isnan(x); })) return float_full();
  const bool nan = a.nan || b.nan || (contains_zero(a) && has_inf(b)) ||
                   (contains_zero(b) && has_inf(a));
  return inexact(*std::min_element(p, p + 4), *std::max_element(p, p + 4), nan);
}

Val f_div(const Val& a, const Val& b) {
  if (contains_zero(b) || (has_inf(a) && has_inf(b))) return float_full();
  const double p[4] = {a.flo / b.flo, a.flo / b.fhi, a.fhi / b.flo, a.fhi / b.fhi};
  return inexact(*std::min_element(p, p + 4), *std::max_element(p, p + 4), a.nan || b.nan);
}

Val f_floor(const Val& a) { return float_range(std::floor(a.flo), std::floor(a.fhi), a.nan); }

// a - b * floor(a / b), each step rounded: composed from the steps, then bounded by [0, b) (or
// (b, 0]) plus the rounding error when the operands are finite and b keeps its sign.
Val f_mod(const Val& a, const Val& b) {
  const Val q = f_div(a, b);
  Val v = f_add(a, f_neg(f_mul(b, f_floor(q))));
  const double big = std::max({std::fabs(a.flo), std::fabs(a.fhi), std::fabs(b.flo),
                               std::fabs(b.fhi)});
  if (q.nan || has_inf(q) || !(big < 1e30) || contains_zero(b)) return v;
  const double m = 2 * big * kRelMargin + kAbsMargin;
  const double lo = b.flo > 0 ? -m : b.flo - m, hi = b.flo > 0 ? b.fhi + m : m;
  v.flo = std::max(v.flo, lo);
  v.fhi = std::min(v.fhi, hi);
  return v;
}

// fminf / fmaxf: a NaN operand is ignored, so a result is one of the operands' values.
Val f_minmax(const Val& a, const Val& b, bool is_min) {
  double lo = is_min ? std::min(a.flo, b.flo) : std::max(a.flo, b.flo);
  double hi = is_min ? std::min(a.fhi, b.fhi) : std::max(a.fhi, b.fhi);
  for (const Val* x : {&a, &b})
    if ((x == &a ? b : a).nan) {
      lo = std::min(lo, x->flo);
      hi = std::max(hi, x->fhi);
    }
  return float_range(lo, hi, a.nan && b.nan);
}

Val join_float(const Val& a, const Val& b) {
  return float_range(std::min(a.flo, b.flo), std::max(a.fhi, b.fhi), a.nan || b.nan);
}

// An increasing function whose values lie in [lo, hi] (the margin never leaves that range:
// CUDA's versions keep it too).
template <class Fn>
Val f_increasing(const Val& a, Fn fn, double lo = -kInf, double hi = kInf) {
  Val v = inexact(fn(a.flo), fn(a.fhi), a.nan);
  v.flo = std::max(v.flo, lo);
  v.fhi = std::min(v.fhi, hi);
  return v;
}

// log / log2 / sqrt: NaN below zero.
template <class Fn>
Val f_domain_nonneg(const Val& a, Fn fn, double lo = -kInf) {
  if (a.fhi < 0) return float_full();
  Val v = inexact(fn(std::max(a.flo, 0.0)), fn(a.fhi), a.nan || a.flo < 0);
  v.flo = std::max(v.flo, lo);
  return v;
}

Val f_pow(const Val& a, const Val& b) {
  if (a.nan || b.nan || !(a.flo > 0)) return float_full();
  // On a > 0, a^b is monotonic in each operand: the corners bound it.
  const double p[4] = {std::pow(a.flo, b.flo), std::pow(a.flo, b.fhi), std::pow(a.fhi, b.flo),
                       std::pow(a.fhi, b.fhi)};
  return inexact(*std::min_element(p, p + 4), *std::max_element(p, p + 4), false);
}

double fsign(double x) { return x > 0 ? 1.0 : x < 0 ? -1.0 : 0.0; }

// ---- comparisons

bool cmp_may(Op op, Range128 d, bool want) {
  // d = a - b ranges over [d.lo, d.hi]; can `a op b` be `want`?
  switch (op) {
    case Op::Lt: return want ? d.lo < 0 : d.hi >= 0;
    case Op::Le: return want ? d.lo <= 0 : d.hi > 0;
    case Op::Gt: return want ? d.hi > 0 : d.lo <= 0;
    case Op::Ge: return want ? d.hi >= 0 : d.lo < 0;
    case Op::Eq: return want ? (d.lo <= 0 && d.hi >= 0) : !(d.lo == 0 && d.hi == 0);
    default: return want ? !(d.lo == 0 && d.hi == 0) : (d.lo <= 0 && d.hi >= 0);  // Ne
  }
}

Val float_compare(Op op, const Val& a, const Val& b) {
  // NaN compares false (true for !=).
  const bool nan = a.nan || b.nan;
  bool may_t = false, may_f = false;
  switch (op) {
    case Op::Lt: may_t = a.flo < b.fhi; may_f = a.fhi >= b.flo; break;
    case Op::Le: may_t = a.flo <= b.fhi; may_f = a.fhi > b.flo; break;
    case Op::Gt: may_t = a.fhi > b.flo; may_f = a.flo <= b.fhi; break;
    case Op::Ge: may_t = a.fhi >= b.flo; may_f = a.flo < b.fhi; break;
    case Op::Eq:
    case Op::Ne: {
      const bool overlap = a.flo <= b.fhi && b.flo <= a.fhi;
      const bool same = a.flo == a.fhi && b.flo == b.fhi && a.flo == b.flo;
      may_t = op == Op::Eq ? overlap : !same;
      may_f = op == Op::Eq ? !same : overlap;
      if (op == Op::Ne) may_t = may_t || nan;
      break;
    }
    default: break;
  }
  if (op != Op::Ne) may_f = may_f || nan;
  return bool_val(may_f, may_t);
}

// The range of d = a - b where `a op b` is `want`; false when that is not one range (d != 0).
bool cmp_range(Op op, bool want, i128& lo, i128& hi) {
  // a < b is d <= -1, its negation d >= 0; the other orders are written as that one.
  const auto below = [&](int64_t bound, bool holds) {  // d <= bound where `holds`, else d > bound
    lo = holds ? -kUnbounded : bound + 1;
    hi = holds ? bound : kUnbounded;
    return true;
  };
  switch (op) {
    case Op::Lt: return below(-1, want);
    case Op::Le: return below(0, want);
    case Op::Gt: return below(0, !want);
    case Op::Ge: return below(-1, !want);
    case Op::Eq:
    case Op::Ne:
      lo = hi = 0;
      return want == (op == Op::Eq);
    default: return false;
  }
}

bool is_compare(Op op) {
  return op == Op::Lt || op == Op::Le || op == Op::Gt || op == Op::Ge || op == Op::Eq ||
         op == Op::Ne;
}

}  // namespace

// ---- the evaluator

struct IntervalEvaluator::Impl {
  const Graph& g;
  NodeId root;
  size_t n;
  std::vector<NodeId> live;        // nodes the root reaches, ascending (level 0 runs these)
  std::vector<Val> vals;           // kLevels x n
  std::vector<uint32_t> stamp;     // kLevels x n: the epoch a value was computed in
  std::array<uint32_t, kLevels> epoch{};
  std::array<std::vector<NodeId>, kLevels> stack;
  std::array<Region, kLevels> region;
  const IntervalEnv* env = nullptr;
  int64_t budget = 0;  // node evaluations left for narrowed re-evaluation

  Impl(const Graph& graph, NodeId r) : g(graph), root(r), n(r + 1) {
    std::vector<char> reach(n, 0);
    reach[root] = 1;
    for (NodeId id = root + 1; id-- > 0;)
      if (reach[id])
        for (NodeId a : g[id].operands()) reach[a] = 1;
    for (NodeId id = 0; id <= root; ++id)
      if (reach[id]) live.push_back(id);
    vals.resize(kLevels * n);
    stamp.assign(kLevels * n, 0);
  }

  Val& at(int level, NodeId id) { return vals[level * n + id]; }

  // Operand `id` as an Int (a Bool reads as 0 / 1).
  Val int_of(int level, NodeId id) {
    const Val& v = at(level, id);
    if (g[id].type != Type::Bool) return v;
    return int_range(v.may_f ? 0 : 1, v.may_t ? 1 : 0);
  }

  // Value `v` of node `id` as a condition (nonzero is true).
  Val truth(NodeId id, const Val& v) const {
    switch (g[id].type) {
      case Type::Bool: return v;
      case Type::Int: return bool_val(v.lo <= 0 && v.hi >= 0, !(v.lo == 0 && v.hi == 0));
      case Type::Float: break;
    }
    return bool_val(true, true);
  }
  Val truth_of(int level, NodeId id) { return truth(id, at(level, id)); }

  Val float_of(int level, NodeId id) {
    const Val& v = at(level, id);
    switch (g[id].type) {
      case Type::Float: return v;
      case Type::Bool: return float_range(v.may_f ? 0 : 1, v.may_t ? 1 : 0, false);
      case Type::Int: break;
    }
    // float32 rounds ints beyond 2^24.
    const double lo = static_cast<double>(v.lo), hi = static_cast<double>(v.hi);
    if (std::max(-lo, hi) <= double(1 << 24)) return float_range(lo, hi, false);
    return inexact(lo, hi, false);
  }

  // d = a - b over the region, exact where both are affine.
  Range128 diff_range(const Val& a, const Val& b, const Region& r) {
    Val d = i_add(a, b, -1);
    tighten(d, r);
    return {d.lo, d.hi};
  }

  bool can_refine(int level) const { return level + 1 < kLevels && budget > 0; }

  // ---- narrowing: shrink a region to one that still holds every point where a node has a value

  // sum(c[i] * x[i]) in [lo, hi]: tightens the box, records the constraint. False: no point left.
  bool constrain_linear(const std::array<int64_t, kVars>& c, i128 lo, i128 hi, Region& r) {
    int nz = 0;
    for (int64_t x : c) nz += x != 0;
    if (nz == 0) return lo <= 0 && hi >= 0;
    for (int pass = 0; pass < 2; ++pass)
      for (int i = 0; i < kVars; ++i) {
        if (c[i] == 0) continue;
        const Range128 rest = linear_range(c, r, i);
        // c[i] * x in [lo - rest.hi, hi - rest.lo]
        i128 l = lo - rest.hi, h = hi - rest.lo;
        i128 xl, xh;
        if (c[i] > 0) {
          xl = ceil_div<i128>(l, c[i]);
          xh = floor_div<i128>(h, c[i]);
        } else {
          xl = ceil_div<i128>(h, c[i]);
          xh = floor_div<i128>(l, c[i]);
        }
        r.lo[i] = static_cast<int64_t>(std::max<i128>(r.lo[i], xl));
        r.hi[i] = static_cast<int64_t>(std::min<i128>(r.hi[i], xh));
        if (r.lo[i] > r.hi[i]) return false;
      }
    const Range128 all = linear_range(c, r);
    lo = std::max(lo, all.lo);
    hi = std::min(hi, all.hi);
    if (lo > hi) return false;
    if (nz < 2) return true;  // a single coordinate: the box says it all
    for (int k = 0; k < r.ncon; ++k)
      if (r.con[k].c == c) {
        r.con[k].lo = std::max(r.con[k].lo, lo);
        r.con[k].hi = std::min(r.con[k].hi, hi);
        return r.con[k].lo <= r.con[k].hi;
      }
    if (r.ncon < kMaxConstraints) r.con[r.ncon++] = Constraint{c, lo, hi};
    return true;
  }

  // The Int node `id` (evaluated at `level`) lies in [lo, hi].
  bool constrain_node(NodeId id, i128 lo, i128 hi, Region& r, int level, int depth) {
    const Val v = int_of(level, id);
    lo = std::max<i128>(lo, v.lo);
    hi = std::min<i128>(hi, v.hi);
    if (lo > hi) return false;
    if (has_affine(v)) return constrain_linear(v.c, lo - v.rhi, hi - v.rlo, r);
    const Node& nd = g[id];
    if (depth > kMaxNarrowDepth || nd.type != Type::Int) return true;
    const auto arg = [&](int k) { return nd.args[k]; };
    switch (nd.op) {
      case Op::Abs:  // no wrap-around unless the operand can be INT_MIN
        if (at(level, arg(0)).lo == kI32Min) return true;
        return constrain_node(arg(0), -hi, hi, r, level, depth + 1);
      case Op::Neg:
        if (at(level, arg(0)).lo == kI32Min) return true;
        return constrain_node(arg(0), -hi, -lo, r, level, depth + 1);
      case Op::Min:  // min >= lo: both are
        return lo <= kI32Min ||
               (constrain_node(arg(0), lo, kUnbounded, r, level, depth + 1) &&
                constrain_node(arg(1), lo, kUnbounded, r, level, depth + 1));
      case Op::Max:  // max <= hi: both are
        return hi >= kI32Max ||
               (constrain_node(arg(0), -kUnbounded, hi, r, level, depth + 1) &&
                constrain_node(arg(1), -kUnbounded, hi, r, level, depth + 1));
      default: return true;
    }
  }

  // Shrinks `r` (a subset of region[level]) to a region that still holds every point of it where
  // node `id` is `want`. False when there is provably none.
  bool narrow(NodeId id, bool want, Region& r, int level, int depth) {
    const Val v = truth_of(level, id);
    if (!(want ? v.may_t : v.may_f)) return false;
    if (!(want ? v.may_f : v.may_t) || depth > kMaxNarrowDepth) return true;
    const Node& nd = g[id];
    if (nd.type != Type::Bool) return true;
    const auto arg = [&](int k) { return nd.args[k]; };
    switch (nd.op) {
      case Op::Not: return narrow(arg(0), !want, r, level, depth + 1);
      case Op::And: case Op::BitAnd: case Op::Min:
      case Op::Or: case Op::BitOr: case Op::Max: {
        const bool conj = nd.op == Op::And || nd.op == Op::BitAnd || nd.op == Op::Min;
        if (conj == want)  // both operands are `want`
          return narrow(arg(0), want, r, level, depth + 1) &&
                 narrow(arg(1), want, r, level, depth + 1);
        Region r1 = r, r2 = r;  // either is: the hull of the two boxes
        const bool e1 = narrow(arg(0), want, r1, level, depth + 1);
        const bool e2 = narrow(arg(1), want, r2, level, depth + 1);
        if (!e1 || !e2) {
          if (e1 || e2) r = e1 ? r1 : r2;
          return e1 || e2;
        }
        for (int i = 0; i < kVars; ++i) {
          r.lo[i] = std::min(r1.lo[i], r2.lo[i]);
          r.hi[i] = std::max(r1.hi[i], r2.hi[i]);
        }
        return true;
      }
      default: break;
    }
    if (!is_compare(nd.op) || g[arg(0)].type == Type::Float) return true;
    i128 lo, hi;
    if (!cmp_range(nd.op, want, lo, hi)) return true;
    const Val a = int_of(level, arg(0)), b = int_of(level, arg(1));
    if (is_point(b)) return constrain_node(arg(0), lo + b.lo, hi + b.lo, r, level, depth + 1);
    if (is_point(a)) return constrain_node(arg(1), a.lo - hi, a.lo - lo, r, level, depth + 1);
    const Val d = i_add(a, b, -1);
    return constrain_linear(d.c, lo - d.rhi, hi - d.rlo, r);
  }

  // Evaluates node `target` on `r` (a narrowing of region[level]) at level + 1, or takes its value
  // on region[level] when the narrowing changed nothing.
  Val eval_on(NodeId target, const Region& r, int level) {
    if (r.same_as(region[level])) return at(level, target);
    region[level + 1] = r;
    return eval(target, level + 1);
  }

  // Can `target` be `want` at a point where `cond` is `cond_want`?
  bool may_where(NodeId target, bool want, NodeId cond, bool cond_want, int level) {
    Region r = region[level];
    if (!narrow(cond, cond_want, r, level, 0)) return false;
    const Val v = truth(target, eval_on(target, r, level));
    return want ? v.may_t : v.may_f;
  }

  // ---- evaluation of one node

  Val load(const Node& nd, int level) {
    Val full = nd.type == Type::Int ? int_range(kI32Min, kI32Max)
               : nd.type == Type::Bool ? bool_val(true, true)
                                       : float_full();
    if (!env->capture_range || nd.slot >= env->capture_shapes.size()) return full;
    const std::vector<int64_t>& shape = env->capture_shapes[nd.slot];
    if (shape.size() != nd.nargs) return full;
    std::array<IntRange, kMaxArgs> idx{};
    for (int k = 0; k < nd.nargs; ++k) {
      const int64_t dim = shape[k];
      if (dim <= 0) return full;
      const Val i = int_of(level, nd.args[k]);
      const int64_t p = floor_div(i.lo, dim);  // an index outside [0, dim) wraps
      idx[k] = p == floor_div(i.hi, dim) ? IntRange{i.lo - p * dim, i.hi - p * dim}
                                         : IntRange{0, dim - 1};
    }
    const auto r = env->capture_range(nd.slot, std::span<const IntRange>(idx.data(), nd.nargs));
    if (!r || std::isnan(r->first) || std::isnan(r->second) || r->first > r->second) return full;
    switch (nd.type) {
      case Type::Int:
        return int_range(clamp_i32(std::floor(r->first)), clamp_i32(std::ceil(r->second)));
      case Type::Bool:
        return bool_val(r->first <= 0 && r->second >= 0, !(r->first == 0 && r->second == 0));
      case Type::Float: break;
    }
    return float_range(r->first, r->second, false);
  }

  Val leaf(const Node& nd, int level) {
    switch (nd.op) {
      case Op::Const:
        if (nd.type == Type::Bool) return bool_val(!nd.ival, nd.ival != 0);
        if (nd.type == Type::Int) {
          Val v = int_point(nd.ival);
          wrap(v, region[level]);
          return v;
        }
        return float_entry(nd.fval);
      case Op::Input: {
        if (nd.input == Input::Score) return float_full();
        if (nd.input == Input::QLen || nd.input == Input::KvLen) {
          Val v = int_point(nd.input == Input::QLen ? env->q_len : env->kv_len);
          wrap(v, region[level]);
          return v;
        }
        const int i = var_of(nd.input);
        Val v = int_range(region[level].lo[i], region[level].hi[i]);
        v.c[i] = 1;
        v.rlo = v.rhi = 0;
        return v;
      }
      case Op::Param: {
        if (nd.slot >= env->params.size())
          return nd.type == Type::Float ? float_full() : int_range(kI32Min, kI32Max);
        const double p = env->params[nd.slot];
        return nd.type == Type::Float ? float_entry(p) : int_point(saturating_int(p));
      }
      default: return load(nd, level);
    }
  }

  Val compute_bool(const Node& nd, int level) {
    const auto arg = [&](int k) { return nd.args[k]; };
    switch (nd.op) {
      case Op::Not: {
        const Val a = truth_of(level, arg(0));
        return bool_val(a.may_t, a.may_f);
      }
      case Op::And: case Op::BitAnd: case Op::Min:
      case Op::Or: case Op::BitOr: case Op::Max: {
        const bool conj = nd.op == Op::And || nd.op == Op::BitAnd || nd.op == Op::Min;
        const Val a = truth_of(level, arg(0)), b = truth_of(level, arg(1));
        // &&: false where either operand is, true where both are; || is the dual.
        Val v = conj ? bool_val(a.may_f || b.may_f, a.may_t && b.may_t)
                     : bool_val(a.may_f && b.may_f, a.may_t || b.may_t);
        bool& both = conj ? v.may_t : v.may_f;  // the outcome that needs both operands
        const bool either = conj ? v.may_f : v.may_t;
        if (both && either && can_refine(level)) {
          // Look for it in b where a has it, then in a where b has it.
          both = may_where(arg(1), conj, arg(0), conj, level) &&
                 may_where(arg(0), conj, arg(1), conj, level);
        }
        return v;
      }
      case Op::BitXor: {
        const Val a = truth_of(level, arg(0)), b = truth_of(level, arg(1));
        return bool_val((a.may_t && b.may_t) || (a.may_f && b.may_f),
                        (a.may_t && b.may_f) || (a.may_f && b.may_t));
      }
      case Op::Select: return select(nd, level);
      default: break;
    }
    if (!is_compare(nd.op)) return bool_val(true, true);
    if (g[arg(0)].type == Type::Float)
      return float_compare(nd.op, float_of(level, arg(0)), float_of(level, arg(1)));
    const Range128 d = diff_range(int_of(level, arg(0)), int_of(level, arg(1)), region[level]);
    return bool_val(cmp_may(nd.op, d, false), cmp_may(nd.op, d, true));
  }

  Val join(Type t, const Val& a, const Val& b) {
    switch (t) {
      case Type::Bool: return bool_val(a.may_f || b.may_f, a.may_t || b.may_t);
      case Type::Int: return join_int(a, b);
      case Type::Float: break;
    }
    return join_float(a, b);
  }

  // c ? x : y, each branch evaluated where the condition selects it.
  Val select(const Node& nd, int level) {
    const Val c = truth_of(level, nd.args[0]);
    const NodeId x = nd.args[1], y = nd.args[2];
    if (!c.may_f) return at(level, x);
    if (!c.may_t) return at(level, y);
    if (!can_refine(level)) return join(nd.type, at(level, x), at(level, y));
    Region rx = region[level], ry = region[level];
    const bool ex = narrow(nd.args[0], true, rx, level, 0);
    const bool ey = narrow(nd.args[0], false, ry, level, 0);
    if (!ex || !ey) return at(level, ex ? x : y);
    const Val vx = eval_on(x, rx, level);
    return join(nd.type, vx, eval_on(y, ry, level));
  }

  Val compute_int(const Node& nd, int level) {
    const Region& r = region[level];
    const auto a = [&](int k) { return int_of(level, nd.args[k]); };
    Val v;
    switch (nd.op) {
      case Op::Neg: v = i_scale(a(0), -1); break;
      case Op::BitNot: v = i_add(i_scale(a(0), -1), int_point(1), -1); break;
      case Op::Add: v = i_add(a(0), a(1), 1); break;
      case Op::Sub: v = i_add(a(0), a(1), -1); break;
      case Op::Mul: v = i_mul(a(0), a(1)); break;
      case Op::FloorDiv: v = i_floordiv(a(0), a(1)); break;
      case Op::Mod: v = i_mod(a(0), a(1)); break;
      case Op::Shl:
      case Op::Shr: {
        const Val x = a(0);
        bool first = true;
        for_each_count(a(1), [&](int s) {
          Val part = nd.op == Op::Shl ? i_scale(x, int64_t(1) << s)
                                      : i_floordiv(x, int_point(int64_t(1) << s));
          finish(part, r);
          v = first ? part : join_int(v, part);
          first = false;
        });
        break;
      }
      case Op::BitAnd: case Op::BitOr: case Op::BitXor: v = i_bitwise(nd.op, a(0), a(1)); break;
      case Op::Min: case Op::Max: v = minmax(a(0), a(1), nd.op == Op::Min, r); break;
      case Op::Clamp: {
        Val lo = minmax(a(0), a(1), false, r);
        finish(lo, r);
        v = minmax(lo, a(2), true, r);
        break;
      }
      case Op::Abs: {
        const Val x = a(0);
        v = x.lo >= 0 ? x : x.hi <= 0 ? i_scale(x, -1) : int_range(0, std::max(-x.lo, x.hi));
        break;
      }
      case Op::Sign: v = int_range(sign_of(a(0).lo), sign_of(a(0).hi)); break;
      case Op::Select: v = select(nd, level); break;
      case Op::ToInt: {
        if (g[nd.args[0]].type != Type::Float) {
          v = a(0);
          break;
        }
        const Val& f = at(level, nd.args[0]);
        v = int_range(saturating_int(f.flo), saturating_int(f.fhi));
        if (f.nan) v = join_int(v, int_point(0));
        break;
      }
      case Op::Floor: case Op::Ceil: v = a(0); break;
      default: v = int_range(kI32Min, kI32Max); break;
    }
    finish(v, r);
    return v;
  }

  Val minmax(const Val& x, const Val& y, bool is_min, const Region& r) {
    const Range128 d = diff_range(x, y, r);
    if (d.hi <= 0) return is_min ? x : y;
    if (d.lo >= 0) return is_min ? y : x;
    Val v = is_min ? int_range(std::min(x.lo, y.lo), std::min(x.hi, y.hi))
                   : int_range(std::max(x.lo, y.lo), std::max(x.hi, y.hi));
    if (x.c == y.c) {  // same linear part: min / max of the remainders
      v.c = x.c;
      v.rlo = is_min ? std::min(x.rlo, y.rlo) : std::max(x.rlo, y.rlo);
      v.rhi = is_min ? std::min(x.rhi, y.rhi) : std::max(x.rhi, y.rhi);
    }
    return v;
  }

  Val compute_float(const Node& nd, int level) {
    const auto a = [&](int k) { return float_of(level, nd.args[k]); };
    switch (nd.op) {
      case Op::ToFloat: return a(0);
      case Op::Neg: return f_neg(a(0));
      case Op::Abs: {
        const Val x = a(0);
        if (x.flo >= 0) return x;
        if (x.fhi <= 0) return f_neg(x);
        return float_range(0, std::max(-x.flo, x.fhi), x.nan);
      }
      case Op::Add: return f_add(a(0), a(1));
      case Op::Sub: return f_add(a(0), f_neg(a(1)));
      case Op::Mul: return f_mul(a(0), a(1));
      case Op::Div: return f_div(a(0), a(1));
      case Op::FloorDiv: return f_floor(f_div(a(0), a(1)));
      case Op::Mod: return f_mod(a(0), a(1));
      case Op::Min: case Op::Max: return f_minmax(a(0), a(1), nd.op == Op::Min);
      case Op::Clamp: return f_minmax(f_minmax(a(0), a(1), false), a(2), true);
      case Op::Select: return select(nd, level);
      case Op::Floor: return f_floor(a(0));
      case Op::Ceil: {
        const Val x = a(0);
        return float_range(std::ceil(x.flo), std::ceil(x.fhi), x.nan);
      }
      case Op::Sign: {
        const Val x = a(0);
        return float_range(fsign(x.flo), fsign(x.fhi), x.nan);
      }
      case Op::Exp: return f_increasing(a(0), [](double x) { return std::exp(x); }, 0);
      case Op::Exp2: return f_increasing(a(0), [](double x) { return std::exp2(x); }, 0);
      case Op::Tanh: return f_increasing(a(0), [](double x) { return std::tanh(x); }, -1, 1);
      case Op::Sigmoid:
        return f_increasing(a(0), [](double x) { return 1 / (1 + std::exp(-x)); }, 0, 1);
      case Op::Log: return f_domain_nonneg(a(0), [](double x) { return std::log(x); });
      case Op::Log2: return f_domain_nonneg(a(0), [](double x) { return std::log2(x); });
      case Op::Sqrt: return f_domain_nonneg(a(0), [](double x) { return std::sqrt(x); }, 0);
      case Op::Rsqrt: {
        const Val x = a(0);
        if (!(x.flo > 0)) return float_full();  // rsqrt(-0) == -inf, rsqrt(+0) == +inf
        Val v = inexact(1 / std::sqrt(x.fhi), 1 / std::sqrt(x.flo), x.nan);
        v.flo = std::max(v.flo, 0.0);
        return v;
      }
      case Op::Sin: case Op::Cos: {
        const Val x = a(0);
        return float_range(-1, 1, x.nan || has_inf(x));
      }
      case Op::Pow: return f_pow(a(0), a(1));
      default: return float_full();
    }
  }

  Val compute(NodeId id, int level) {
    const Node& nd = g[id];
    if (nd.op == Op::Const || nd.op == Op::Input || nd.op == Op::Param || nd.op == Op::Load)
      return leaf(nd, level);
    switch (nd.type) {
      case Type::Bool: return compute_bool(nd, level);
      case Type::Int: return compute_int(nd, level);
      case Type::Float: break;
    }
    return compute_float(nd, level);
  }

  // Evaluates what `target` reaches on region[level] (level >= 1), depth first.
  const Val& eval(NodeId target, int level) {
    uint32_t& ep = epoch[level];
    if (++ep == 0) {  // epochs wrapped: forget every stamp of this level
      std::fill(stamp.begin() + level * n, stamp.begin() + (level + 1) * n, 0);
      ep = 1;
    }
    uint32_t* st = stamp.data() + level * n;
    std::vector<NodeId>& todo = stack[level];
    todo.clear();
    todo.push_back(target);
    while (!todo.empty()) {
      const NodeId id = todo.back();
      if (st[id] == ep) {
        todo.pop_back();
        continue;
      }
      bool ready = true;
      for (NodeId a : g[id].operands())
        if (st[a] != ep) {
          todo.push_back(a);
          ready = false;
        }
      if (!ready) continue;
      todo.pop_back();
      at(level, id) = compute(id, level);
      st[id] = ep;
      --budget;
    }
    return at(level, target);
  }

  Verdict verdict(const IntervalEnv& e) {
    env = &e;
    const IntRange box[kVars] = {e.b, e.h, e.q_idx, e.kv_idx};
    Region& r = region[0];
    r.ncon = 0;
    for (int i = 0; i < kVars; ++i) {
      if (box[i].lo > box[i].hi) return Verdict::Unknown;  // no tile
      // A coordinate beyond int32 reads wrapped: then it may be anything.
      const bool in32 = box[i].lo >= kI32Min && box[i].hi <= kI32Max;
      r.lo[i] = in32 ? box[i].lo : kI32Min;
      r.hi[i] = in32 ? box[i].hi : kI32Max;
    }
    budget = 16 * static_cast<int64_t>(live.size()) + 256;
    for (NodeId id : live) at(0, id) = compute(id, 0);
    const Val v = truth_of(0, root);
    if (v.may_t && !v.may_f) return Verdict::AlwaysTrue;
    if (v.may_f && !v.may_t) return Verdict::AlwaysFalse;
    return Verdict::Unknown;
  }
};

IntervalEvaluator::IntervalEvaluator(const Graph& g, NodeId root)
    : impl_(std::make_unique<Impl>(g, root)) {}
IntervalEvaluator::~IntervalEvaluator() = default;
IntervalEvaluator::IntervalEvaluator(IntervalEvaluator&&) noexcept = default;
IntervalEvaluator& IntervalEvaluator::operator=(IntervalEvaluator&&) noexcept = default;

Verdict IntervalEvaluator::verdict(const IntervalEnv& env) { return impl_->verdict(env); }

Verdict interval_verdict(const Graph& g, NodeId root, const IntervalEnv& env) {
  return IntervalEvaluator(g, root).verdict(env);
}

}  // namespace flexc::dsl
