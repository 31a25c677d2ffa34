// Backward attention: argument validation and configurations (CI), and the kernel's gradients on
// the GPU ([gpu]): against attention's gradient written out directly in float64 (independent of
// the DSL and of flexc's reference), and, for every catalogue variant and score_mods with learnable
// captures, against the float64 reference with the tolerance rule.
#include <fmt/format.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <functional>
#include <limits>
#include <random>

#include "attention/attention_kernel.h"
#include "flexc/attention.h"
#include "flexc/blockmask.h"
#include "flexc/device.h"
#include "flexc/error.h"
#include "flexc/reference.h"
#include "flexc/variant.h"
#include "jit/jit.h"
#include "test_random.h"
#include "test_tensors.h"

using namespace flexc;
using flexc::testing::rng;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

using flexc::testing::download16;
using flexc::testing::normal;
using flexc::testing::random_capture;
using flexc::testing::SweepShape;
using flexc::testing::sweep_shape;
using flexc::testing::round16;

// A score_mod written out: the modded score (or -inf where masked), its derivative, and for a
// learnable per-head vector (alibi's slope) the derivative with respect to element h.
struct Mod {
  std::function<double(double, int64_t, int64_t, int64_t, int64_t)> value;
  std::function<double(double, int64_t, int64_t, int64_t, int64_t)> grad;
  std::function<double(int64_t, int64_t)> head_grad = nullptr;  // (q_idx, kv_idx)
};

struct Shape {
  int64_t B = 1, Hq = 1, Hkv = 1, Lq = 1, Lkv = 1, D = 64;
};

struct Grads {
  std::vector<double> dq, dk, dv, dhead;  // dhead: per query head, when mod.head_grad is set
};

// The gradient of sum(out * dout) for attention with `mod`, in float64, given the forward's
// output as the kernel stored it (`stored_out`, for delta = rowsum(dout * out), as every
// FlashAttention-style backward computes it: the per-head sums a capture gradient adds up cancel
// to a small remainder, so exact float64 outputs there would measure the forward's rounding).
Grads direct_backward(const Shape& s, const std::vector<float>& q, const std::vector<float>& k,
                      const std::vector<float>& v, const std::vector<float>& dout,
                      const std::vector<float>& stored_out, double scale, const Mod& mod) {
  Grads g;
  g.dq.assign(q.size(), 0), g.dk.assign(k.size(), 0), g.dv.assign(v.size(), 0);
  g.dhead.assign(s.Hq, 0);
  const int64_t D = s.D;
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.Hq; ++h)
      for (int64_t i = 0; i < s.Lq; ++i) {
        const int64_t row = (b * s.Hq + h) * s.Lq + i, hk = h / (s.Hq / s.Hkv);
        auto kv_at = [&](int64_t j) { return ((b * s.Hkv + hk) * s.Lkv + j) * D; };
        std::vector<double> x(s.Lkv), sc(s.Lkv), p(s.Lkv);
        double mx = -kInf;
        for (int64_t j = 0; j < s.Lkv; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += double(q[row * D + d]) * k[kv_at(j) + d];
          x[j] = dot * scale;
          sc[j] = mod.value(x[j], b, h, i, j);
          mx = std::max(mx, sc[j]);
        }
        if (mx == -kInf) continue;
        double l = 0;
        for (int64_t j = 0; j < s.Lkv; ++j) l += p[j] = std::exp(sc[j] - mx);
        for (int64_t j = 0; j < s.Lkv; ++j) p[j] /= l;
        double delta = 0;
        for (int64_t d = 0; d < D; ++d) delta += double(dout[row * D + d]) * stored_out[row * D + d];
        for (int64_t j = 0; j < s.Lkv; ++j) {
          if (p[j] == 0) continue;
          double dp = 0;
          for (int64_t d = 0; d < D; ++d) {
            dp += double(dout[row * D + d]) * v[kv_at(j) + d];
            g.dv[kv_at(j) + d] += p[j] * dout[row * D + d];
          }
          const double dscore = p[j] * (dp - delta);
          if (mod.head_grad) g.dhead[h] += dscore * mod.head_grad(i, j);
          const double ds = dscore * mod.grad(x[j], b, h, i, j) * scale;
          for (int64_t d = 0; d < D; ++d) {
            g.dq[row * D + d] += ds * k[kv_at(j) + d];
            g.dk[kv_at(j) + d] += ds * q[row * D + d];
          }
        }
      }
  return g;
}

// rmse(got - want) / rms(want).
double relative_rmse(const std::vector<float>& got, const std::vector<double>& want) {
  REQUIRE(got.size() == want.size());
  double e = 0, n = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return kInf;
    e += (got[i] - want[i]) * (got[i] - want[i]);
    n += want[i] * want[i];
  }
  return n == 0 ? std::sqrt(e) : std::sqrt(e / n);
}

flexc::DeviceBuffer upload16(DType d, const std::vector<float>& x, const std::vector<int64_t>& shape,
                           TensorView& view) {
  flexc::DeviceBuffer buf = flexc::testing::upload16(d, x);
  view = TensorView{buf.get(), d, shape, {}};
  return buf;
}

// Forward (to get out and lse) then backward on the GPU, against direct_backward.
// With `slope` (alibi), the slope capture is uploaded and its gradient checked too.
// Every case runs the backward twice: dk and dv must come out bitwise equal, and dq too when
// `deterministic`.
void check_case(const Variant& variant, const Mod& mod, const Shape& s, DType dtype,
                bool block_mask, const std::vector<float>* slope = nullptr,
                bool deterministic = false) {
  INFO(fmt::format("{} {} B {} Hq {} Hkv {} Q_LEN {} KV_LEN {} D {}{}{}", variant.name(),
                   dtype_name(dtype), s.B, s.Hq, s.Hkv, s.Lq, s.Lkv, s.D,
                   block_mask ? "" : " dense", deterministic ? " deterministic" : ""));
  const std::vector<int64_t> qs{s.B, s.Hq, s.Lq, s.D}, ks{s.B, s.Hkv, s.Lkv, s.D};
  const std::vector<float> q = normal(s.B * s.Hq * s.Lq * s.D, dtype),
                           k = normal(s.B * s.Hkv * s.Lkv * s.D, dtype),
                           v = normal(s.B * s.Hkv * s.Lkv * s.D, dtype),
                           dout = normal(q.size(), dtype);
  const std::vector<float> nan(q.size(), std::numeric_limits<float>::quiet_NaN());
  const std::vector<float> nan_kv(k.size(), std::numeric_limits<float>::quiet_NaN());
  TensorView tq, tk, tv, tout, tdout, tdq, tdk, tdv;
  const auto bq = upload16(dtype, q, qs, tq), bk = upload16(dtype, k, ks, tk),
             bv = upload16(dtype, v, ks, tv), bout = upload16(dtype, nan, qs, tout),
             bdout = upload16(dtype, dout, qs, tdout), bdq = upload16(dtype, nan, qs, tdq),
             bdk = upload16(dtype, nan_kv, ks, tdk), bdv = upload16(dtype, nan_kv, ks, tdv);
  flexc::DeviceBuffer blse(std::max<int64_t>(s.B * s.Hq * s.Lq, 4) * 4);
  const TensorView tlse{blse.get(), DType::F32, {s.B, s.Hq, s.Lq}, {}};

  std::map<std::string, TensorView, std::less<>> captures;
  AttentionGrads grads{tdq, tdk, tdv, {}};
  flexc::DeviceBuffer bslope(64), bdslope(64);
  if (slope) {
    bslope = flexc::DeviceBuffer(slope->size() * 4);
    bslope.upload(slope->data(), slope->size() * 4);
    const std::vector<float> start(slope->size(), 0.25f);  // the kernel adds to what is there
    bdslope = flexc::DeviceBuffer(slope->size() * 4);
    bdslope.upload(start.data(), start.size() * 4);
    captures["slope"] = TensorView{bslope.get(), DType::F32, {s.Hq}, {}};
    grads.captures["slope"] = TensorView{bdslope.get(), DType::F32, {s.Hq}, {}};
  }
  std::optional<BlockMask> bm;
  if (block_mask && !variant.mask_always_true())
    bm = create_block_mask(variant, s.B, s.Hq, s.Lq, s.Lkv);
  AttentionOptions fo;
  fo.block_mask = bm ? &*bm : nullptr;
  fo.captures = captures;
  fo.lse = tlse;
  attention(tq, tk, tv, tout, variant, fo);
  BackwardOptions bo;
  bo.block_mask = fo.block_mask;
  bo.captures = captures;
  bo.deterministic = deterministic;
  attention_backward(tq, tk, tv, tout, tlse, tdout, grads, variant, bo);
  // Again into fresh poisoned buffers (capture gradients are not compared: atomics).
  TensorView tdq2, tdk2, tdv2;
  const auto bdq2 = upload16(dtype, nan, qs, tdq2), bdk2 = upload16(dtype, nan_kv, ks, tdk2),
             bdv2 = upload16(dtype, nan_kv, ks, tdv2);
  attention_backward(tq, tk, tv, tout, tlse, tdout, {tdq2, tdk2, tdv2, {}}, variant, bo);
  flexc::synchronize_device();
  CHECK(bdk.to_vector<uint16_t>(k.size()) == bdk2.to_vector<uint16_t>(k.size()));
  CHECK(bdv.to_vector<uint16_t>(k.size()) == bdv2.to_vector<uint16_t>(k.size()));
  if (deterministic) CHECK(bdq.to_vector<uint16_t>(q.size()) == bdq2.to_vector<uint16_t>(q.size()));

  const Grads want = direct_backward(s, q, k, v, dout, download16(dtype, bout, q.size()),
                                    1.0 / std::sqrt(double(s.D)), mod);
  // bf16 rounds P and dS before their products (as FlashAttention does): about 2^-8 relative.
  const double bar = dtype == DType::BF16 ? 2e-2 : 4e-3;
  const double eq = relative_rmse(download16(dtype, bdq, q.size()), want.dq);
  const double ek = relative_rmse(download16(dtype, bdk, k.size()), want.dk);
  const double ev = relative_rmse(download16(dtype, bdv, v.size()), want.dv);
  INFO(fmt::format("relative rmse dq {:.3g} dk {:.3g} dv {:.3g} (bar {:.3g})", eq, ek, ev, bar));
  CHECK(eq < bar);
  CHECK(ek < bar);
  CHECK(ev < bar);
  if (slope) {
    std::vector<float> dslope = bdslope.to_vector<float>(s.Hq);
    for (float& x : dslope) x -= 0.25f;
    const double es = relative_rmse(dslope, want.dhead);
    INFO(fmt::format("relative rmse dslope {:.3g}", es));
    CHECK(es < bar);
  }
}

#define SKIP_WITHOUT_GPU()      \
  if (!flexc::gpu_available()) {  \
    WARN("no GPU: skipped");    \
    return;                     \
  }

// ---- against the reference, with the tolerance rule

struct BwdCase {
  DType dtype = DType::BF16;
  int64_t B = 1, Hq = 1, Hkv = 1, Lq = 1, Lkv = 1, D = 64;
  bool block_mask = true;  // build one (when the mask is not `true`)
  bool broadcast = false;  // over B and H where the mask reads neither
  bool deterministic = true;
  FwdKernel kernel = FwdKernel::Auto;
  bool grads_f32 = false;  // dq, dk, dv in float32 (unrounded) instead of the input dtype
  bool accumulate = false;  // with grads_f32: added into buffers holding random values
  // A block of a longer sequence (0: none): positions of query 0 and key 0, the lengths the mods
  // see (0: offset + rows).
  int64_t q_offset = 0, kv_offset = 0, seq_q_len = 0, seq_kv_len = 0;
  // prepare_attention and prepare_attention_backward first, with the JIT's memory emptied: they
  // must compile or read the disk, the calls after them neither.
  bool prepare = false;

  int64_t seq_q() const { return seq_q_len ? seq_q_len : q_offset + Lq; }
  int64_t seq_kv() const { return seq_kv_len ? seq_kv_len : kv_offset + Lkv; }
  std::string describe() const {
    return fmt::format("{} B {} Hq {} Hkv {} Q_LEN {} KV_LEN {} D {}{}{}{} kernel {} positions q {} "
                       "kv {} of {} x {}",
                       dtype_name(dtype), B, Hq, Hkv, Lq, Lkv, D, block_mask ? "" : " dense",
                       broadcast ? " broadcast" : "", deterministic ? " deterministic" : " atomic dq",
                       to_string(kernel), q_offset, kv_offset, seq_q(), seq_kv());
  }
};

// Forward then backward on the GPU into poisoned dq / dk / dv (capture gradients start at 0),
// checked against the reference given the forward's out and lse. Deterministic runs go twice
// and must agree bitwise.
BackwardAccuracy run_backward_case(const Variant& variant, const BwdCase& c) {
  const std::vector<int64_t> qs{c.B, c.Hq, c.Lq, c.D}, ks{c.B, c.Hkv, c.Lkv, c.D};
  const std::vector<float> q = normal(c.B * c.Hq * c.Lq * c.D, c.dtype),
                           k = normal(c.B * c.Hkv * c.Lkv * c.D, c.dtype),
                           v = normal(k.size(), c.dtype), dout = normal(q.size(), c.dtype);
  // Captures drawn before the accumulate starts: the same inputs with and without them.
  std::vector<npy::Array> caps;
  for (const CaptureSpec& cs : variant.captures())
    caps.push_back(random_capture(cs, c.B, c.Hq, c.seq_q(), c.seq_kv()));
  // The gradients' buffers start poisoned, or (accumulate) at values the kernel adds to.
  const std::vector<float> start_q = c.accumulate ? normal(q.size(), DType::F32)
                                                : std::vector<float>(q.size(), std::nanf(""));
  const std::vector<float> start_kv = c.accumulate ? normal(k.size(), DType::F32)
                                                   : std::vector<float>(k.size(), std::nanf(""));
  const std::vector<float> out_poison(q.size(), std::numeric_limits<float>::quiet_NaN());
  // A gradient buffer starting at `poison` (16-bit, or float32 with c.grads_f32), and its values
  // (less the start with c.accumulate).
  const auto grad_buffer = [&](const std::vector<float>& poison, const std::vector<int64_t>& shape,
                               TensorView& view) {
    if (!c.grads_f32) return upload16(c.dtype, poison, shape, view);
    flexc::DeviceBuffer buf(std::max<size_t>(poison.size(), 4) * 4);
    buf.upload(poison.data(), poison.size() * 4);
    view = TensorView{buf.get(), DType::F32, shape, {}};
    return buf;
  };
  const auto grad_values = [&](const flexc::DeviceBuffer& buf, const std::vector<float>& start) {
    const size_t n = start.size();
    std::vector<float> g = c.grads_f32 ? buf.to_vector<float>(n) : download16(c.dtype, buf, n);
    if (c.accumulate)
      for (size_t i = 0; i < n; ++i) g[i] -= start[i];
    return g;
  };
  TensorView tq, tk, tv, tout, tdout, tdq, tdk, tdv;
  const auto bq = upload16(c.dtype, q, qs, tq), bk = upload16(c.dtype, k, ks, tk),
             bv = upload16(c.dtype, v, ks, tv), bout = upload16(c.dtype, out_poison, qs, tout),
             bdout = upload16(c.dtype, dout, qs, tdout), bdq = grad_buffer(start_q, qs, tdq),
             bdk = grad_buffer(start_kv, ks, tdk), bdv = grad_buffer(start_kv, ks, tdv);
  flexc::DeviceBuffer blse(std::max<int64_t>(c.B * c.Hq * c.Lq, 4) * 4);
  const TensorView tlse{blse.get(), DType::F32, {c.B, c.Hq, c.Lq}, {}};

  ReferenceBackwardProblem rp;
  ReferenceProblem& fp = rp.forward;
  fp.q = q, fp.k = k, fp.v = v;
  fp.batch = c.B, fp.q_heads = c.Hq, fp.kv_heads = c.Hkv, fp.q_len = c.Lq, fp.kv_len = c.Lkv;
  fp.head_dim = c.D, fp.dtype = c.dtype;
  AttentionOptions fo;
  BlockMaskOptions bmo;
  fp.q_offset = fo.q_offset = bmo.q_offset = c.q_offset;
  fp.kv_offset = fo.kv_offset = bmo.kv_offset = c.kv_offset;
  fp.seq_q_len = fo.seq_q_len = bmo.seq_q_len = c.seq_q_len;
  fp.seq_kv_len = fo.seq_kv_len = bmo.seq_kv_len = c.seq_kv_len;
  AttentionGrads grads{tdq, tdk, tdv, {}};
  std::vector<flexc::DeviceBuffer> dcaps, dgrads;
  dcaps.reserve(caps.size());
  for (size_t ci = 0; ci < caps.size(); ++ci) {
    const CaptureSpec& cs = variant.captures()[ci];
    const npy::Array& a = caps[ci];
    dcaps.emplace_back(std::max<size_t>(a.bytes.size(), 16));
    dcaps.back().upload(a.bytes.data(), a.bytes.size());
    fo.captures[cs.name] = TensorView{dcaps.back().get(), a.dtype, a.shape, {}};
    fp.captures[cs.name] = a.view();
    bmo.captures[cs.name] = CaptureData{a.bytes.data(), dcaps.back().get(), a.shape, {}};
    if (a.dtype == DType::F32) {
      dgrads.emplace_back(std::max<size_t>(a.bytes.size(), 16));
      dgrads.back().fill(0);
      grads.captures[cs.name] = TensorView{dgrads.back().get(), DType::F32, a.shape, {}};
    }
  }
  std::optional<BlockMask> bm;
  if (c.block_mask && !variant.mask_always_true()) {
    const ModDeps deps = variant.mask_deps();
    const bool bb = c.broadcast && !deps.b, bh = c.broadcast && !deps.h;
    bm = create_block_mask(variant, bb ? 1 : c.B, bh ? 1 : c.Hq, c.Lq, c.Lkv, bmo);
  }
  fo.block_mask = bm ? &*bm : nullptr;
  fo.lse = tlse;
  BackwardOptions bo;
  bo.block_mask = fo.block_mask;
  bo.captures = fo.captures;
  bo.deterministic = c.deterministic;
  bo.kernel = c.kernel;
  bo.q_offset = c.q_offset, bo.kv_offset = c.kv_offset;
  bo.seq_q_len = c.seq_q_len, bo.seq_kv_len = c.seq_kv_len;
  bo.accumulate = c.accumulate;
  jit::CacheCounters prepared{};
  if (c.prepare) {
    jit::reset_cache();
    const jit::CacheCounters before = jit::cache_counters();
    prepare_attention(tq, tk, tv, tout, variant, fo);
    const jit::CacheCounters fwd = jit::cache_counters();
    CHECK(fwd.compiles + fwd.disk_hits > before.compiles + before.disk_hits);
    prepare_attention_backward(tq, tk, tv, tout, tlse, tdout, grads, variant, bo);
    prepared = jit::cache_counters();
    CHECK(prepared.compiles + prepared.disk_hits > fwd.compiles + fwd.disk_hits);
  }
  attention(tq, tk, tv, tout, variant, fo);
  attention_backward(tq, tk, tv, tout, tlse, tdout, grads, variant, bo);
  if (c.deterministic) {
    TensorView tdq2, tdk2, tdv2;
    const auto bdq2 = grad_buffer(start_q, qs, tdq2), bdk2 = grad_buffer(start_kv, ks, tdk2),
               bdv2 = grad_buffer(start_kv, ks, tdv2);
    AttentionGrads again{tdq2, tdk2, tdv2, {}};
    attention_backward(tq, tk, tv, tout, tlse, tdout, again, variant, bo);
    flexc::synchronize_device();
    // Bitwise: the same bytes.
    CHECK(bdq.to_vector<uint8_t>(bdq.size()) == bdq2.to_vector<uint8_t>(bdq2.size()));
    CHECK(bdk.to_vector<uint8_t>(bdk.size()) == bdk2.to_vector<uint8_t>(bdk2.size()));
    CHECK(bdv.to_vector<uint8_t>(bdv.size()) == bdv2.to_vector<uint8_t>(bdv2.size()));
  }
  flexc::synchronize_device();
  if (c.prepare) {
    CHECK(jit::cache_counters().compiles == prepared.compiles);
    CHECK(jit::cache_counters().disk_hits == prepared.disk_hits);
  }

  const std::vector<float> out = download16(c.dtype, bout, q.size());
  const std::vector<float> lse = blse.to_vector<float>(c.B * c.Hq * c.Lq);
  rp.dout = dout, rp.out = out, rp.lse = lse;
  const ReferenceBackward r = reference_attention_backward(variant, rp);
  std::map<std::string, std::vector<float>, std::less<>> cap_grads;
  std::map<std::string, std::span<const float>, std::less<>> checked;
  size_t gi = 0;
  for (const npy::Array& a : caps) {
    if (a.dtype != DType::F32) continue;
    const std::string& name = variant.captures()[&a - caps.data()].name;
    cap_grads[name] = dgrads[gi++].to_vector<float>(a.numel());
    if (r.captures.contains(name))
      checked[name] = cap_grads[name];
    else  // read only where it has no derivative: nothing added
      CHECK(std::all_of(cap_grads[name].begin(), cap_grads[name].end(), [](float x) { return x == 0; }));
  }
  return check_gradients(r, grad_values(bdq, start_q), grad_values(bdk, start_kv),
                         grad_values(bdv, start_kv), checked);
}

Mod plain() {
  return {[](double x, auto...) { return x; }, [](double, auto...) { return 1.0; }};
}

}  // namespace

TEST_CASE("attention_backward names the bad argument", "[attention]") {
  const bool prepare = GENERATE(false, true);  // prepare_attention_backward checks the same
  INFO((prepare ? "prepare_attention_backward" : "attention_backward"));
  const Variant v = Variant::from_catalogue("noop");
  // Separate host buffers (validation never touches the data): no two views overlap.
  std::vector<std::vector<uint16_t>> mem(7, std::vector<uint16_t>(4096));
  const TensorView q{mem[0].data(), DType::BF16, {1, 2, 16, 64}, {}};
  const TensorView k{mem[1].data(), DType::BF16, {1, 1, 16, 64}, {}};
  const TensorView lse{mem[2].data(), DType::F32, {1, 2, 16}, {}};
  const TensorView dq{mem[3].data(), DType::BF16, {1, 2, 16, 64}, {}};
  const TensorView dk{mem[4].data(), DType::BF16, {1, 1, 16, 64}, {}};
  const TensorView dv{mem[5].data(), DType::BF16, {1, 1, 16, 64}, {}};
  const TensorView out{mem[6].data(), DType::BF16, {1, 2, 16, 64}, {}};
  const auto error = [&](const TensorView& l, const AttentionGrads& g) {
    try {
      if (prepare)
        prepare_attention_backward(q, k, k, out, l, out, g, v);
      else
        attention_backward(q, k, k, out, l, out, g, v);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  CHECK(error(lse, {dq, dq, dv, {}}) ==
        "flexc::attention_backward: grads.dk must have k's shape; k bf16 [1, 1, 16, 64] strides "
        "[1024, 1024, 64, 1], grads.dk bf16 [1, 2, 16, 64] strides [2048, 1024, 64, 1]");
  CHECK(error(TensorView{mem[2].data(), DType::F32, {1, 2, 15}, {}}, {dq, dk, dv, {}}) ==
        "flexc::attention_backward: lse must be contiguous float32 [B, Hq, Q_LEN] = [1, 2, 16]; "
        "got float32 [1, 2, 15] strides [30, 15, 1]");
  CHECK(error(lse, {dq, dk, dv, {{"slope", lse}}}) ==
        "flexc::attention_backward for 'noop': 'noop' declares no capture 'slope'");
  CHECK(error(lse, {dq, TensorView{mem[1].data(), DType::BF16, {1, 1, 16, 64}, {}}, dv, {}}) ==
        "flexc::attention_backward: grads.dk overlaps k");
  // The gradients: q's dtype, or float32 all three.
  CHECK(error(lse, {dq, TensorView{dk.data, DType::F32, dk.shape, {}}, dv, {}}) ==
        "flexc::attention_backward: grads.dk is float32 but grads.dq is bf16: the three gradients "
        "are q's dtype or all float32");
  CHECK(error(lse, {dq, dk, TensorView{dv.data, DType::F16, dv.shape, {}}, {}}) ==
        "flexc::attention_backward: grads.dv is fp16 but q is bf16; q's dtype or float32 "
        "expected");
  try {
    BackwardOptions add;
    add.accumulate = true;
    attention_backward(q, k, k, out, lse, out, {dq, dk, dv, {}}, v, add);
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(std::string(e.what()) ==
          "flexc::attention_backward: accumulate adds into float32 gradients; grads.dq, dk, dv "
          "are bf16");
  }
  CHECK(detail::bwd_config(128).smem_bytes <= 227 * 1024);
  CHECK_THROWS_WITH(detail::bwd_config(256),
                    "the backward kernel has no head dim 256 (32, 64, 96 or 128)");
  CHECK(detail::bwd_config_sm90(128).smem_bytes <= 227 * 1024);
  CHECK_THROWS_WITH(detail::bwd_config_sm90(96),
                    "the Hopper backward kernel has no head dim 96 (64 or 128)");
  // Forcing the Hopper kernel where it cannot take the call says why, before any GPU work.
  BackwardOptions hopper;
  hopper.kernel = FwdKernel::Hopper;
  const TensorView k0{mem[1].data(), DType::BF16, {1, 1, 16, 64}, {0, 0, 0, 1}};
  try {
    attention_backward(q, k0, k, out, lse, out, {dq, dk, dv, {}}, v, hopper);
    FAIL("no error");
  } catch (const Error& e) {
    CHECK_THAT(e.what(), Catch::Contains("the Hopper kernel needs a nonzero stride on every dim of k"));
  }
  const std::vector<int64_t> s96{1, 2, 16, 96}, k96{1, 1, 16, 96};
  const TensorView q96{mem[0].data(), DType::BF16, s96, {}}, kk96{mem[1].data(), DType::BF16, k96, {}};
  const TensorView o96{mem[6].data(), DType::BF16, s96, {}}, dq96{mem[3].data(), DType::BF16, s96, {}};
  const TensorView dk96{mem[4].data(), DType::BF16, k96, {}}, dv96{mem[5].data(), DType::BF16, k96, {}};
  try {
    attention_backward(q96, kk96, kk96, o96, lse, o96, {dq96, dk96, dv96, {}}, v, hopper);
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(std::string(e.what()) ==
          "flexc::attention_backward: the Hopper backward kernel has no head dim 96 (64 or 128)");
  }
  // The forward takes v's head dim apart from q's (FlexAttention's Ev != E); the backward not yet.
  const TensorView v32{mem[1].data(), DType::BF16, {1, 1, 16, 32}, {}};
  try {
    attention_backward(q, k, v32, out, lse, out, {dq, dk, dv, {}}, v);
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(std::string(e.what()) ==
          "flexc::attention_backward: v's head dim 32 differs from q's and k's 64: the backward "
          "kernels need them equal (the forward takes any pair)");
  }
  CHECK_THROWS_WITH(jit::attention_bwd_sm90_spec({"sm_90", "bf16", 128, 64}),
                    "attention_bwd_sm90: v head dim 64 differs from the head dim 128 (the backward "
                    "kernels need them equal)");
}

TEST_CASE("backward gradients match float64: lengths, GQA, masks, score_mods", "[gpu]") {
  SKIP_WITHOUT_GPU();
  const Mod causal{[](double x, int64_t, int64_t, int64_t i, int64_t j) { return j <= i ? x : -kInf; },
                   [](double, auto...) { return 1.0; }};
  const Mod softcap{[](double x, auto...) { return 30 * std::tanh(x / 30); },
                    [](double x, auto...) {
                      const double t = std::tanh(x / 30);
                      return 1 - t * t;
                    }};
  const Variant noop = Variant::from_catalogue("noop");
  const Variant causal_v = Variant::from_catalogue("causal");
  const Variant softcap_v = Variant::from_catalogue("softcap");
  const Shape shapes[] = {{1, 2, 2, 1, 1, 64},      {2, 4, 2, 17, 129, 64},  {1, 2, 1, 128, 128, 128},
                          {1, 8, 2, 200, 77, 128}, {2, 2, 2, 1000, 1000, 64}, {1, 4, 4, 333, 1024, 128}};
  const Variant alibi_v = Variant::from_catalogue("alibi");
  for (const Shape& s : shapes)
    for (DType dt : {DType::BF16, DType::F16}) {
      check_case(noop, plain(), s, dt, false);
      check_case(causal_v, causal, s, dt, true);
      check_case(causal_v, causal, s, dt, false);
      check_case(softcap_v, softcap, s, dt, true);
      check_case(softcap_v.with_precision(Precision::Exact), softcap, s, dt, true);
      check_case(softcap_v.with_precision(Precision::Approx), softcap, s, dt, true);
      // alibi with a learnable slope per head: its gradient is sum dscore * (kv - q).
      std::vector<float> slope;
      for (int64_t h = 0; h < s.Hq; ++h) slope.push_back(std::exp2(-8.0f * float(h + 1) / float(s.Hq)));
      const Mod alibi{[&slope](double x, int64_t, int64_t h, int64_t i, int64_t j) {
                        return x + slope[h] * double(j - i);
                      },
                      [](double, auto...) { return 1.0; },
                      [](int64_t i, int64_t j) { return double(j - i); }};
      check_case(alibi_v, alibi, s, dt, true, &slope);
      check_case(causal_v, causal, s, dt, true, nullptr, true);
      check_case(softcap_v, softcap, s, dt, false, nullptr, true);
      check_case(alibi_v, alibi, s, dt, true, &slope, true);
    }
}

TEST_CASE("backward: fully masked rows and -inf from score_mod give 0, never NaN", "[gpu]") {
  SKIP_WITHOUT_GPU();
  const Variant late = Variant::from_strings("score", "q_idx >= 5 && q_idx >= kv_idx", {}, {}, "late");
  const Mod late_mod{[](double x, int64_t, int64_t, int64_t i, int64_t j) {
                       return i >= 5 && j <= i ? x : -kInf;
                     },
                     [](double, auto...) { return 1.0; }};
  const Variant holes =
      Variant::from_strings("kv_idx % 3 == 0 ? -inf : score * score / 8.0", "true", {}, {}, "holes");
  const Mod holes_mod{[](double x, int64_t, int64_t, int64_t, int64_t j) {
                        return j % 3 == 0 ? -kInf : x * x / 8;
                      },
                      [](double x, int64_t, int64_t, int64_t, int64_t j) {
                        return j % 3 == 0 ? 0.0 : x / 4;
                      }};
  for (const Shape& s : {Shape{1, 2, 1, 70, 70, 64}, Shape{2, 4, 2, 129, 300, 128}})
    for (DType dt : {DType::BF16, DType::F16}) {
      check_case(late, late_mod, s, dt, true);
      check_case(late, late_mod, s, dt, false, nullptr, true);
      check_case(holes, holes_mod, s, dt, false);
      check_case(holes, holes_mod, s, dt, true, nullptr, true);
    }
}

TEST_CASE("backward: every catalogue variant against the reference, lengths, GQA, broadcasts",
          "[gpu]") {
  SKIP_WITHOUT_GPU();
  const int64_t lens[] = {1, 17, 127, 128, 129, 1000};
  const std::vector<std::string> names = Variant::catalogue_names();
  REQUIRE(names.size() >= 10);
  for (size_t vi = 0; vi < names.size(); ++vi) {
    const Variant v = Variant::from_catalogue(names[vi]);
    for (size_t i = 0; i < 6; ++i) {
      BwdCase c;
      const SweepShape s = sweep_shape(vi, i, lens);
      c.dtype = s.dtype, c.B = s.B, c.Hq = s.Hq, c.Hkv = s.Hkv, c.Lq = s.Lq, c.Lkv = s.Lkv, c.D = s.D;
      c.block_mask = i % 4 != 1;
      c.broadcast = i % 2 == 0;
      c.deterministic = i % 3 != 2;
      // Auto is the Hopper kernel on an H100 / H200 for D 64 and 128; the portable one also runs.
      c.kernel = i % 2 == 1 ? FwdKernel::Portable : FwdKernel::Auto;
      INFO(names[vi] << ": " << c.describe());
      const BackwardAccuracy a = run_backward_case(v, c);
      INFO(a.summary());
      CHECK(a.pass);
    }
  }
}

TEST_CASE("backward: derivatives other than 1 and learnable biases against the reference", "[gpu]") {
  SKIP_WITHOUT_GPU();
  const std::vector<CaptureSpec> table{{"bias", "float32", {"H", "64"}}};
  const std::vector<CaptureSpec> full{{"bias", "float32", {"B", "H", "Q_LEN", "KV_LEN"}}};
  const std::vector<CaptureSpec> gain_bias{{"gain", "float32", {"H"}}, {"bias", "float32", {"H", "3"}}};
  const Variant variants[] = {
      Variant::from_strings("score * score / 8.0", "kv_idx <= q_idx", {}, {}, "square"),
      // The kink sits at 3, not 0: where the kernel's fp32 score and the reference's float64 one
      // fall on either side of it, dS differs by half that element's P (dP - delta); at 0, where
      // scores are densest, that happened in about 1 run in 50 (seed 234101338: dq / dk 2.5x
      // ref from one element). Scores above 3 still take the other branch in every shape.
      Variant::from_strings("score > 3 ? score : score * 0.5", "true", {}, {}, "leaky"),
      Variant::from_strings("score + bias[h, clamp(kv_idx - q_idx, -32, 31) + 32]", "true", table,
                            {}, "relative_table"),
      Variant::from_strings("score + bias[b, h, q_idx, kv_idx]", "true", full, {}, "full_bias"),
      Variant::from_strings("score * gain[h] + bias[h, kv_idx % 3] * bias[h, q_idx % 3]",
                            "kv_idx <= q_idx + 50", gain_bias, {}, "two_loads"),
  };
  const BwdCase shapes[] = {
      {DType::BF16, 2, 4, 2, 17, 129, 64, true, false, true},
      {DType::F16, 1, 8, 2, 200, 77, 128, true, true, false},
      {DType::BF16, 1, 2, 1, 1000, 1000, 128, false, false, true},
      {DType::F16, 2, 2, 2, 129, 300, 64, true, false, true},
  };
  for (const Variant& v : variants)
    for (const BwdCase& c : shapes) {
      INFO(v.name() << ": " << c.describe());
      const BackwardAccuracy a = run_backward_case(v, c);
      INFO(a.summary());
      CHECK(a.pass);
    }
}

TEST_CASE("backward: row terms taken off the LSE against the reference", "[gpu]") {
  SKIP_WITHOUT_GPU();
  // Fast precision's row terms (added to the forward's LSE, taken off it by the backward, whose
  // scores leave them out too): a learnable per-query bias (its gradient is the LSE's), one beside
  // a per-key term with rows of -inf (no key) and rows shifted by thousands, rows only. At
  // positions too.
  const std::vector<CaptureSpec> caps{{"qb", "float32", {"H", "Q_LEN"}},
                                      {"kvb", "float32", {"KV_LEN"}}};
  const Variant variants[] = {
      Variant::from_strings("score + qb[h, q_idx]", "true", caps, {}, "q_bias"),
      Variant::from_strings("score * 0.5 - qb[h, q_idx] * 2.0 + kvb[kv_idx] + "
                            "where(q_idx % 29 == 3, log(0.0), float(q_idx % 7) * 1000.0)",
                            "kv_idx <= q_idx + 40", caps, {}, "mixed"),
      Variant::from_strings("qb[h, q_idx] * 3.0", "kv_idx <= q_idx", caps, {}, "rows_only"),
      // Units in the exponent; over the identity, whose derivative is then not 1.
      Variant::from_strings("30.0 * tanh(score / 30.0) + qb[h, q_idx]", "kv_idx <= q_idx + 40",
                            caps, {}, "capped"),
      Variant::from_strings("score * 0.5", "true", {}, {}, "temperature"),
  };
  BwdCase at_positions{DType::BF16, 1, 4, 2, 150, 203, 128, true, false, true};
  at_positions.q_offset = 200, at_positions.kv_offset = 301;
  at_positions.seq_q_len = 600, at_positions.seq_kv_len = 700;
  const BwdCase shapes[] = {
      {DType::BF16, 2, 4, 2, 17, 129, 64, true, false, true},
      {DType::F16, 1, 8, 2, 200, 77, 128, true, true, false},
      {DType::BF16, 2, 2, 2, 129, 300, 64, true, false, true},
      at_positions,
  };
  for (const Variant& v : variants)
    for (const BwdCase& c : shapes) {
      REQUIRE(v.precision() == Precision::Fast);
      INFO(v.name() << ": " << c.describe());
      const BackwardAccuracy a = run_backward_case(v, c);
      INFO(a.summary());
      CHECK(a.pass);
    }
}

TEST_CASE("backward: float32 gradients are the gradients unrounded, or added into", "[gpu]") {
  SKIP_WITHOUT_GPU();
  // Ring attention sums its blocks' dq, dk, dv in float32 and rounds once. The same inputs into
  // 16-bit gradients and float32 ones: the float32 ones must be nearer float64 (their error lacks
  // the final rounding), both passing the rule; dq by atomics and deterministic, both kernels.
  // Added into float32 buffers holding random values (accumulate): those values plus the same
  // gradients.
  const Variant v = Variant::from_catalogue("alibi");
  int i = 0;
  for (FwdKernel kernel : {FwdKernel::Auto, FwdKernel::Portable})
    for (bool deterministic : {false, true}) {
      BwdCase c{i % 2 ? DType::F16 : DType::BF16, 2, 4, 2, 301, 419, i % 3 ? 128 : 64};
      c.kernel = kernel, c.deterministic = deterministic;
      ++i;
      const std::mt19937_64 inputs = rng();
      const BackwardAccuracy a16 = run_backward_case(v, c);
      rng() = inputs;
      c.grads_f32 = true;
      const BackwardAccuracy a32 = run_backward_case(v, c);
      rng() = inputs;
      c.accumulate = true;
      const BackwardAccuracy add = run_backward_case(v, c);
      INFO(c.describe() << "\n  16-bit  " << a16.summary() << "\n  float32 " << a32.summary()
                        << "\n  added   " << add.summary());
      CHECK(a16.pass);
      CHECK(a32.pass);
      CHECK(add.pass);
      for (size_t g = 0; g < 3; ++g) {
        CHECK(a32.grads[g].rmse < a16.grads[g].rmse);
        // (base + g) - base rounds at base's scale (about 1e-7), far below the gradients' error.
        CHECK(add.grads[g].rmse <= 1.05 * a32.grads[g].rmse + 1e-6);
      }
    }
}

TEST_CASE("backward: a block of a longer sequence at its positions against the reference",
          "[gpu]") {
  SKIP_WITHOUT_GPU();
  // Ring attention's backward steps: queries [q_offset, + Q_LEN) and keys [kv_offset, + KV_LEN)
  // of a sequence whose (unequal) lengths the mods see. Captures indexed by position (document,
  // a full [B, H, Q_LEN, KV_LEN] bias, learnable ones included), relative biases; blocks below
  // and across the diagonal, and at offsets 0 with the sequence's lengths alone.
  const std::vector<CaptureSpec> full{{"bias", "float32", {"B", "H", "Q_LEN", "KV_LEN"}}};
  const Variant variants[] = {
      Variant::from_catalogue("causal"), Variant::from_catalogue("alibi"),
      Variant::from_catalogue("document"), Variant::from_catalogue("causal_bottom_right"),
      Variant::from_strings("score + bias[b, h, q_idx, kv_idx]", "kv_idx <= q_idx", full, {},
                            "full_bias"),
  };
  const int64_t at[][2] = {{512, 128}, {300, 250}, {0, 0}};
  int i = 0;
  for (const Variant& v : variants)
    for (const auto& [q_offset, kv_offset] : at) {
      BwdCase c{i % 2 ? DType::F16 : DType::BF16, 1, 4, 2, 257, 200, i % 3 ? 128 : 64};
      c.q_offset = q_offset, c.kv_offset = kv_offset;
      c.seq_q_len = 900, c.seq_kv_len = 1000;
      c.deterministic = i % 2 == 0;
      c.kernel = i % 4 < 2 ? FwdKernel::Auto : FwdKernel::Portable;
      ++i;
      INFO(v.name() << ": " << c.describe());
      const BackwardAccuracy a = run_backward_case(v, c);
      INFO(a.summary());
      CHECK(a.pass);
    }
}

TEST_CASE("prepare_attention_backward loads what the call runs: the call then compiles nothing",
          "[gpu]") {
  SKIP_WITHOUT_GPU();
  // The main kernel's choice (Hopper or portable), dq's mode (atomic or deterministic), float32
  // gradients added into, and a learnable capture: each after the JIT's memory is emptied.
  BwdCase hopper{DType::BF16, 1, 4, 2, 300, 500, 128};
  hopper.deterministic = false;
  BwdCase rows{DType::F16, 2, 2, 1, 200, 129, 64};
  BwdCase portable{DType::BF16, 1, 2, 2, 100, 333, 96};
  portable.kernel = FwdKernel::Portable;
  BwdCase added = hopper;
  added.grads_f32 = added.accumulate = true;
  const std::pair<Variant, BwdCase> picks[] = {{Variant::from_catalogue("causal"), hopper},
                                               {Variant::from_catalogue("softcap"), rows},
                                               {Variant::from_catalogue("alibi"), portable},
                                               {Variant::from_catalogue("document"), added}};
  for (auto [v, c] : picks) {
    c.prepare = true;
    INFO(v.name() << ": " << c.describe());
    const BackwardAccuracy a = run_backward_case(v, c);
    INFO(a.summary());
    CHECK(a.pass);
  }
}
