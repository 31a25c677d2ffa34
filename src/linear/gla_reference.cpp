// The float64 CPU reference of gated linear attention: the recurrence (`gold`) and the kernels'
// chunkwise computation with their rounding points (`ref`), see include/flexc/linear.h.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "flexc/error.h"
#include "flexc/linear.h"
#include "reference/reference_common.h"

namespace flexc {

namespace {

constexpr int kChunk = 64, kSub = 16;

struct Head {
  const LinearReferenceProblem& p;
  int64_t b, h;
  double scale;
  // Element accessors of this head's inputs.
  double q(int64_t t, int64_t d) const {
    return p.q[((b * p.heads + h) * p.seq_len + t) * p.dk + d];
  }
  double k(int64_t t, int64_t d) const {
    return p.k[((b * p.k_heads + h / (p.heads / p.k_heads)) * p.seq_len + t) * p.dk + d];
  }
  double v(int64_t t, int64_t e) const {
    return p.v[((b * p.k_heads + h / (p.heads / p.k_heads)) * p.seq_len + t) * p.dv + e];
  }
  // The log gate as the kernels take it: below -1e4 it is -1e4 (exp 0 either way).
  double g(int64_t t, int64_t d) const {
    if (p.g.empty()) return 0;
    const int64_t row = (b * p.heads + h) * p.seq_len + t;
    return std::max(-1e4, double(p.per_dim_gates ? p.g[row * p.dk + d] : p.g[row]));
  }
  double h0(int64_t d, int64_t e) const {
    return p.initial_state.empty() ? 0 : p.initial_state[((b * p.heads + h) * p.dk + d) * p.dv + e];
  }
};

void gold_head(const Head& x, double* out, double* state) {
  const LinearReferenceProblem& p = x.p;
  std::vector<double> S(size_t(p.dk * p.dv));
  for (int64_t d = 0; d < p.dk; ++d)
    for (int64_t e = 0; e < p.dv; ++e) S[d * p.dv + e] = x.h0(d, e);
  for (int64_t t = 0; t < p.seq_len; ++t) {
    for (int64_t d = 0; d < p.dk; ++d) {
      const double a = std::exp(x.g(t, d)), kd = x.k(t, d);
      for (int64_t e = 0; e < p.dv; ++e) S[d * p.dv + e] = a * S[d * p.dv + e] + kd * x.v(t, e);
    }
    for (int64_t e = 0; e < p.dv; ++e) out[t * p.dv + e] = 0;
    for (int64_t d = 0; d < p.dk; ++d) {
      const double qd = x.scale * x.q(t, d);
      for (int64_t e = 0; e < p.dv; ++e) out[t * p.dv + e] += qd * S[d * p.dv + e];
    }
  }
  std::copy(S.begin(), S.end(), state);
}

// templates/linear/gla.cuh's chunkwise algorithm, rounded where it rounds (unless exact_ref).
void ref_head(const Head& x, double* out, double* state) {
  const LinearReferenceProblem& p = x.p;
  const auto rnd = [&](double v) { return p.exact_ref ? v : detail::round_to(p.dtype, v); };
  const double steep_bound = (p.dtype == DType::BF16 ? 80.0 : 8.0) / std::log2(std::exp(1.0));
  const int64_t DK = p.dk, DV = p.dv;
  // One gate per step or none: the kernels' scalar path (templates/linear/gla.cuh, kScalar).
  const bool scalar = p.g.empty() || !p.per_dim_gates;
  std::vector<double> S(size_t(DK * DV)), S16(S.size()), gc(size_t(kChunk * DK));
  for (int64_t d = 0; d < DK; ++d)
    for (int64_t e = 0; e < DV; ++e) S[d * DV + e] = x.h0(d, e);
  std::vector<double> A(kChunk * kChunk), o(static_cast<size_t>(DV));
  for (int64_t t0 = 0; t0 < p.seq_len; t0 += kChunk) {
    const int64_t rows = std::min<int64_t>(kChunk, p.seq_len - t0);
    for (size_t i = 0; i < S.size(); ++i) S16[i] = rnd(S[i]);
    for (int64_t d = 0; d < DK; ++d) {
      double run = 0;
      for (int64_t r = 0; r < kChunk; ++r) gc[r * DK + d] = run += r < rows ? x.g(t0 + r, d) : 0;
    }
    auto G = [&](int64_t r, int64_t d) { return gc[r * DK + d]; };
    // A: blocks below the diagonal against the key block's last row, diagonal blocks against
    // their first row (steep dims exactly).
    std::fill(A.begin(), A.end(), 0.0);
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t I = i / kSub, f = I * kSub;
      for (int64_t j = 0; j <= i; ++j) {
        const int64_t J = j / kSub, e = J * kSub + kSub - 1;
        double a = 0;
        if (scalar) {  // (q . k) exp(gc_i - gc_j): no scaled operands
          for (int64_t d = 0; d < DK; ++d) a += x.q(t0 + i, d) * x.k(t0 + j, d);
          A[i * kChunk + j] = rnd(a * std::exp(G(i, 0) - G(j, 0)) * x.scale);
          continue;
        }
        for (int64_t d = 0; d < DK; ++d) {
          const double qd = x.q(t0 + i, d), kd = x.k(t0 + j, d);
          if (J < I) {
            a += rnd(qd * std::exp(G(i, d) - G(e, d))) * rnd(kd * std::exp(G(e, d) - G(j, d)));
          } else if (G(f, d) - G(f + kSub - 1, d) > steep_bound) {
            a += qd * kd * std::exp(G(i, d) - G(j, d));
          } else {
            a += rnd(qd * std::exp(G(i, d) - G(f, d))) * rnd(kd * std::exp(G(f, d) - G(j, d)));
          }
        }
        A[i * kChunk + j] = rnd(a * x.scale);
      }
    }
    for (int64_t i = 0; i < rows; ++i) {
      std::fill(o.begin(), o.end(), 0.0);
      for (int64_t d = 0; d < DK; ++d) {
        // Scalar gates scale the row after the product, per-dim ones the operand before it.
        const double qg = scalar ? x.q(t0 + i, d) : rnd(x.q(t0 + i, d) * std::exp(G(i, d)));
        for (int64_t e = 0; e < DV; ++e) o[e] += qg * S16[d * DV + e];
      }
      for (int64_t e = 0; e < DV; ++e) o[e] *= x.scale * (scalar ? std::exp(G(i, 0)) : 1.0);
      for (int64_t j = 0; j <= i; ++j)
        for (int64_t e = 0; e < DV; ++e) o[e] += A[i * kChunk + j] * x.v(t0 + j, e);
      for (int64_t e = 0; e < DV; ++e) out[(t0 + i) * DV + e] = rnd(o[e]);
    }
    // The state update with Khat = k * exp(gc_last - gc), rounded.
    for (int64_t d = 0; d < DK; ++d) {
      const double last = G(kChunk - 1, d), decay = std::exp(last);
      for (int64_t e = 0; e < DV; ++e) S[d * DV + e] *= decay;
      for (int64_t r = 0; r < rows; ++r) {
        const double kh = rnd(x.k(t0 + r, d) * std::exp(last - G(r, d)));
        for (int64_t e = 0; e < DV; ++e) S[d * DV + e] += kh * x.v(t0 + r, e);
      }
    }
  }
  std::copy(S.begin(), S.end(), state);
}

double rmse(const std::vector<double>& gold, std::span<const float> x, int64_t& bad) {
  double e = 0;
  for (size_t i = 0; i < gold.size(); ++i) {
    if (!std::isfinite(x[i])) {
      ++bad;
      continue;
    }
    e += (x[i] - gold[i]) * (x[i] - gold[i]);
  }
  return gold.empty() ? 0 : std::sqrt(e / double(gold.size()));
}

double rms(const std::vector<double>& x) {
  double e = 0;
  for (double v : x) e += v * v;
  return x.empty() ? 0 : std::sqrt(e / double(x.size()));
}

double rmse(const std::vector<double>& gold, const std::vector<double>& x) {
  double e = 0;
  for (size_t i = 0; i < gold.size(); ++i) e += (x[i] - gold[i]) * (x[i] - gold[i]);
  return gold.empty() ? 0 : std::sqrt(e / double(gold.size()));
}

// Sizes and gates; returns the scale.
double check_problem(const LinearReferenceProblem& p, const char* what) {
  const auto fail = [&](const std::string& m) { throw Error(fmt::format("{}: {}", what, m)); };
  if (p.batch < 0 || p.heads < 1 || p.k_heads < 1 || p.heads % p.k_heads != 0 || p.seq_len < 0 ||
      p.dk < 1 || p.dv < 1)
    fail(fmt::format("bad sizes: B {}, H {}, Hk {}, T {}, DK {}, DV {}", p.batch, p.heads,
                     p.k_heads, p.seq_len, p.dk, p.dv));
  const auto expect = [&](const char* name, size_t got, int64_t want) {
    if (got != size_t(want)) fail(fmt::format("{} has {} elements; {} expected", name, got, want));
  };
  const int64_t rows = p.batch * p.heads * p.seq_len, krows = p.batch * p.k_heads * p.seq_len;
  expect("q", p.q.size(), rows * p.dk);
  expect("k", p.k.size(), krows * p.dk);
  expect("v", p.v.size(), krows * p.dv);
  if (!p.g.empty()) expect("g", p.g.size(), p.per_dim_gates ? rows * p.dk : rows);
  if (!p.initial_state.empty())
    expect("initial_state", p.initial_state.size(), p.batch * p.heads * p.dk * p.dv);
  for (size_t i = 0; i < p.g.size(); ++i)
    if (!(p.g[i] <= 0))
      fail(fmt::format("g[{}] = {} (flat index): log gates must be <= 0", i, p.g[i]));
  return p.scale.value_or(1.0 / std::sqrt(double(p.dk)));
}

// templates/linear/gla_backward.cuh's chunkwise backward of one head, rounded where it rounds
// (unless exact_ref): dq, dg (per key dim and token, before any sum over dims) and dh0 into `r`;
// this head's dk, dv (float32 in the kernel; the caller sums a group's and rounds) into dk_h, dv_h.
void ref_backward_head(const Head& x, std::span<const float> dout, std::span<const float> dstate,
                       LinearGradientValues& r, std::vector<double>& dk_h,
                       std::vector<double>& dv_h, std::vector<double>& db) {
  const LinearReferenceProblem& p = x.p;
  const auto rnd = [&](double v) { return p.exact_ref ? v : detail::round_to(p.dtype, v); };
  const double steep_bound = (p.dtype == DType::BF16 ? 80.0 : 8.0) / std::log2(std::exp(1.0));
  const int64_t DK = p.dk, DV = p.dv, T = p.seq_len, bh = x.b * p.heads + x.h;
  const int64_t chunks = (T + kChunk - 1) / kChunk;
  const auto dO = [&](int64_t t, int64_t e) { return double(dout[(bh * T + t) * DV + e]); };
  const auto qv = [&](int64_t t, int64_t d) { return t < T ? x.q(t, d) : 0.0; };
  const auto kv = [&](int64_t t, int64_t d) { return t < T ? x.k(t, d) : 0.0; };
  // gc per chunk (natural log units; the padding rows' gates are 0).
  std::vector<double> gc(size_t(chunks * kChunk * DK));
  for (int64_t n = 0; n < chunks; ++n)
    for (int64_t d = 0; d < DK; ++d) {
      double run = 0;
      for (int64_t r0 = 0; r0 < kChunk; ++r0) {
        const int64_t t = n * kChunk + r0;
        gc[(t * DK) + d] = run += t < T ? x.g(t, d) : 0;
      }
    }
  const auto G = [&](int64_t t, int64_t d) { return gc[t * DK + d]; };
  // The chunk start states (forward, Kend rounded) and state gradients (Qexp rounded), each
  // rounded as the per-chunk kernel reads them.
  std::vector<double> S(size_t(DK * DV)), S16(size_t(chunks * DK * DV)), D16(S16.size());
  for (int64_t d = 0; d < DK; ++d)
    for (int64_t e = 0; e < DV; ++e) S[d * DV + e] = x.h0(d, e);
  for (int64_t n = 0; n < chunks; ++n) {
    for (size_t i = 0; i < S.size(); ++i) S16[n * DK * DV + i] = rnd(S[i]);
    for (int64_t d = 0; d < DK; ++d) {
      const double last = G(n * kChunk + kChunk - 1, d);
      for (int64_t e = 0; e < DV; ++e) S[d * DV + e] *= std::exp(last);
      for (int64_t t = n * kChunk; t < std::min(T, n * kChunk + kChunk); ++t) {
        const double kend = rnd(x.k(t, d) * std::exp(last - G(t, d)));
        for (int64_t e = 0; e < DV; ++e) S[d * DV + e] += kend * x.v(t, e);
      }
    }
  }
  std::vector<double> D(size_t(DK * DV));
  for (size_t i = 0; i < D.size(); ++i) D[i] = dstate.empty() ? 0 : dstate[bh * DK * DV + i];
  // The final state's term of every dg: sum_e S_T dS_T per key dim.
  std::vector<double> fin(size_t(DK), 0.0);
  for (int64_t d = 0; d < DK; ++d)
    for (int64_t e = 0; e < DV; ++e) fin[d] += S[d * DV + e] * D[d * DV + e];
  for (int64_t n = chunks - 1; n >= 0; --n) {
    for (size_t i = 0; i < D.size(); ++i) D16[n * DK * DV + i] = rnd(D[i]);
    for (int64_t d = 0; d < DK; ++d) {
      for (int64_t e = 0; e < DV; ++e) D[d * DV + e] *= std::exp(G(n * kChunk + kChunk - 1, d));
      for (int64_t t = n * kChunk; t < std::min(T, n * kChunk + kChunk); ++t) {
        const double qe = rnd(x.scale * x.q(t, d) * std::exp(G(t, d)));
        for (int64_t e = 0; e < DV; ++e) D[d * DV + e] += qe * dO(t, e);
      }
    }
  }
  std::copy(D.begin(), D.end(), r.dh0.begin() + bh * DK * DV);

  std::vector<double> qhat(size_t(kChunk * DK)), khat(qhat.size()), qchk(qhat.size()),
      kchk(qhat.size()), A(kChunk * kChunk), dA(A.size());
  std::vector<char> steep(size_t(4 * DK));
  for (int64_t n = 0; n < chunks; ++n) {
    const int64_t t0 = n * kChunk;
    const double* s16 = &S16[n * DK * DV];
    const double* d16 = &D16[n * DK * DV];
    const auto g = [&](int64_t r0, int64_t d) { return G(t0 + r0, d); };
    for (int64_t blk = 0; blk < 4; ++blk)
      for (int64_t d = 0; d < DK; ++d)
        steep[blk * DK + d] = g(blk * kSub, d) - g(blk * kSub + kSub - 1, d) > steep_bound;
    for (int64_t i = 0; i < kChunk; ++i) {
      const int64_t f = i / kSub * kSub, e = f + kSub - 1;
      for (int64_t d = 0; d < DK; ++d) {
        const double q = qv(t0 + i, d), k = kv(t0 + i, d);
        const bool st = steep[i / kSub * DK + d];
        qhat[i * DK + d] = rnd(q * std::exp(g(i, d) - g(f, d)));
        khat[i * DK + d] = rnd(k * std::exp(g(e, d) - g(i, d)));
        qchk[i * DK + d] = st ? 0 : rnd(q * std::exp(g(i, d) - g(e, d)));
        kchk[i * DK + d] = st ? 0 : rnd(k * std::exp(g(f, d) - g(i, d)));
      }
    }
    // cf[I][J] = exp(gc_fI - gc_eJ), per key dim.
    const auto cf = [&](int64_t I, int64_t J, int64_t d) {
      return std::exp(g(I * kSub, d) - g(J * kSub + kSub - 1, d));
    };
    // The exact term of a steep dim on a diagonal block.
    const auto exact = [&](int64_t i, int64_t j, int64_t d) {
      return qv(t0 + i, d) * kv(t0 + j, d) * std::exp(g(i, d) - g(j, d));
    };
    for (int64_t i = 0; i < kChunk; ++i)
      for (int64_t j = 0; j < kChunk; ++j) {
        const int64_t I = i / kSub, J = j / kSub;
        double a = 0, da = 0;
        if (j <= i) {
          for (int64_t d = 0; d < DK; ++d) {
            if (J < I)
              a += rnd(qhat[i * DK + d] * cf(I, J, d)) * khat[j * DK + d];
            else
              a += steep[I * DK + d] ? exact(i, j, d) : qhat[i * DK + d] * kchk[j * DK + d];
          }
          for (int64_t e = 0; e < DV; ++e)
            da += (t0 + i < T ? dO(t0 + i, e) : 0) * (t0 + j < T ? x.v(t0 + j, e) : 0);
        }
        A[i * kChunk + j] = rnd(x.scale * a), dA[i * kChunk + j] = rnd(x.scale * da);
      }
    for (int64_t i = 0; i < std::min<int64_t>(kChunk, T - t0); ++i) {
      const int64_t I = i / kSub, f = I * kSub, e = f + kSub - 1, t = t0 + i;
      for (int64_t d = 0; d < DK; ++d) {
        // dq: the bracket, then its row factor, then the steep dims' exact terms.
        double bq = 0, state = 0;
        for (int64_t j = f; j <= i; ++j) bq += dA[i * kChunk + j] * kchk[j * DK + d];
        for (int64_t J = 0; J < I; ++J) {
          double part = 0;
          for (int64_t j = J * kSub; j < J * kSub + kSub; ++j)
            part += dA[i * kChunk + j] * khat[j * DK + d];
          bq += cf(I, J, d) * part;
        }
        for (int64_t ee = 0; ee < DV; ++ee) state += dO(t, ee) * s16[d * DV + ee];
        bq += x.scale * std::exp(g(f, d)) * state;
        double dq = std::exp(g(i, d) - g(f, d)) * bq;
        if (steep[I * DK + d])
          for (int64_t j = f; j <= i; ++j)
            dq += dA[i * kChunk + j] * kv(t0 + j, d) * std::exp(g(i, d) - g(j, d));
        // dk of row i (as j in the formulas).
        double bk = 0;
        state = 0;
        for (int64_t u = i; u <= e; ++u) bk += dA[u * kChunk + i] * qchk[u * DK + d];
        for (int64_t U = I + 1; U < 4; ++U) {
          double part = 0;
          for (int64_t u = U * kSub; u < U * kSub + kSub; ++u)
            part += dA[u * kChunk + i] * qhat[u * DK + d];
          bk += cf(U, I, d) * part;
        }
        for (int64_t ee = 0; ee < DV; ++ee) state += x.v(t, ee) * d16[d * DV + ee];
        bk += std::exp(g(kChunk - 1, d) - g(e, d)) * state;
        double dk = std::exp(g(e, d) - g(i, d)) * bk;
        if (steep[I * DK + d])
          for (int64_t u = i; u <= e; ++u)
            dk += dA[u * kChunk + i] * qv(t0 + u, d) * std::exp(g(u, d) - g(i, d));
        r.dq[(bh * T + t) * DK + d] = rnd(dq);
        dk_h[t * DK + d] += dk;
        db[t * DK + d] = x.q(t, d) * dq - x.k(t, d) * dk;
      }
      for (int64_t ee = 0; ee < DV; ++ee) {
        double dv = 0;
        for (int64_t u = i; u < kChunk; ++u)
          dv += A[u * kChunk + i] * (t0 + u < T ? dO(t0 + u, ee) : 0);
        for (int64_t d = 0; d < DK; ++d)
          dv += rnd(x.k(t, d) * std::exp(g(kChunk - 1, d) - g(i, d))) * d16[d * DV + ee];
        dv_h[t * DV + ee] += dv;
      }
    }
  }
  // dg: the running sum of db from the end, plus the final state's term; 0 where clamped.
  for (int64_t d = 0; d < DK; ++d) {
    double run = fin[d];
    for (int64_t t = T - 1; t >= 0; --t) db[t * DK + d] = run += db[t * DK + d];
  }
}

// The gradients of one group of heads sharing k and v (their dk, dv are summed).
void backward_group(const LinearReferenceProblem& p, double scale, int64_t b, int64_t hk,
                    std::span<const float> dout, std::span<const float> dstate,
                    LinearReferenceGradients& out) {
  const int64_t DK = p.dk, DV = p.dv, T = p.seq_len, group = p.heads / p.k_heads;
  std::vector<double> S(size_t((T + 1) * DK * DV)), dS(size_t(DK * DV));
  std::vector<double> dk_h(size_t(T * DK)), dv_h(size_t(T * DV)), db(size_t(T * DK));
  LinearGradientValues& r = out.gold;
  const auto gate_round = [&](double v) {
    return p.exact_ref ? v : detail::round_to(p.gate_dtype, v);
  };
  for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
    const Head x{p, b, h, scale};
    const int64_t bh = b * p.heads + h;
    ref_backward_head(x, dout, dstate, out.ref, dk_h, dv_h, db);
    for (int64_t t = 0; t < T && !p.g.empty(); ++t) {
      if (!p.per_dim_gates) {
        double sum = 0;
        for (int64_t d = 0; d < DK; ++d) sum += db[t * DK + d];
        const int64_t gi = bh * T + t;
        out.ref.dg[gi] = p.g[gi] > -1e4 ? gate_round(sum) : 0;
        continue;
      }
      for (int64_t d = 0; d < DK; ++d) {
        const int64_t gi = (bh * T + t) * DK + d;
        out.ref.dg[gi] = p.g[gi] > -1e4 ? gate_round(db[t * DK + d]) : 0;
      }
    }
    const int64_t krow = (b * p.k_heads + hk) * T;
    // Forward, keeping every state: S[t] is the state after t tokens.
    for (int64_t d = 0; d < DK; ++d)
      for (int64_t e = 0; e < DV; ++e) S[d * DV + e] = x.h0(d, e);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t d = 0; d < DK; ++d) {
        const double a = std::exp(x.g(t, d)), kd = x.k(t, d);
        const double* prev = &S[(t * DK + d) * DV];
        double* next = &S[((t + 1) * DK + d) * DV];
        for (int64_t e = 0; e < DV; ++e) next[e] = a * prev[e] + kd * x.v(t, e);
      }
    for (int64_t i = 0; i < DK * DV; ++i) dS[i] = dstate.empty() ? 0 : dstate[bh * DK * DV + i];
    for (int64_t t = T - 1; t >= 0; --t) {
      const double* st = &S[(t + 1) * DK * DV];
      const double* prev = &S[t * DK * DV];
      const float* dot = &dout[(bh * T + t) * DV];
      // o_t = scale q_t S_t: into dq_t and dS_t.
      for (int64_t d = 0; d < DK; ++d) {
        double dq = 0;
        for (int64_t e = 0; e < DV; ++e) {
          dq += dot[e] * st[d * DV + e];
          dS[d * DV + e] += scale * x.q(t, d) * dot[e];
        }
        r.dq[(bh * T + t) * DK + d] = scale * dq;
      }
      // S_t = diag(a_t) S_{t-1} + k_t^T v_t.
      for (int64_t d = 0; d < DK; ++d) {
        const double a = std::exp(x.g(t, d));
        double dk = 0, da = 0;
        for (int64_t e = 0; e < DV; ++e) {
          dk += dS[d * DV + e] * x.v(t, e);
          da += dS[d * DV + e] * prev[d * DV + e];
          r.dv[(krow + t) * DV + e] += x.k(t, d) * dS[d * DV + e];
          dS[d * DV + e] *= a;
        }
        r.dk[(krow + t) * DK + d] += dk;
        // d/dg exp(g) = exp(g); a gate clamped at -1e4 has no gradient.
        if (p.g.empty()) continue;
        const int64_t gi = p.per_dim_gates ? (bh * T + t) * DK + d : bh * T + t;
        if (p.g[gi] > -1e4) r.dg[gi] += da * a;
      }
    }
    std::copy(dS.begin(), dS.end(), r.dh0.begin() + bh * DK * DV);
  }
  // The kernel sums a group's float32 dk, dv, then rounds.
  const auto rnd = [&](double v) { return p.exact_ref ? v : detail::round_to(p.dtype, v); };
  const int64_t krow = (b * p.k_heads + hk) * T;
  for (int64_t i = 0; i < T * DK; ++i) out.ref.dk[krow * DK + i] = rnd(dk_h[i]);
  for (int64_t i = 0; i < T * DV; ++i) out.ref.dv[krow * DV + i] = rnd(dv_h[i]);
}

// The problem over phi(q), phi(k) rounded to the input type, as the kernels read them (unless
// exact_ref: then phi's values themselves, for tests against finite differences).
struct Mapped {
  std::vector<float> q, k;
  LinearReferenceProblem p;
  explicit Mapped(const LinearReferenceProblem& in) : p(in) {
    const FeatureMap& fm = *in.feature_map;
    for (auto [src, dst] : {std::pair{in.q, &q}, {in.k, &k}}) {
      dst->resize(src.size());
      for (size_t i = 0; i < src.size(); ++i)
        (*dst)[i] = static_cast<float>(in.exact_ref ? fm(src[i])
                                                    : detail::round_to(in.dtype, fm(src[i])));
    }
    p.q = q, p.k = k;
    p.feature_map.reset();
  }
};

}  // namespace

LinearReferenceResult reference_linear_attention(const LinearReferenceProblem& p) {
  if (p.feature_map) return reference_linear_attention(Mapped(p).p);
  const double scale = check_problem(p, "flexc::reference_linear_attention");
  LinearReferenceResult r;
  const size_t out_n = size_t(p.batch * p.heads * p.seq_len * p.dv), state_n = size_t(p.batch * p.heads * p.dk * p.dv);
  r.gold_out.resize(out_n), r.ref_out.resize(out_n);
  r.gold_state.resize(state_n), r.ref_state.resize(state_n);
  detail::parallel_chunks(p.batch * p.heads * 2, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t bh = i / 2, b = bh / p.heads, h = bh % p.heads;
      const Head x{p, b, h, scale};
      double* out = (i % 2 ? r.ref_out : r.gold_out).data() + bh * p.seq_len * p.dv;
      double* st = (i % 2 ? r.ref_state : r.gold_state).data() + bh * p.dk * p.dv;
      (i % 2 ? ref_head : gold_head)(x, out, st);
    }
  });
  return r;
}

LinearReferenceGradients reference_linear_attention_backward(const LinearReferenceProblem& p,
                                                             std::span<const float> dout,
                                                             std::span<const float> dstate) {
  constexpr const char* what = "flexc::reference_linear_attention_backward";
  if (p.feature_map) {
    check_problem(p, what);
    LinearReferenceGradients r = reference_linear_attention_backward(Mapped(p).p, dout, dstate);
    // d/dx of phi(x): dq and dk through phi' (ref rounds the product, as the kernel does).
    const FeatureMap& fm = *p.feature_map;
    for (auto [x, gold, ref] : {std::tuple{p.q, &r.gold.dq, &r.ref.dq}, {p.k, &r.gold.dk, &r.ref.dk}})
      for (size_t i = 0; i < x.size(); ++i) {
        const double d = fm.derivative(x[i]);
        (*gold)[i] *= d;
        (*ref)[i] = p.exact_ref ? (*ref)[i] * d : detail::round_to(p.dtype, (*ref)[i] * d);
      }
    return r;
  }
  const double scale = check_problem(p, what);
  const int64_t rows = p.batch * p.heads * p.seq_len, krows = p.batch * p.k_heads * p.seq_len;
  const int64_t states = p.batch * p.heads * p.dk * p.dv;
  if (dout.size() != size_t(rows * p.dv) || (!dstate.empty() && dstate.size() != size_t(states)))
    throw Error(fmt::format("{}: dout has {} elements ({} expected), dstate {} ({} or none)", what,
                            dout.size(), rows * p.dv, dstate.size(), states));
  LinearReferenceGradients r;
  for (LinearGradientValues* x : {&r.gold, &r.ref}) {
    x->dq.assign(size_t(rows * p.dk), 0.0);
    x->dk.assign(size_t(krows * p.dk), 0.0);
    x->dv.assign(size_t(krows * p.dv), 0.0);
    x->dg.assign(p.g.size(), 0.0);
    x->dh0.assign(size_t(states), 0.0);
  }
  detail::parallel_chunks(p.batch * p.k_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      backward_group(p, scale, i / p.k_heads, i % p.k_heads, dout, dstate, r);
  });
  return r;
}

BackwardAccuracy check_linear_gradients(const LinearReferenceGradients& r,
                                        std::span<const float> dq, std::span<const float> dk,
                                        std::span<const float> dv, std::span<const float> dg,
                                        std::span<const float> dh0) {
  BackwardAccuracy acc;
  acc.pass = true;
  const auto one = [&](const char* name, const std::vector<double>& gold,
                       const std::vector<double>& ref, std::span<const float> x) {
    if (x.size() != gold.size())
      throw Error(fmt::format("flexc::check_linear_gradients: {} has {} values; the reference {}",
                              name, x.size(), gold.size()));
    GradientAccuracy g;
    g.name = name;
    g.rmse = rmse(gold, x, g.bad);
    g.ref_rmse = rmse(gold, ref);
    g.floor = std::ldexp(rms(gold), -16);
    g.pass = g.bad == 0 && g.rmse <= 1.5 * g.ref_rmse + g.floor + 1e-6;
    acc.pass = acc.pass && g.pass;
    acc.grads.push_back(g);
  };
  one("dq", r.gold.dq, r.ref.dq, dq);
  one("dk", r.gold.dk, r.ref.dk, dk);
  one("dv", r.gold.dv, r.ref.dv, dv);
  if (!r.gold.dg.empty()) one("dg", r.gold.dg, r.ref.dg, dg);
  if (!dh0.empty()) one("dh0", r.gold.dh0, r.ref.dh0, dh0);
  return acc;
}

std::string LinearAccuracy::summary() const {
  return fmt::format("out rmse {:.3g} (ref {:.3g}), state rmse {:.3g} (ref {:.3g}), {} bad: {}",
                     out_rmse, out_ref_rmse, state_rmse, state_ref_rmse, bad,
                     pass ? "PASS" : "FAIL");
}

LinearAccuracy check_linear_accuracy(const LinearReferenceResult& r, std::span<const float> out,
                                     std::span<const float> state) {
  if (out.size() != r.gold_out.size() || (!state.empty() && state.size() != r.gold_state.size()))
    throw Error(fmt::format("flexc::check_linear_accuracy: {} output / {} state values for a "
                            "reference of {} / {}",
                            out.size(), state.size(), r.gold_out.size(), r.gold_state.size()));
  LinearAccuracy a;
  a.out_rmse = rmse(r.gold_out, out, a.bad);
  a.out_ref_rmse = rmse(r.gold_out, r.ref_out);
  if (!state.empty()) {
    a.state_rmse = rmse(r.gold_state, state, a.bad);
    a.state_ref_rmse = rmse(r.gold_state, r.ref_state);
  }
  // float32 accumulation's floor, as the backward's rule has it: where ref rounds nothing (no
  // gates: Khat = k), the state's only error is float32 sums over the sequence.
  const auto floor = [](const std::vector<double>& gold) { return std::ldexp(rms(gold), -16); };
  a.pass = a.bad == 0 && a.out_rmse <= 1.5 * a.out_ref_rmse + floor(r.gold_out) + 1e-6 &&
           a.state_rmse <= 1.5 * a.state_ref_rmse + floor(r.gold_state) + 1e-6;
  return a;
}

}  // namespace flexc
