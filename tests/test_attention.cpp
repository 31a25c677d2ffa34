// Forward attention: the CPU reference and tolerance rule, .npy files, argument validation and the
// kernel's configurations (CI), and the kernel against the reference on the GPU ([gpu]).
#include <fmt/format.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <random>
#include <ranges>

#include "attention/attention_kernel.h"
#include "dsl/emit_cuda.h"
#include "flexc/attention.h"
#include "flexc/blockmask.h"
#include "flexc/device.h"
#include "flexc/error.h"
#include "flexc/jit.h"
#include "flexc/npy.h"
#include "flexc/reference.h"
#include "flexc/variant.h"
#include "jit/compiler.h"
#include "jit/jit.h"
#include "test_graph.h"
#include "test_random.h"
#include "test_tensors.h"
#include "variant_impl.h"

using namespace flexc;
using Catch::Matchers::Contains;
namespace fs = std::filesystem;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

using flexc::testing::rng;

using flexc::testing::normal;
using flexc::testing::random_capture;
using flexc::testing::SweepShape;
using flexc::testing::sweep_shape;
using flexc::testing::round16;
using flexc::testing::rows_of;

// A problem on the host: q [B, Hq, Lq, D], k / v [B, Hkv, Lkv, D] with values exact in `dtype`.
struct Problem {
  int64_t B = 1, Hq = 1, Hkv = 1, Lq = 1, Lkv = 1, D = 64, Dv = 64;
  DType dtype = DType::BF16;
  std::vector<float> q, k, v;

  // dv: v's head dim; 0 for d.
  Problem(int64_t b, int64_t hq, int64_t hkv, int64_t lq, int64_t lkv, int64_t d, DType t,
          int64_t dv = 0)
      : B(b), Hq(hq), Hkv(hkv), Lq(lq), Lkv(lkv), D(d), Dv(dv ? dv : d), dtype(t) {
    q = normal(B * Hq * Lq * D, t);
    k = normal(B * Hkv * Lkv * D, t);
    v = normal(B * Hkv * Lkv * Dv, t);
  }
  ReferenceProblem reference() const {
    ReferenceProblem p;
    p.q = q, p.k = k, p.v = v;
    p.batch = B, p.q_heads = Hq, p.kv_heads = Hkv, p.q_len = Lq, p.kv_len = Lkv, p.head_dim = D;
    p.v_head_dim = Dv;
    p.dtype = dtype;
    return p;
  }
};

// Attention written out directly in float64, independent of the DSL: `score_fn(score, b, h, q,
// kv)` returns the modded score or -inf where masked.
template <class ScoreFn>
void direct_attention(const Problem& p, double scale, ScoreFn score_fn, std::vector<double>& out,
                      std::vector<double>& lse) {
  out.assign(p.B * p.Hq * p.Lq * p.Dv, 0);
  lse.assign(p.B * p.Hq * p.Lq, -kInf);
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t h = 0; h < p.Hq; ++h)
      for (int64_t i = 0; i < p.Lq; ++i) {
        const int64_t row = (b * p.Hq + h) * p.Lq + i, hk = h / (p.Hq / p.Hkv);
        std::vector<double> s(p.Lkv);
        double mx = -kInf;
        for (int64_t j = 0; j < p.Lkv; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < p.D; ++d)
            dot += double(p.q[row * p.D + d]) * p.k[((b * p.Hkv + hk) * p.Lkv + j) * p.D + d];
          s[j] = score_fn(dot * scale, b, h, i, j);
          mx = std::max(mx, s[j]);
        }
        if (mx == -kInf) continue;
        double l = 0;
        for (int64_t j = 0; j < p.Lkv; ++j) {
          const double e = std::exp(s[j] - mx);
          l += e;
          for (int64_t d = 0; d < p.Dv; ++d)
            out[row * p.Dv + d] += e * p.v[((b * p.Hkv + hk) * p.Lkv + j) * p.Dv + d];
        }
        for (int64_t d = 0; d < p.Dv; ++d) out[row * p.Dv + d] /= l;
        lse[row] = mx + std::log(l);
      }
}

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] == b[i]) continue;  // equal infinities too
    m = std::max(m, std::abs(a[i] - b[i]));
  }
  return m;
}

std::vector<float> as_float(const std::vector<double>& v) { return {v.begin(), v.end()}; }

}  // namespace

// ---- the reference (CI)

TEST_CASE("the reference is float64 attention: GQA, scale, alibi capture, runtime param",
          "[reference]") {
  const Problem p(2, 4, 2, 37, 53, 32, DType::BF16);
  std::vector<float> slope{0.5f, 0.25f, 0.125f, 0.0625f};
  const Variant alibi = Variant::from_catalogue("alibi");
  ReferenceProblem rp = p.reference();
  rp.scale = 0.3;
  rp.captures["slope"] = TensorView::contiguous(slope.data(), DType::F32, {4});
  const ReferenceResult r = reference_attention(alibi, rp);
  std::vector<double> out, lse;
  direct_attention(p, 0.3, [&](double s, int64_t, int64_t h, int64_t i, int64_t j) {
    return s + slope[h] * double(j - i);
  }, out, lse);
  CHECK(max_abs_diff(r.gold_out, out) < 1e-12);
  CHECK(max_abs_diff(r.gold_lse, lse) < 1e-12);

  const Variant window = Variant::from_catalogue("sliding_window");
  ReferenceProblem wp = p.reference();
  wp.params["window"] = 7;
  const ReferenceResult w = reference_attention(window, wp);
  direct_attention(p, 1 / std::sqrt(32.0), [](double s, int64_t, int64_t, int64_t i, int64_t j) {
    return i >= j && i - j < 7 ? s : -kInf;
  }, out, lse);
  CHECK(max_abs_diff(w.gold_out, out) < 1e-12);
  CHECK(max_abs_diff(w.gold_lse, lse) < 1e-12);

  // v's head dim differs from q's and k's (FlexAttention's Ev != E): rows of Dv values.
  const Problem mla(1, 4, 2, 19, 41, 96, DType::F16, 32);
  const ReferenceResult m = reference_attention(Variant::from_catalogue("causal"), mla.reference());
  CHECK(m.gold_out.size() == size_t(4 * 19 * 32));
  direct_attention(mla, 1 / std::sqrt(96.0), [](double s, int64_t, int64_t, int64_t i, int64_t j) {
    return i >= j ? s : -kInf;
  }, out, lse);
  CHECK(max_abs_diff(m.gold_out, out) < 1e-12);
  CHECK(max_abs_diff(m.gold_lse, lse) < 1e-12);
  ReferenceProblem short_v = mla.reference();
  short_v.v_head_dim = 64;  // the values hold 32 per row
  CHECK_THROWS_WITH(reference_attention(Variant::from_catalogue("causal"), short_v),
                    Contains("v has 2624 values; its shape needs 5248"));
}

TEST_CASE("the reference gives rows without an unmasked element output 0 and LSE -inf",
          "[reference]") {
  // Masked by mask_mod (q % 3 == 0) and by a score_mod that yields -inf (q % 5 == 1).
  const Variant v = Variant::from_strings("where(q_idx % 5 == 1, -inf, score)", "q_idx % 3 != 0");
  const Problem p(1, 2, 1, 30, 20, 64, DType::F16);
  const ReferenceResult r = reference_attention(v, p.reference());
  for (size_t i = 0; i < r.rows.size(); ++i) {
    const int64_t q = r.rows[i] % p.Lq;
    const bool masked = q % 3 == 0 || q % 5 == 1;
    INFO("row " << r.rows[i]);
    CHECK((r.gold_lse[i] == -kInf) == masked);
    CHECK((r.ref_lse[i] == -kInf) == masked);
    if (masked)
      for (int64_t d = 0; d < p.D; ++d) CHECK(r.gold_out[i * p.D + d] == 0);
  }
}

// Merges partial attention results over disjoint key sets (ring attention's rule, in float64):
// lse = log sum_i exp(lse_i), out = sum_i exp(lse_i - lse) out_i; parts with no key (-inf) weigh 0.
void merge_parts(const std::vector<const ReferenceResult*>& parts, int64_t dv,
                 std::vector<double>& out, std::vector<double>& lse) {
  const size_t rows = parts[0]->gold_lse.size();
  out.assign(rows * dv, 0), lse.assign(rows, -kInf);
  for (size_t r = 0; r < rows; ++r) {
    double mx = -kInf, sum = 0;
    for (const ReferenceResult* p : parts) mx = std::max(mx, p->gold_lse[r]);
    if (mx == -kInf) continue;
    for (const ReferenceResult* p : parts) sum += std::exp(p->gold_lse[r] - mx);
    lse[r] = mx + std::log(sum);
    for (const ReferenceResult* p : parts) {
      const double w = std::exp(p->gold_lse[r] - lse[r]);
      for (int64_t d = 0; d < dv; ++d) out[r * dv + d] += w * p->gold_out[r * dv + d];
    }
  }
}

TEST_CASE("the reference at positions: a sequence's key blocks merge into its attention",
          "[reference]") {
  // A block of a longer sequence (context parallelism): queries [qa, qa + nq) of the whole
  // against keys [kb, kb + nk), the mods seeing global positions and the whole's lengths, with
  // captures indexed by position, a relative bias and a length term. The blocks' outputs merged
  // by their LSE are the whole sequence's rows (keys blocks 0..2 of the last query fall under
  // causality's empty block too).
  const int64_t L = 150, qa = 40, nq = 70, D = 32;
  const Problem whole(2, 4, 2, L, L, D, DType::BF16);
  std::vector<float> slope{0.5f, 0.25f, 0.125f, 0.0625f};
  std::vector<int32_t> doc(L);
  for (int64_t i = 0; i < L; ++i) doc[i] = int32_t(i / 37);
  const Variant v = Variant::from_strings(
      "score + slope[h] * (kv_idx - q_idx) + 0.001 * (q_len - kv_idx)",
      "doc[q_idx] == doc[kv_idx] && q_idx >= kv_idx",
      {{"slope", "float32", {"H"}}, {"doc", "int32", {"KV_LEN"}}}, {}, "blocks");
  auto with_captures = [&](ReferenceProblem p) {
    p.captures["slope"] = TensorView::contiguous(slope.data(), DType::F32, {4});
    p.captures["doc"] = TensorView::contiguous(doc.data(), DType::I32, {L});
    return p;
  };
  ReferenceProblem wp = with_captures(whole.reference());
  for (int64_t bh = 0; bh < 2 * 4; ++bh)
    for (int64_t i = 0; i < nq; ++i) wp.rows.push_back(bh * L + qa + i);
  const ReferenceResult want = reference_attention(v, wp);

  std::vector<ReferenceResult> parts;
  for (auto [kb, nk] : {std::pair<int64_t, int64_t>{0, 50}, {50, 60}, {110, 40}}) {
    ReferenceProblem bp = with_captures(whole.reference());
    const std::vector<float> q = rows_of(whole.q, 8, L, D, qa, nq);
    const std::vector<float> k = rows_of(whole.k, 4, L, D, kb, nk);
    const std::vector<float> vv = rows_of(whole.v, 4, L, D, kb, nk);
    bp.q = q, bp.k = k, bp.v = vv;
    bp.q_len = nq, bp.kv_len = nk;
    bp.q_offset = qa, bp.kv_offset = kb, bp.seq_q_len = L, bp.seq_kv_len = L;
    parts.push_back(reference_attention(v, bp));
  }
  std::vector<double> out, lse;
  merge_parts({&parts[0], &parts[1], &parts[2]}, D, out, lse);
  CHECK(max_abs_diff(out, want.gold_out) < 1e-12);
  CHECK(max_abs_diff(lse, want.gold_lse) < 1e-12);
  // The last key block is empty for queries below 110: no key, LSE -inf, output 0.
  CHECK(parts[2].gold_lse[0] == -kInf);
  CHECK(parts[2].gold_out[0] == 0.0);

  ReferenceProblem bad = with_captures(whole.reference());
  bad.kv_offset = 10, bad.seq_kv_len = L;
  CHECK_THROWS_WITH(reference_attention(v, bad),
                    Contains("seq_kv_len = 150 must hold kv_offset + KV_LEN = 160"));
}

TEST_CASE("ref rounds where the kernel rounds, and the tolerance rule", "[reference]") {
  const Variant causal = Variant::from_catalogue("causal");
  double err[2];
  for (DType d : {DType::BF16, DType::F16}) {
    const Problem p(1, 2, 2, 64, 96, 64, d);
    ReferenceProblem rp = p.reference();
    rp.rows = {5, 64, 127, 70};
    const ReferenceResult r = reference_attention(causal, rp);
    REQUIRE(r.rows == rp.rows);
    const Accuracy self = check_accuracy(r, as_float(r.ref_out), as_float(r.ref_lse));
    INFO(self.summary());
    CHECK(self.pass);
    CHECK(self.out_ref_rmse > 0);
    err[d == DType::F16] = self.out_ref_rmse;
    // Three times ref's error fails; NaN fails; a wrong masked row fails.
    std::vector<float> worse(r.gold_out.size());
    for (size_t i = 0; i < worse.size(); ++i)
      worse[i] = float(r.gold_out[i] + 3 * (r.ref_out[i] - r.gold_out[i]));
    CHECK_FALSE(check_accuracy(r, worse, {}).pass);
    std::vector<float> nan = as_float(r.ref_out);
    nan[7] = std::numeric_limits<float>::quiet_NaN();
    CHECK(check_accuracy(r, nan, {}).bad == 1);
    CHECK_FALSE(check_accuracy(r, nan, {}).pass);
    std::vector<float> lse = as_float(r.ref_lse);
    lse[2] += 1e-3f;
    CHECK_FALSE(check_accuracy(r, as_float(r.ref_out), lse).pass);
  }
  CHECK(err[1] < err[0]);  // fp16 keeps 3 more mantissa bits than bf16

  const Variant none = Variant::from_strings("score", "q_idx < 0");
  const Problem p(1, 1, 1, 4, 4, 32, DType::BF16);
  const ReferenceResult r = reference_attention(none, p.reference());
  std::vector<float> out(r.gold_out.size(), 0.f), lse(4, -std::numeric_limits<float>::infinity());
  CHECK(check_accuracy(r, out, lse).pass);
  CHECK(check_accuracy(r, out, lse).masked_rows == 4);
  out[3] = 1e-30f;
  CHECK_FALSE(check_accuracy(r, out, lse).pass);
}

TEST_CASE("the reference checks its inputs", "[reference]") {
  const Problem p(1, 2, 2, 8, 8, 32, DType::BF16);
  ReferenceProblem rp = p.reference();
  rp.q = std::span<const float>(p.q).first(10);
  CHECK_THROWS_WITH(reference_attention(Variant::from_catalogue("noop"), rp), Contains("q has 10"));
  rp = p.reference();
  CHECK_THROWS_WITH(reference_attention(Variant::from_catalogue("alibi"), rp),
                    Contains("reads capture 'slope'"));
  rp.params["windw"] = 3;
  CHECK_THROWS_WITH(reference_attention(Variant::from_catalogue("sliding_window"), rp),
                    Contains("did you mean 'window'"));
  rp = p.reference();
  rp.rows = {16};
  CHECK_THROWS_WITH(reference_attention(Variant::from_catalogue("noop"), rp),
                    Contains("row 16 is out of range"));
}

// ---- .npy files (CI)

TEST_CASE(".npy files round-trip and bad ones are named", "[npy]") {
  const fs::path dir = fs::temp_directory_path() / fmt::format("flexc_npy_{}", rng()());
  fs::create_directories(dir);
  const std::vector<float> f = normal(2 * 3 * 5 * 7, DType::BF16);
  npy::write(dir / "a.npy", npy::from_float({2, 3, 5, 7}, f));
  const npy::Array a = npy::read(dir / "a.npy");
  CHECK(a.dtype == DType::F32);
  CHECK(a.shape == std::vector<int64_t>{2, 3, 5, 7});
  CHECK(a.to_float() == f);
  // 1-d and 0-d shapes, int32, fp16 and bool.
  npy::Array i{DType::I32, {4}, std::vector<std::byte>(16)};
  const int32_t iv[4] = {-7, 0, 1 << 30, 3};
  std::memcpy(i.bytes.data(), iv, 16);
  npy::write(dir / "i.npy", i);
  CHECK(npy::read(dir / "i.npy").bytes == i.bytes);
  CHECK(npy::read(dir / "i.npy").shape == std::vector<int64_t>{4});
  npy::write(dir / "s.npy", npy::from_float({}, std::vector<float>{2.5f}));
  CHECK(npy::read(dir / "s.npy").to_float() == std::vector<float>{2.5f});
  const npy::Array h = a.as(DType::F16, "test");
  npy::write(dir / "h.npy", h);
  CHECK(npy::read(dir / "h.npy").to_float() == h.to_float());
  CHECK(npy::read(dir / "h.npy").dtype == DType::F16);
  CHECK(a.as(DType::BF16, "test").to_float() == f);  // f is exact in bf16
  CHECK_THROWS_WITH(i.as(DType::F32, "--capture x"), Contains("--capture x: expected float32"));
  npy::Array bits{DType::Bool, {3}, {std::byte{1}, std::byte{0}, std::byte{1}}};
  npy::write(dir / "b.npy", bits);
  CHECK(npy::read(dir / "b.npy").bytes == bits.bytes);

  // Files numpy writes that flexc converts: <f8 -> float32, <i8 -> int32 (checked).
  auto raw = [&](const char* name, const std::string& header, const std::string& data) {
    std::string text = header;
    text.append(63 - (10 + text.size()) % 64, ' ');
    text += '\n';
    std::ofstream o(dir / name, std::ios::binary);
    o.write("\x93NUMPY\x01\x00", 8);
    const char len[2] = {char(text.size() & 0xff), char(text.size() >> 8)};
    o.write(len, 2);
    o << text << data;
  };
  double d2[2] = {0.1, -3};
  raw("d.npy", "{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }",
      std::string(reinterpret_cast<char*>(d2), 16));
  CHECK(npy::read(dir / "d.npy").to_float() == std::vector<float>{0.1f, -3.f});
  int64_t l2[2] = {5, int64_t(1) << 40};
  raw("l.npy", "{'descr': '<i8', 'fortran_order': False, 'shape': (2,), }",
      std::string(reinterpret_cast<char*>(l2), 16));
  CHECK_THROWS_WITH(npy::read(dir / "l.npy"), Contains("does not fit int32"));
  raw("fo.npy", "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }", std::string(16, '\0'));
  CHECK_THROWS_WITH(npy::read(dir / "fo.npy"), Contains("Fortran-order"));
  raw("be.npy", "{'descr': '>f4', 'fortran_order': False, 'shape': (2,), }", std::string(8, '\0'));
  CHECK_THROWS_WITH(npy::read(dir / "be.npy"), Contains("dtype '>f4' is not supported"));
  raw("tr.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }", std::string(20, '\0'));
  CHECK_THROWS_WITH(npy::read(dir / "tr.npy"), Contains("truncated"));
  // Corrupt shapes whose element count overflows: (2^62 + 1) * 4 bytes wraps to 4 in size_t,
  // which the data would satisfy; others would overflow int64 or ask for an impossible vector.
  raw("wrap.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (4611686018427387905,), }",
      std::string(4, '\0'));
  CHECK_THROWS_WITH(npy::read(dir / "wrap.npy"), Contains("wrap.npy: truncated"));
  raw("huge.npy",
      "{'descr': '<f8', 'fortran_order': False, 'shape': (4294967296, 4294967296, 3), }",
      std::string(8, '\0'));
  CHECK_THROWS_WITH(npy::read(dir / "huge.npy"), Contains("huge.npy: truncated"));
  raw("big.npy", "{'descr': '|b1', 'fortran_order': False, 'shape': (9223372036854775807,), }",
      std::string(8, '\0'));
  CHECK_THROWS_AS(npy::read(dir / "big.npy"), Error);
  raw("empty.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (9223372036854775807, 0), }",
      "");
  CHECK(npy::read(dir / "empty.npy").numel() == 0);
  std::ofstream(dir / "junk.npy") << "hello";
  CHECK_THROWS_WITH(npy::read(dir / "junk.npy"), Contains("junk.npy: not a .npy file"));
  CHECK_THROWS_WITH(npy::read(dir / "missing.npy"),
                    Contains("cannot read .npy file " + (dir / "missing.npy").string() +
                             ": No such file or directory"));
  CHECK_THROWS_WITH(npy::write(dir / "x.npy", a.as(DType::BF16, "t")), Contains("bf16 cannot"));

  // Versions 2 and 3 (4-byte header length), and headers that lie or lack keys.
  auto versioned = [&](const char* name, char major, const std::string& header, uint32_t len,
                       const std::string& data) {
    std::ofstream o(dir / name, std::ios::binary);
    o.write("\x93NUMPY", 6);
    o.put(major);
    o.put(0);
    for (int b = 0; b < 4; ++b) o.put(char((len >> (8 * b)) & 0xff));
    o << header << data;
  };
  const std::string h2 = "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }\n";
  const float two[2] = {1.5f, -2.f};
  const std::string two_bytes(reinterpret_cast<const char*>(two), 8);
  versioned("v2.npy", 2, h2, uint32_t(h2.size()), two_bytes);
  CHECK(npy::read(dir / "v2.npy").to_float() == std::vector<float>{1.5f, -2.f});
  versioned("v3.npy", 3, h2, uint32_t(h2.size()), two_bytes);
  CHECK(npy::read(dir / "v3.npy").to_float() == std::vector<float>{1.5f, -2.f});
  versioned("v4.npy", 4, h2, uint32_t(h2.size()), two_bytes);
  CHECK_THROWS_WITH(npy::read(dir / "v4.npy"), Contains("unsupported .npy version 4"));
  versioned("long.npy", 2, h2, 1u << 30, two_bytes);
  CHECK_THROWS_WITH(npy::read(dir / "long.npy"),
                    Contains("long.npy: truncated header: it says 1073741824 bytes, the file has"));
  const std::pair<const char*, const char*> bad_headers[] = {
      {"{'fortran_order': False, 'shape': (2,), }", "the header has no 'descr'"},
      {"{'descr': '<f4', 'shape': (2,), }", "the header has no 'fortran_order'"},
      {"{'descr': '<f4', 'fortran_order': False, }", "the header has no 'shape'"},
      {"{'descr': <f4, 'fortran_order': False, 'shape': (2,), }", "dtype <f4 is not supported"},
      {"{'descr': '<f4', 'fortran_order': Maybe, 'shape': (2,), }",
       "fortran_order is Maybe, not True or False"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': [2], }", "bad shape [2]: expected a tuple"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (-2,), }", "bad shape (-2,): negative size -2"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (3abc,), }", "bad shape (3abc,): '3abc' is not a size"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2, , 1), }", "bad shape (2, , 1): an empty size"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (0x2,), }", "'0x2' is not a size"},
  };
  for (const auto& [header, message] : bad_headers) {
    INFO(header);
    raw("bad.npy", header, two_bytes);
    CHECK_THROWS_WITH(npy::read(dir / "bad.npy"), Contains(message));
  }
  // Only regular files are read, and never unboundedly.
  CHECK_THROWS_WITH(npy::read("/dev/zero"), Contains("it is not a regular file"));
  CHECK_THROWS_WITH(npy::read(dir), Contains("it is a directory"));
  fs::remove_all(dir);
}

TEST_CASE("16-bit conversions round to nearest even", "[npy]") {
  CHECK(float_to_bf16(1.0f) == 0x3f80);
  CHECK(float_to_bf16(std::bit_cast<float>(0x3f808000u)) == 0x3f80);  // tie: to even
  CHECK(float_to_bf16(std::bit_cast<float>(0x3f818000u)) == 0x3f82);
  CHECK(std::isnan(bf16_to_float(float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  CHECK(float_to_fp16(1.0f) == 0x3c00);
  CHECK(float_to_fp16(65504.f) == 0x7bff);
  CHECK(float_to_fp16(65520.f) == 0x7c00);             // rounds to inf
  CHECK(float_to_fp16(5.9604644775390625e-8f) == 1);  // smallest subnormal
  CHECK(float_to_fp16(2.98e-8f) == 0);
  int wrong = 0;  // every finite half round-trips, both signs
  for (uint32_t h = 0; h < 0x7c00; ++h)
    wrong += float_to_fp16(fp16_to_float(uint16_t(h))) != h ||
             float_to_fp16(-fp16_to_float(uint16_t(h))) != (h | 0x8000);
  CHECK(wrong == 0);
}

TEST_CASE("TensorView::numel refuses counts past int64", "[tensor]") {
  constexpr int64_t kBig = int64_t(1) << 32;
  CHECK(TensorView::contiguous(nullptr, DType::F32, {2, 3, 4}).numel() == 24);
  CHECK(TensorView::contiguous(nullptr, DType::F32, {}).numel() == 1);
  // A zero dim anywhere empties the tensor, however large the rest.
  CHECK(TensorView::contiguous(nullptr, DType::F32, {kBig, kBig, 0}).numel() == 0);
  CHECK_THROWS_WITH(TensorView::contiguous(nullptr, DType::BF16, {kBig, kBig}).numel(),
                    Catch::Contains("bf16 [4294967296, 4294967296]") &&
                        Catch::Contains("overflows int64"));
}

TEST_CASE("TensorView::narrow views a range of one dimension", "[tensor]") {
  std::vector<float> mem(2 * 3 * 4);
  const TensorView t = TensorView::contiguous(mem.data(), DType::F32, {2, 3, 4});
  const TensorView v = t.narrow(1, 1, 2);
  CHECK(v.data == mem.data() + 4);
  CHECK(v.shape == std::vector<int64_t>{2, 2, 4});
  CHECK(v.strides == std::vector<int64_t>{12, 4, 1});
  // Narrowing a narrowed view keeps its strides.
  CHECK(v.narrow(2, 3, 1).data == mem.data() + 7);
  CHECK(v.narrow(2, 3, 1).strides == std::vector<int64_t>{12, 4, 1});
  CHECK(t.narrow(0, 2, 0).shape[0] == 0);
  CHECK_THROWS_WITH(t.narrow(1, 2, 2), Catch::Contains("dim 1 elements [2, 2 + 2)") &&
                                           Catch::Contains("float32 [2, 3, 4]"));
  CHECK_THROWS_WITH(t.narrow(3, 0, 1), Catch::Contains("dim 3"));
  CHECK_THROWS(t.narrow(0, -1, 1));
}

// ---- validation and configuration (CI: everything here fails before any GPU work)

TEST_CASE("flexc::attention names the bad argument", "[attention]") {
  // prepare_attention runs the same checks (and fails before any GPU work alike).
  const bool prepare = GENERATE(false, true);
  INFO((prepare ? "prepare_attention" : "attention"));
  std::vector<uint16_t> mem(1 << 16);
  auto t = [&](std::vector<int64_t> shape, DType d = DType::BF16, std::vector<int64_t> st = {}) {
    return TensorView{mem.data() + 8, d, std::move(shape), std::move(st)};
  };
  // Distinct buffers so that `out` overlaps nothing.
  std::vector<uint16_t> mo(1 << 16), mk(1 << 16);
  const TensorView q = t({1, 4, 16, 64}), out{mo.data() + 8, DType::BF16, {1, 4, 16, 64}, {}};
  const TensorView k{mk.data() + 8, DType::BF16, {1, 2, 32, 64}, {}};
  const Variant noop = Variant::from_catalogue("noop");
  auto err = [&](const TensorView& q2, const TensorView& k2, const TensorView& o2,
                 const AttentionOptions& opts = {}, const Variant* v = nullptr) {
    try {
      if (prepare)
        prepare_attention(q2, k2, k2, o2, v ? *v : noop, opts);
      else
        attention(q2, k2, k2, o2, v ? *v : noop, opts);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK_THAT(err(t({4, 16, 64}), k, out), Contains("q must be [B, H, SEQ, D]; got rank 3"));
  CHECK_THAT(err(t({1, 4, 16, 64}, DType::F32), k, out), Contains("q is float32; bf16 or fp16"));
  CHECK_THAT(err(q, TensorView{k.data, DType::F16, k.shape, {}}, out),
             Contains("k is fp16 but q is bf16"));
  // out: q's dtype, or float32 (unrounded); nothing else.
  CHECK_THAT(err(q, k, TensorView{out.data, DType::F16, out.shape, {}}),
             Contains("out is fp16 but q is bf16; q's dtype or float32 expected"));
  CHECK_THAT(err(q, k, TensorView{out.data, DType::I32, out.shape, {}}),
             Contains("out is int32; bf16 or fp16 (q's dtype) or float32 expected"));
  AttentionOptions merge;
  merge.accumulate = true;
  CHECK_THAT(err(q, k, out, merge),
             Contains("accumulate merges into a float32 out and its lse; out is bf16 and lse is "
                      "not set"));
  CHECK_THAT(err(q, TensorView{k.data, k.dtype, {1, 2, 32, 32}, {}}, out),
             Contains("k must be [B, Hkv, KV_LEN, D] = [1, *, *, 64]"));
  CHECK_THAT(err(q, TensorView{k.data, k.dtype, {1, 3, 32, 64}, {}}, out),
             Contains("Hq % Hkv == 0"));
  CHECK_THAT(err(t({1, 4, 16, 48}), TensorView{k.data, k.dtype, {1, 2, 32, 48}, {}},
                 TensorView{out.data, out.dtype, {1, 4, 16, 48}, {}}),
             Contains("head dim 48 is not supported"));
  CHECK_THAT(err(t({1, 4, 16, 64}, DType::BF16, {4096, 1024, 1, 16}), k, out),
             Contains("q: the head dim must be contiguous"));
  CHECK_THAT(err(t({1, 4, 16, 64}, DType::BF16, {4100, 1025, 68, 1}), k, out),
             Contains("multiples of 8 elements"));
  CHECK_THAT(err(TensorView{mem.data() + 1, DType::BF16, {1, 4, 16, 64}, {}}, k, out),
             Contains("q: data must be 16-byte aligned"));
  CHECK_THAT(err(q, k, TensorView{out.data, out.dtype, {1, 4, 17, 64}, {}}),
             Contains("out must be [B, Hq, Q_LEN, Dv] = [1, 4, 16, 64] (q's, with v's head dim)"));
  // v's head dim may differ from q's (any supported pair); out takes v's.
  std::vector<uint16_t> mv(1 << 16);
  const auto err_v = [&](std::vector<int64_t> v_shape, std::vector<int64_t> out_shape) {
    try {
      attention(q, k, TensorView{mv.data() + 8, DType::BF16, std::move(v_shape), {}},
                TensorView{mo.data() + 8, DType::BF16, std::move(out_shape), {}}, noop);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK_THAT(err_v({1, 2, 32, 128}, {1, 4, 16, 64}),
             Contains("out must be [B, Hq, Q_LEN, Dv] = [1, 4, 16, 128]"));
  CHECK_THAT(err_v({1, 2, 32, 80}, {1, 4, 16, 80}), Contains("v: head dim 80 is not supported"));
  CHECK_THAT(err_v({1, 2, 31, 64}, {1, 4, 16, 64}),
             Contains("v must be [B, Hkv, KV_LEN, Dv] = [1, 2, 32, *] like k"));
  CHECK_THAT(err(q, k, TensorView{k.data, k.dtype, q.shape, {}}), Contains("out overlaps k"));
  // D is checked before the int cast that would make 2^32 + 128 look like 128.
  const int64_t wide = (int64_t(1) << 32) + 128;
  CHECK_THAT(err(t({1, 4, 16, wide}), TensorView{k.data, k.dtype, {1, 2, 32, wide}, {}},
                 TensorView{out.data, out.dtype, {1, 4, 16, wide}, {}}),
             Contains("flexc::attention: q: head dim 4294967424 is not supported"));
  // out must not overlap itself (rows closer than D, a stride 0 over several heads), q or lse.
  CHECK_THAT(err(q, k, TensorView{out.data, out.dtype, q.shape, {4096, 1024, 32, 1}}),
             Contains("out has elements that share memory"));
  CHECK_THAT(err(q, k, TensorView{out.data, out.dtype, q.shape, {1024, 0, 64, 1}}),
             Contains("out has elements that share memory"));
  CHECK_THAT(err(q, k, TensorView{q.data, q.dtype, q.shape, {}}), Contains("out overlaps q"));
  {
    AttentionOptions lo;
    lo.lse = TensorView{out.data, DType::F32, {1, 4, 16}, {}};
    CHECK_THAT(err(q, k, out, lo), Contains("lse overlaps out"));
    lo.lse = TensorView{mk.data() + 8, DType::F32, {1, 4, 16}, {}};
    CHECK_THAT(err(q, k, out, lo), Contains("lse overlaps k"));
    // A permuted [B, SEQ, H, D] out and a stride 0 over a dim of size 1 pass the overlap checks
    // (the block mask check after them fails, so nothing reaches the GPU).
    const std::vector<int32_t> one1{1}, zero1{0};
    const BlockMask bad_len = BlockMask::from_kv_blocks(1, 1, 16, 33, 128, 128, one1, zero1);
    lo = {};
    lo.block_mask = &bad_len;
    CHECK_THAT(err(q, k, TensorView{out.data, out.dtype, q.shape, {0, 64, 256, 1}}, lo),
               Contains("block_mask was built for"));
  }
  std::vector<float> lse_mem(64);
  AttentionOptions o;
  o.lse = TensorView{lse_mem.data(), DType::F32, {1, 4, 15}, {}};
  CHECK_THAT(err(q, k, out, o), Contains("lse must be contiguous float32 [B, Hq, Q_LEN] = [1, 4, 16]"));
  o = {};
  o.scale = -1;
  CHECK_THAT(err(q, k, out, o), Contains("scale must be finite and > 0"));
  o = {};
  o.params["widow"] = 3;
  const Variant window = Variant::from_catalogue("sliding_window");
  CHECK_THAT(err(q, k, out, o, &window), Contains("no param 'widow' (did you mean 'window'?)"));
  o = {};
  o.params["window"] = 2.5;
  CHECK_THAT(err(q, k, out, o, &window), Contains("param 'window' is an int32; got 2.5"));
  const Variant alibi = Variant::from_catalogue("alibi");
  CHECK_THAT(err(q, k, out, {}, &alibi), Contains("'alibi' reads capture 'slope'"));
  std::vector<float> slope(4);
  o = {};
  o.captures["slope"] = TensorView::contiguous(slope.data(), DType::F32, {2});
  CHECK_THAT(err(q, k, out, o, &alibi),
             Contains("capture 'slope' has shape [2]; its declaration [H] needs [4]"));
  o.captures["slope"] = TensorView::contiguous(slope.data(), DType::BF16, {4});
  CHECK_THAT(err(q, k, out, o, &alibi), Contains("capture 'slope' is bf16; its declaration says float32"));
  // Misaligned for float32: would fault on the device; caught before any launch.
  o.captures["slope"] = TensorView::contiguous(reinterpret_cast<char*>(slope.data()) + 2,
                                               DType::F32, {4});
  CHECK_THAT(err(q, k, out, o, &alibi),
             Contains("capture 'slope': data is not aligned to its 4-byte elements"));
  o.captures.clear();
  o.captures["slop"] = TensorView::contiguous(slope.data(), DType::F32, {4});
  CHECK_THAT(err(q, k, out, o, &alibi), Contains("no capture 'slop' (did you mean 'slope'?)"));

  // BlockMasks: lengths, broadcast sizes, tile sizes the kernel can split.
  const std::vector<int32_t> one{1}, zero{0};
  o = {};
  const BlockMask wrong_len = BlockMask::from_kv_blocks(1, 1, 16, 33, 128, 128, one, zero);
  o.block_mask = &wrong_len;
  CHECK_THAT(err(q, k, out, o), Contains("block_mask was built for q_len 16, kv_len 33"));
  // Positions: each field must match the call's, the sequence's lengths resolved first.
  const Variant causal = Variant::from_catalogue("causal");
  BlockMaskOptions bmo;
  bmo.kv_offset = 64, bmo.seq_q_len = 100;
  const BlockMask block = create_block_mask(causal, 1, 4, 16, 32, bmo);
  o.block_mask = &block;
  o.kv_offset = 64;
  CHECK_THAT(err(q, k, out, o, &causal),
             Contains("block_mask was built with seq_q_len 100; the call has 16"));
  o.seq_q_len = 100, o.kv_offset = 65;
  CHECK_THAT(err(q, k, out, o, &causal),
             Contains("block_mask was built with kv_offset 64; the call has 65"));
  o.kv_offset = 70, o.seq_kv_len = 101;
  CHECK_THAT(err(q, k, out, o, &causal),
             Contains("seq_kv_len = 101 must hold kv_offset + KV_LEN = 102"));
  o = {};
  o.q_offset = -2;
  CHECK_THAT(err(q, k, out, o), Contains("q_offset = -2 must be >= 0"));
  o = {};
  const std::vector<int32_t> ones3{1, 1, 1}, zeros3{0, 0, 0};
  const BlockMask three = BlockMask::from_kv_blocks(1, 3, 16, 32, 128, 128, ones3, zeros3);
  o.block_mask = &three;
  CHECK_THAT(err(q, k, out, o), Contains("block_mask has 3 heads; the call has 4 query heads"));
  const BlockMask small = BlockMask::from_kv_blocks(1, 1, 16, 32, 64, 128, one, zero);
  o.block_mask = &small;
  CHECK_THAT(err(q, k, out, o), Contains("block_mask tiles 64 x 128 must be multiples of the kernel's 128 x 64"));
  // Forcing the Hopper kernel: its tiles and head dims, checked before any GPU work.
  const BlockMask narrow = BlockMask::from_kv_blocks(1, 1, 16, 32, 128, 64, one, zero);
  o.block_mask = &narrow;
  o.kernel = FwdKernel::Hopper;
  CHECK_THAT(err(q, k, out, o),
             Contains("block_mask tiles 128 x 64 must be multiples of the Hopper kernel's 128 x 128"));
  o.block_mask = nullptr;
  CHECK_THAT(err(t({1, 4, 16, 32}), TensorView{k.data, k.dtype, {1, 2, 32, 32}, {}},
                 TensorView{out.data, out.dtype, {1, 4, 16, 32}, {}}, o),
             Contains("the Hopper kernel has no head dim 32 (64, 96, 128, 192 or 256)"));
  // A head-shared [Q_LEN, KV_LEN] capture puts the q tiles on the grid's y (at most 65535).
  const Variant bias_2d = Variant::from_strings("score + bias[q_idx, kv_idx]", "true",
                                                {{"bias", "bf16", {"Q_LEN", "KV_LEN"}}}, {}, "b2");
  const int64_t rows = 65535 * 128 + 1;
  CHECK_THAT(err(t({1, 1, rows, 64}), TensorView{k.data, k.dtype, {1, 1, 32, 64}, {}},
                 TensorView{out.data, out.dtype, {1, 1, rows, 64}, {}}, o, &bias_2d),
             Contains("at most 65535 q tiles of 128 rows; Q_LEN 8388481 is more"));
  // D 64 takes 128-row q tiles instead of 192-row ones under a mask's BlockMask up to KV_LEN
  // 1536 (then persistent too, below), 192-row ones otherwise.
  CHECK(detail::fwd_sm90_block_m(64, 64, 1536, false, true) == 128);
  CHECK(detail::fwd_sm90_block_m(64, 64, 1537, false, true) == 0);
  CHECK(detail::fwd_sm90_block_m(64, 64, 1024, true, true) == 0);
  CHECK(detail::fwd_sm90_block_m(64, 64, 1024, false, false) == 0);
  CHECK(detail::fwd_sm90_block_m(128, 128, 1024, false, true) == 0);
  CHECK(detail::fwd_sm90_block_m(64, 128, 1024, false, true) == 0);
  CHECK(detail::fwd_config_sm90(64, 64, 0).block_m == 192);
  // Short sequences with more work items than SMs take the persistent kernel; long ones, too
  // few items, or D 64's 192-row tiles, a CTA per item.
  const detail::TileConfig d128 = detail::fwd_config_sm90(128, 128);
  CHECK(detail::fwd_sm90_persistent(d128, 128, 128, 1024, 2048, 132));
  CHECK(detail::fwd_sm90_persistent(detail::fwd_config_sm90(96, 96), 96, 96, 2048, 2048, 132));
  CHECK_FALSE(detail::fwd_sm90_persistent(d128, 128, 128, 16384, 2048, 132));
  CHECK_FALSE(detail::fwd_sm90_persistent(d128, 128, 128, 1024, 100, 132));
  CHECK_FALSE(
      detail::fwd_sm90_persistent(detail::fwd_config_sm90(64, 64), 64, 64, 1024, 3072, 132));
  CHECK_FALSE(detail::fwd_sm90_persistent(detail::fwd_config_sm90(256, 256), 256, 256, 1024, 2048,
                                          132));
  // Q's 16-column chunks in registers: all of Q at D 96 and with 64-wide kv tiles (v's head dim
  // above 128) as far as Q and O fit 160 registers, none at D 64, 128 or 192 / 128.
  const auto q_chunks = [](int d, int dv, int block_m = 0) {
    return detail::fwd_sm90_q_chunks(detail::fwd_config_sm90(d, dv, block_m), d, dv);
  };
  CHECK(q_chunks(128, 128) == 0);
  CHECK(q_chunks(96, 96) == 6);
  CHECK(q_chunks(192, 192) == 12);
  CHECK(q_chunks(128, 192) == 8);
  CHECK(q_chunks(256, 256) == 8);
  CHECK(q_chunks(128, 256) == 8);
  CHECK(q_chunks(192, 128) == 0);  // 128-wide kv tiles
  CHECK(q_chunks(64, 64) == 0);
  CHECK(q_chunks(64, 64, 128) == 0);
  // score_mod's tile load by TMA: two stages of the tile (and their barriers), O staged over Q;
  // a capture whose layout TMA cannot step takes the consumers' own loads (no map).
  CHECK(detail::fwd_sm90_tile_tma_bytes(d128, 128, 128) ==
        2 * (2 * 128 * 128 + 16) - 2 * 128 * 128);
  CHECK(detail::fwd_sm90_tile_tma_bytes(detail::fwd_config_sm90(256, 256), 256, 256) ==
        2 * (2 * 128 * 64 + 16));
  // (Addresses only: none of these is read.)
  const auto view = [](std::vector<int64_t> shape, std::vector<int64_t> strides, DType dt,
                       int64_t offset = 0) {
    return TensorView{reinterpret_cast<void*>(uintptr_t(1 << 20) + 2 * offset), dt,
                      std::move(shape), std::move(strides)};
  };
  const DType bf = DType::BF16;
  CHECK_FALSE(detail::tile_map(view({100, 1000}, {1, 100}, bf), 0, 1, 128));   // kv dim strided
  CHECK_FALSE(detail::tile_map(view({100, 1001}, {1001, 1}, bf), 1, 0, 128));  // pitch: 2002 bytes
  CHECK_FALSE(detail::tile_map(view({100, 1000}, {1000, 1}, bf, 1), 1, 0, 128));  // base unaligned
  CHECK_FALSE(detail::tile_map(view({100, 1000}, {1000, 1}, DType::F32), 1, 0, 128));
  CHECK_FALSE(detail::tile_map(view({2, 100, 1000}, {100004, 1000, 1}, bf), 2, 1, 128));
  CHECK_FALSE(detail::tile_map(view({100, 1000}, {1000, 1}, bf), 1, -1, 128));  // q_idx % 64, say
  // Above D 128 the Hopper kernel's kv tiles are 64 wide: a 128 x 64 BlockMask fits them.
  for (int d : {64, 96, 128, 192, 256}) {
    const detail::TileConfig c = detail::fwd_config_sm90(d, d);
    INFO("D " << d);
    CHECK(c.smem_bytes <= 227 * 1024);
    CHECK(c.block_n == (d > 128 ? 64 : 128));
  }
  // FlashAttention-3's wide kv tiles at D 128, 192 and 256 (O over Q), with as many of Q's chunks
  // in registers as fit beside O, S and P.
  for (auto [d, n, chunks] : {std::tuple{128, 176, 4}, {192, 112, 8}, {256, 80, 6}}) {
    const detail::TileConfig c = detail::fwd_config_sm90(d, d, 0, true);
    INFO("D " << d << " wide");
    CHECK(detail::fwd_sm90_wide_n(d, d) == n);
    CHECK(c.block_n == n);
    CHECK(c.smem_bytes <= 227 * 1024);
    CHECK(detail::fwd_sm90_q_chunks(c, d, d) == chunks);
  }
  // At D 128 only beside a score_mod the forward kernels compute as the identity (its row terms
  // and a positive factor apart).
  const auto forward_identity = [](const Variant& v) {
    return dsl::launch_facts(detail::emit_input(detail::impl_of(v))).forward_identity;
  };
  CHECK(forward_identity(Variant::from_catalogue("noop")));
  CHECK(forward_identity(Variant::from_catalogue("causal")));
  CHECK(forward_identity(Variant::from_strings("score * 0.5 + qb[h, q_idx]", "true",
                                               {{"qb", "float32", {"H", "Q_LEN"}}}, {}, "qb")));
  CHECK_FALSE(forward_identity(Variant::from_catalogue("softcap")));
  CHECK_FALSE(
      forward_identity(Variant::from_strings("score + 0.01 * kv_idx", "true", {}, {}, "k")));
  for (auto [d, dv] : {std::pair{64, 64}, {96, 96}, {192, 128}, {128, 256}}) {
    CHECK(detail::fwd_sm90_wide_n(d, dv) == 0);
    CHECK_THROWS_WITH(detail::fwd_config_sm90(d, dv, 128, true),
                      Contains(fmt::format("no wide kv tiles for head dims {} / {}", d, dv)));
  }
  // Every pair of head dims and q tile, with the most shared memory any variant's hooks add.
  for (int d : {64, 96, 128, 192, 256})
    for (int dv : {64, 96, 128, 192, 256})
      for (int bm : {0, 128}) {
        const detail::TileConfig c = detail::fwd_config_sm90(d, dv, bm);
        INFO("D " << d << " Dv " << dv << " block_m " << c.block_m);
        CHECK(c.smem_bytes + detail::fwd_hook_bytes(dsl::kMostLaunchFacts, c, true) <= 227 * 1024);
      }
  for (FwdKernel fk : {FwdKernel::Auto, FwdKernel::Portable, FwdKernel::Hopper})
    CHECK(parse_fwd_kernel(to_string(fk)) == fk);
  CHECK_THROWS_WITH(parse_fwd_kernel("hoper"),
                    Contains("unknown forward kernel 'hoper' (auto, portable or hopper)"));
  // k and v broadcast over their heads by a stride of 0: fine for the portable kernel, not TMA.
  CHECK_THAT(err(q, TensorView{k.data, k.dtype, k.shape, {2048, 0, 64, 1}}, out, o),
             Contains("the Hopper kernel needs a nonzero stride on every dim of k longer than 1"));

  // Packed sequences: [TOTAL, H, D] tensors, int32 [B + 1] offsets, the longest within the rows.
  std::vector<int32_t> cu(8, 0);
  AttentionOptions pk;
  pk.packed =
      PackedSequences{{cu.data(), DType::I32, {3}, {}}, {cu.data(), DType::I32, {3}, {}}, 16, 32};
  const TensorView pq = t({16, 4, 64}), pk_k{mk.data() + 8, DType::BF16, {32, 2, 64}, {}},
                   pout{mo.data() + 8, DType::BF16, {16, 4, 64}, {}};
  CHECK_THAT(err(q, pk_k, pout, pk),
             Contains("packed sequences: q must be [TOTAL_Q, Hq, D]; got bf16 [1, 4, 16, 64]"));
  AttentionOptions bad = pk;
  bad.packed->cu_seqlens_q = TensorView{cu.data(), DType::F32, {3}, {}};
  CHECK_THAT(err(pq, pk_k, pout, bad),
             Contains("packed.cu_seqlens_q must be contiguous int32 [B + 1] = [3] on the device"));
  bad = pk;
  bad.packed->cu_seqlens_kv = TensorView{cu.data(), DType::I32, {4}, {}};
  CHECK_THAT(err(pq, pk_k, pout, bad), Contains("packed.cu_seqlens_kv must be contiguous int32 "
                                                "[B + 1] = [3]"));
  bad = pk;
  bad.packed->max_seqlen_kv = 33;
  CHECK_THAT(err(pq, pk_k, pout, bad),
             Contains("packed.max_seqlen_kv = 33 must lie in [0, 32] (the packed rows)"));
  bad = pk;
  bad.q_offset = 5;
  CHECK_THAT(err(pq, pk_k, pout, bad), Contains("packed sequences take no q_offset"));
  bad = pk;
  bad.lse = TensorView{lse_mem.data(), DType::F32, {1, 4, 16}, {}};
  CHECK_THAT(err(pq, pk_k, pout, bad),
             Contains("lse must be contiguous float32 [Hq, TOTAL_Q] = [4, 16] with packed"));
  CHECK_THAT(err(pq, TensorView{mk.data() + 8, DType::BF16, {32, 2, 32}, {}}, pout, pk),
             Contains("packed sequences: k must be [TOTAL_KV, Hkv, D] = [*, *, 64] like q"));
  CHECK_THAT(err(pq, pk_k, TensorView{mo.data() + 8, DType::BF16, {16, 4, 32}, {}}, pk),
             Contains("packed sequences: out must be [TOTAL_Q, Hq, Dv] = [16, 4, 64]"));
  bad = pk;
  bad.packed->cu_seqlens_q = TensorView{mo.data() + 64, DType::I32, {3}, {}};
  CHECK_THAT(err(pq, pk_k, pout, bad), Contains("out overlaps packed.cu_seqlens_q"));
  // A BlockMask cannot serve sequences of different lengths when mask_mod reads them.
  const Variant br = Variant::from_catalogue("causal_bottom_right");
  const BlockMask br_mask = create_block_mask(br, 2, 4, 16, 32);
  bad = pk;
  bad.block_mask = &br_mask;
  CHECK_THAT(err(pq, pk_k, pout, bad, &br), Contains("mask_mod reads q_len or kv_len"));
}

TEST_CASE("the forward kernel has a configuration per head dim and compiles for each",
          "[attention]") {
  for (int d : {32, 64, 96, 128, 192, 256}) {
    const detail::TileConfig c = detail::fwd_config(d, d);
    INFO("D " << d);
    CHECK(c.block_m % (16 * (c.threads / 32)) == 0);
    CHECK(c.block_n % 16 == 0);
    CHECK(c.smem_bytes <= 163 * 1024);  // fits an A100's opt-in shared memory (sm_80)
    CHECK(128 % c.block_m == 0);        // the default BlockMask tile splits into kernel tiles
    CHECK(128 % c.block_n == 0);
  }
  CHECK_THROWS_WITH(detail::fwd_config(80, 80), Contains("head dim 80 is not supported"));
  CHECK_THROWS_WITH(detail::fwd_config(64, 80), Contains("head dim 80 is not supported"));
  CHECK_THROWS_WITH(detail::fwd_config_sm90(192, 32),
                    Contains("the Hopper kernel has no head dim 32"));
  // D 64: three consumers of 64 rows (192-row tiles), or two where the hooks need the registers.
  CHECK(detail::fwd_config_sm90(64, 64).block_m == 192);
  CHECK(detail::fwd_config_sm90(64, 64).threads == 512);
  CHECK(detail::fwd_config_sm90(64, 64, 128).threads == 384);
  CHECK(detail::fwd_config_sm90(64, 128).block_m == 128);
  CHECK_THROWS_WITH(detail::fwd_config_sm90(128, 128, 192),
                    Contains("no 192-row q tiles for head dims 128 / 128"));
  // Different q / k and v head dims: tiles for the wider, shared memory for both.
  // 128-wide kv tiles while O (Dv) leaves the registers and K / V fit twice (MLA's 192 / 128).
  for (auto [d, dv, block_n] : {std::tuple{192, 128, 128},
                                {128, 192, 64},
                                {64, 256, 64},
                                {256, 64, 64},
                                {96, 64, 128},
                                {256, 128, 64}}) {
    INFO("D " << d << " Dv " << dv);
    const int wide = std::max(d, dv);
    CHECK(detail::fwd_config(d, dv).block_m == detail::fwd_config(wide, wide).block_m);
    CHECK(detail::fwd_config(d, dv).smem_bytes <= detail::fwd_config(wide, wide).smem_bytes);
    CHECK(detail::fwd_config_sm90(d, dv).block_n == block_n);
    CHECK(detail::fwd_config_sm90(d, dv).smem_bytes <= 227 * 1024);
  }
  CHECK_THROWS_WITH(jit::attention_fwd_spec({"sm_90", "fp32", 64}), Contains("dtype 'fp32'"));
  // NVRTC, no GPU needed: every head dim and dtype for sm_80, with a variant that uses every hook.
  const Variant v = Variant::from_strings("score + 0.5 * bias[h % 2]", "q_idx >= kv_idx",
                                          {{"bias", "float32", {"2"}}});
  std::vector<jit::KernelSpec> specs;
  for (const char* dtype : {"bf16", "fp16"}) {
    for (int d : {32, 64, 96, 128, 192, 256})
      specs.push_back(jit::attention_fwd_spec({"sm_80", dtype, d}));
    for (int d : {64, 96, 128, 192, 256})
      specs.push_back(jit::attention_fwd_sm90_spec({"sm_90", dtype, d}));
    // q / k and v head dims apart: MLA's 192 / 128, and v wider than q.
    specs.push_back(jit::attention_fwd_spec({"sm_80", dtype, 192, 128}));
    specs.push_back(jit::attention_fwd_sm90_spec({"sm_90", dtype, 192, 128}));
    specs.push_back(jit::attention_fwd_sm90_spec({"sm_90", dtype, 64, 256}));
    specs.push_back(jit::attention_fwd_sm90_spec({"sm_90", dtype, 64, 64, 128}));
    // Packed sequences (varlen builds).
    jit::KernelConfig packed{"sm_80", dtype, 128};
    packed.varlen = true;
    specs.push_back(jit::attention_fwd_spec(packed));
    packed.arch = "sm_90";
    specs.push_back(jit::attention_fwd_sm90_spec(packed));
  }
  std::vector<jit::Compiled> out = jit::compile_all(v, specs);
  // The most shared memory hooks add (two relative terms' tables, two column loads of each mod)
  // where the tiles leave the least: MLA's 192 / 128, D 256 / Dv 64. (One term multiplies the
  // score: fast math would add two terms of one sum into one table.)
  const Variant most = Variant::from_strings(
      "score * exp(-abs(q_idx - kv_idx) / 256.0) + kvb[kv_idx] - kvc[kv_idx] + "
      "rel[clamp(kv_idx - q_idx, -255, 255) + 255]",
      "doc[kv_idx] == doc[q_idx] && keep[kv_idx]",
      {{"kvb", "float32", {"KV_LEN"}},
       {"kvc", "float32", {"KV_LEN"}},
       {"rel", "float32", {"511"}},
       {"doc", "int32", {"KV_LEN"}},
       {"keep", "bool", {"KV_LEN"}}});
  const size_t first_most = specs.size();
  for (auto [d, dv] : {std::pair{192, 128}, {256, 64}})
    specs.push_back(jit::attention_fwd_sm90_spec({"sm_90", "bf16", d, dv}));
  const std::vector<jit::Compiled> out_most =
      jit::compile_all(most, std::vector(specs.begin() + first_most, specs.end()));
  REQUIRE(dsl::launch_facts(detail::emit_input(detail::impl_of(most))).score_rel_terms == 2);
  out.insert(out.end(), out_most.begin(), out_most.end());
  for (size_t i = 0; i < out.size(); ++i) {
    INFO(fmt::format("{}", fmt::join(specs[i].defines | std::views::transform([](auto& p) {
                                       return p.first + "=" + p.second;
                                     }),
                                     " ")));
    CHECK(out[i].cubin.size() > 0);
    const bool hopper = specs[i].arch == "sm_90a";
    CHECK(out[i].ptx.find(hopper ? "wgmma.mma_async" : "mma.sync.aligned.m16n8k16") !=
          std::string::npos);
    CHECK(out[i].ptx.find("cp.async") != std::string::npos);
  }
}

namespace {

// NVRTC's log with ptxas statistics (-v) for `spec` built with variant `v`; no GPU needed.
std::string ptxas_log(const Variant& v, const jit::KernelSpec& spec) {
  const detail::VariantImpl& impl = flexc::detail::impl_of(v);
  const std::string header =
      dsl::emit_cuda_variant(detail::emit_input(impl));
  std::vector<std::string> options = jit::nvrtc_options(spec.arch, spec.defines);
  options.push_back("--ptxas-options=-v");
  return jit::nvrtc_compile(jit::splice(spec.template_name, header), options,
                            {"compiling", header})
      .log;
}

// A statistic ptxas reports for entry `entry` in such a log: the number before `what`.
int ptxas_stat(const std::string& log, const std::string& entry, const std::string& what) {
  const size_t fn = log.find("Compiling entry function '" + entry + "'");
  REQUIRE(fn != std::string::npos);
  const size_t at = log.find(what, fn);
  REQUIRE(at != std::string::npos);  // the statistics are there to read
  const size_t start = log.find_last_not_of("0123456789", at - 1) + 1;
  return std::stoi(log.substr(start, at - start));
}
int spill_bytes(const std::string& log, const std::string& entry) {
  return ptxas_stat(log, entry, " bytes spill stores");
}
// A build of the attention kernels beyond the default one: for blocks of a longer sequence
// (positions), and ring attention's, with float32 outputs as well.
struct Build {
  bool positions = false, f32_out = false, accumulate = false;  // (the forward has no accumulate)
  bool tile_tma = false;  // the Hopper forward's tile load by TMA
  bool varlen = false;    // packed sequences (the forward)
  void apply(jit::KernelConfig& kc) const {
    kc.positions = positions, kc.f32_out = f32_out, kc.accumulate = accumulate;
    kc.tile_tma = tile_tma, kc.varlen = varlen;
  }
  std::string describe() const {
    return std::string(positions ? " positions" : "") + (f32_out ? " f32 out" : "") +
           (accumulate ? " accumulate" : "") + (varlen ? " varlen" : "");
  }
};

// The Hopper forward kernel's log as flexc::attention would launch it: Q's fragments in
// registers where the head dims take them, unless that needs local memory; at D 64 (no Q
// fragments), the 192-row tiles unless they need local memory (their consumers' 160 registers
// do not hold the hooks' working set), then the 128-row ones. `tall`: whether the 192-row one
// was taken; `in_regs`: whether Q's fragments were.
std::string hopper_fwd_log(const Variant& v, int d, int dv, bool* tall = nullptr, Build build = {},
                           bool* in_regs = nullptr) {
  jit::KernelConfig kc{"sm_90", "bf16", d, dv};
  build.apply(kc);
  const auto log_of = [&] { return ptxas_log(v, jit::attention_fwd_sm90_spec(kc)); };
  const auto fits = [](const std::string& l) {
    return ptxas_stat(l, "flexc_attention_fwd_sm90", " bytes stack frame") == 0;
  };
  const bool q_regs = detail::fwd_sm90_q_chunks(detail::fwd_config_sm90(d, dv), d, dv) > 0;
  std::string log = log_of();
  if (q_regs && !fits(log)) kc.smem_q = true, log = log_of();
  if (in_regs) *in_regs = q_regs && !kc.smem_q;
  if (tall) *tall = d == 64 && dv == 64 && fits(log);
  if (d == 64 && dv == 64 && !fits(log)) {
    kc.block_m = 128;
    log = log_of();
  }
  return log;
}

// The builds to check for a catalogue variant: the default one, and for a sample the build for
// blocks of a longer sequence (positions), ring attention's (positions, float32 outputs) and,
// for the `forward` kernels, packed sequences' (varlen), the costliest hooks among them.
std::vector<Build> builds_of(const std::string& name, bool forward) {
  for (const char* sampled : {"causal", "alibi", "document", "dilated_window", "softcap", "t5_bias"})
    if (name == sampled) {
      std::vector<Build> builds{{}, {true}, {true, true, true}};
      if (forward) builds.push_back({.varlen = true});
      return builds;
    }
  return {{}};
}

}  // namespace

TEST_CASE("the Hopper kernel keeps its wgmmas asynchronous and barely spills, every variant",
          "[attention][catalogue]") {
  // ptxas serializes wgmma (warnings C7513 / C7514) when registers a running wgmma uses are
  // touched; the kernel then still works but loses its overlap. Checked here, without a GPU.
  // At D 64 the 192-row tiles (three consumers of 160 registers) serve every catalogue variant
  // but softcap, whose `cap * tanh(score / cap)` spills 40 bytes there since score / cap became
  // one multiply (`30.0 * tanh(score / 30.0)` did before too): it takes 128-row tiles, 3% slower
  // (docs/perf.md, "Uniform factors folded into one"). The build for a block of a longer
  // sequence (positions) too, for a sample.
  for (const std::string& name : Variant::catalogue_names()) {
    const Variant v = Variant::from_catalogue(name);
    for (int d : {64, 128})
      for (const Build& build : builds_of(name, true)) {
        bool tall = false;
        const std::string log = hopper_fwd_log(v, d, d, &tall, build);
        INFO(name << " D " << d << build.describe() << "\n" << log);
        CHECK(log.find("C751") == std::string::npos);
        // More than a few bytes would mean a loop's working set no longer fits.
        CHECK(spill_bytes(log, "flexc_attention_fwd_sm90") <= 8);
        if (d == 64 && name != "softcap") CHECK(tall);
      }
  }
  // score_mod's and mask_mod's per-key loads are staged in shared memory by the producer's
  // loader warps (StagedColumns): the consumers hold no registers for them, so D 64 keeps its
  // 192-row tiles.
  // A [Q_LEN, KV_LEN] bias: the tile loads' 32 words stay in the consumers' registers across the
  // wait (128-row tiles at D 64).
  const std::vector<CaptureSpec> tile_caps{{"bias", "bf16", {"Q_LEN", "KV_LEN"}},
                                           {"kvb", "float32", {"H", "KV_LEN"}}};
  const Variant tiles = Variant::from_strings("score + bias[q_idx, kv_idx]", "q_idx >= kv_idx",
                                              tile_caps, {}, "tiles");
  const Variant tiles_cols = Variant::from_strings(
      "score + bias[q_idx, kv_idx] + kvb[h, kv_idx]", "q_idx >= kv_idx", tile_caps, {}, "tc");
  const Variant cols = Variant::from_strings("score + kvb[h, kv_idx] - 0.5 * kvb[0, kv_idx]",
                                             "true", {{"kvb", "float32", {"H", "KV_LEN"}}}, {},
                                             "cols");
  const Variant doc_cols = Variant::from_strings(
      "score + kvb[h, kv_idx]", "doc[q_idx] == doc[kv_idx] && q_idx >= kv_idx",
      {{"kvb", "float32", {"H", "KV_LEN"}}, {"doc", "int32", {"KV_LEN"}}}, {}, "doc_cols");
  // A per-key float term under a mask: its column indices are computed anew for the mask (they
  // spilled 300 bytes at 192 rows when held across the scores).
  const Variant masked_alibi = Variant::from_strings(
      "score + slope[h] * (kv_idx - q_idx)", "kv_idx < 1024 || q_idx >= kv_idx",
      {{"slope", "float32", {"H"}}}, {}, "prefix_alibi");
  for (int d : {64, 128, 256})
    for (const Variant* v : {&tiles, &tiles_cols, &cols, &doc_cols, &masked_alibi}) {
      bool tall = false;
      const std::string log = hopper_fwd_log(*v, d, d, &tall);
      INFO(v->name() << " D " << d << "\n" << log);
      CHECK(log.find("C751") == std::string::npos);
      const bool spill_free = v == &cols || v == &doc_cols || v == &masked_alibi;
      CHECK(spill_bytes(log, "flexc_attention_fwd_sm90") <= (spill_free ? 0 : 8));
      if (d == 64 && spill_free) CHECK(tall);
    }
  // The tile load by TMA (kTileTma): the consumers hold no words across the wait, so D 64 keeps
  // its 192-row tiles and nothing spills; its tile stages fit shared memory up to D 256.
  Build by_tma;
  by_tma.tile_tma = true;
  for (int d : {64, 128, 256})
    for (const Variant* v : {&tiles, &tiles_cols}) {
      bool tall = false;
      const std::string log = hopper_fwd_log(*v, d, d, &tall, by_tma);
      INFO(v->name() << " D " << d << " tile by TMA\n" << log);
      CHECK(log.find("C751") == std::string::npos);
      CHECK(spill_bytes(log, "flexc_attention_fwd_sm90") == 0);
      if (d == 64) CHECK(tall);
    }
  // The persistent build (short sequences at D up to 128, 128-row tiles; at D 64 under a mask)
  // keeps its wgmmas asynchronous without a spill for the plain variants (others fall back to a
  // CTA per item).
  // And its packed sequences' build (varlen) for a sample. (Beside relative-term tables or
  // staged loads the producer warpgroup's 24-40 registers do not hold the sequence's lengths as
  // well: 52-216 bytes spill there, and such calls take a CTA per item.)
  for (const char* name : {"noop", "causal", "alibi", "sliding_window", "softcap"})
    for (int d : {64, 96, 128})
      for (bool varlen : {false, true}) {
        if (varlen && (d == 96 || std::string_view(name) == "alibi")) continue;
        jit::KernelConfig kc{"sm_90", "bf16", d, d};
        kc.persistent = true, kc.varlen = varlen;
        if (d == 64) kc.block_m = 128;
        const std::string log =
            ptxas_log(Variant::from_catalogue(name), jit::attention_fwd_sm90_spec(kc));
        INFO(name << " D " << d << " persistent" << (varlen ? " varlen" : "") << "\n" << log);
        CHECK(log.find("C751") == std::string::npos);
        CHECK(spill_bytes(log, "flexc_attention_fwd_sm90") == 0);
      }
  // Wide kv tiles (hooks that stage nothing per tile): a score_mod beside Q's fragments at D 192
  // / 256 (D 128 takes them beside the identity only), masks on every tile (no BlockMask) or
  // over two BlockMask tiles' kinds.
  for (const char* name : {"noop", "softcap", "causal", "sliding_window"})
    for (int d : {128, 192, 256}) {
      if (d == 128 && std::string_view(name) == "softcap") continue;
      jit::KernelConfig kc{"sm_90", "bf16", d, d};
      kc.wide_kv = true;
      const std::string log =
          ptxas_log(Variant::from_catalogue(name), jit::attention_fwd_sm90_spec(kc));
      INFO(name << " D " << d << " wide kv tiles\n" << log);
      CHECK(log.find("C751") == std::string::npos);
      CHECK(spill_bytes(log, "flexc_attention_fwd_sm90") == 0);
    }
  // The other head dims (O takes 48 / 96 / 128 registers), with the costliest hooks, and MLA's
  // q / k 192 with v 128 (128-wide kv tiles: S, P and O take 160 registers).
  // Q's fragments in registers but beside 128-wide kv tiles (192 / 128), and for document at D
  // 256, whose hooks spill beside half of Q there: it reads Q from shared memory.
  for (const char* name : {"softcap", "t5_bias", "document", "neighborhood_2d"})
    for (auto [d, dv] : {std::pair{96, 96}, {192, 192}, {256, 256}, {192, 128}}) {
      bool in_regs = false;
      const std::string log =
          hopper_fwd_log(Variant::from_catalogue(name), d, dv, nullptr, {}, &in_regs);
      INFO(name << " D " << d << " Dv " << dv << "\n" << log);
      CHECK(log.find("C751") == std::string::npos);
      CHECK(spill_bytes(log, "flexc_attention_fwd_sm90") <= 8);
      CHECK(in_regs == (dv != 128 && !(d == 256 && std::string(name) == "document")));
    }
}

TEST_CASE("the backward kernel builds for every variant with bounded spills", "[attention][catalogue]") {
  for (const std::string& name : Variant::catalogue_names()) {
    const Variant v = Variant::from_catalogue(name);
    for (int d : {64, 128})
      for (const Build& build : builds_of(name, false)) {
        jit::KernelConfig kc{"sm_90", "bf16", d};
        build.apply(kc);
        const std::string log = ptxas_log(v, jit::attention_bwd_spec(kc));
        INFO(name << " D " << d << build.describe() << "\n" << log);
        // dK and dV of D = 128 hold 128 registers a thread: D 128 spills a little today (at
        // most 144 bytes, alibi with its capture gradient; docs/perf.md); D 64 at most 12 bytes
        // (softcap's fast tanh and its derivative; alibi with the capture-gradient sink 8).
        CHECK(spill_bytes(log, "flexc_attention_bwd") <= (d == 64 ? 12 : 160));
      }
  }
}

TEST_CASE("the backward's per-row kernels build without spills, one unit for every variant",
          "[attention]") {
  const Variant noop = Variant::from_catalogue("noop");
  for (int d : {32, 64, 96, 128})
    for (const char* dtype : {"bf16", "fp16"})
      for (const Build& build : std::vector<Build>{{}, {false, true}, {false, true, true}}) {
        jit::KernelConfig kc{"sm_90", dtype, d};
        build.apply(kc);
        const std::string log = ptxas_log(noop, jit::attention_bwd_rows_spec(kc));
        INFO("D " << d << " " << dtype << build.describe() << "\n" << log);
        CHECK(spill_bytes(log, "flexc_attention_bwd_prep") == 0);
        CHECK(spill_bytes(log, "flexc_attention_bwd_dq") == 0);
      }
  // No hook reaches the unit: a second variant finds the first one's compile in the cache, while
  // the main kernels differ per variant; nor a position (a positions build shares it).
  flexc::KernelBuild positions{"attention_bwd_rows", "sm_90"};
  positions.positions = true;
  const std::vector<flexc::KernelBuild> builds{
      {"attention_bwd_rows", "sm_90"}, {"attention_bwd", "sm_90"}, positions};
  const auto alibi = flexc::compile_kernels(Variant::from_catalogue("alibi"), builds);
  const auto softcap = flexc::compile_kernels(Variant::from_catalogue("softcap"), builds);
  CHECK(alibi[0].key == softcap[0].key);
  CHECK(softcap[0].origin != flexc::CompiledKernel::Origin::Compiled);
  CHECK(alibi[1].key != softcap[1].key);
  CHECK(alibi[2].key == alibi[0].key);
}

TEST_CASE("the Hopper backward kernel keeps its wgmmas asynchronous with bounded spills",
          "[attention][catalogue]") {
  for (const std::string& name : Variant::catalogue_names()) {
    const Variant v = Variant::from_catalogue(name);
    const detail::VariantImpl& impl = flexc::detail::impl_of(v);
    const bool capture_grads =
        dsl::emit_cuda_variant(detail::emit_input(impl))
            .find("kHasCaptureGrads = true") != std::string::npos;
    for (int d : {64, 128})
      for (bool deterministic : {false, true})
        for (const Build& build : builds_of(name, false)) {
          jit::KernelConfig kc{"sm_90", "bf16", d};
          build.apply(kc);
          const bool positions = build.positions;
          const std::string log =
              ptxas_log(v, deterministic ? jit::attention_bwd_sm90_deterministic_spec(kc)
                                         : jit::attention_bwd_sm90_spec(kc));
          INFO(name << " D " << d << (deterministic ? " deterministic" : "") << build.describe()
                    << "\n" << log);
          CHECK(log.find("C751") == std::string::npos);
          // The producer's 24 registers hold its schedule with 56-64 bytes of spills; consumers
          // (240) spill none at D 64 but t5_bias's two instances (104 bytes since its / 8.0
          // became a multiply, which ptxas schedules wider: 1.6x faster all the same,
          // docs/perf.md). At D 128 dK and dV take 128 of them: up to 296 bytes (softcap, fast
          // float math: ptxas schedules the cheaper tanh and its derivative wider; 1.6x faster
          // than exact's 168 bytes all the same) with one consumer instance, up to 740 with the
          // capture-gradient instance as well (t5_bias). The build for a block of a longer
          // sequence (positions) holds two more offsets: up to 100 bytes at D 64
          // (dilated_window). Ring attention's (float32 dK / dV added from the fragments, not
          // staged): up to 344 at D 128 (softcap).
          CHECK(spill_bytes(log, "flexc_attention_bwd_sm90") <=
                (d == 64                 ? (capture_grads || positions ? 112 : 64)
                 : capture_grads ? 800
                 : build.f32_out ? 360
                                 : 320));
        }
  }
}

// ---- the kernel against the reference ([gpu])

namespace {

struct GpuCase {
  DType dtype = DType::BF16;
  int64_t B = 1, Hq = 1, Hkv = 1, Lq = 1, Lkv = 1, D = 64;
  bool bshd = false;        // device layout [B, S, H, D] instead of [B, H, S, D]
  int64_t pad = 0;          // extra elements per sequence step in the device layout
  bool block_mask = true;   // build one (when the mask is not `true`)
  std::map<std::string, double, std::less<>> params;
  FwdKernel kernel = FwdKernel::Auto;
  // The BlockMask built on one stream (brute force on the GPU: slow) and attention launched at
  // once on another: the kernel must wait for the mask.
  bool two_streams = false;
  int64_t Dv = 0;  // v's and the output's head dim; 0: D
  int64_t q_offset = 0;  // chunked prefill: the position of query 0
  // A block of a longer sequence: the position of key 0 and the sequence's lengths (0: q_offset
  // + Lq, kv_offset + Lkv).
  int64_t kv_offset = 0, seq_q_len = 0, seq_kv_len = 0;
  // This BlockMask instead of one built from the variant, and the variant whose mask the
  // reference applies (one that says what the BlockMask's tiles say).
  const BlockMask* given_mask = nullptr;
  const Variant* reference = nullptr;
  bool out_f32 = false;  // out in float32 (unrounded) instead of the input dtype
  // prepare_attention first, with the JIT's memory emptied: it must compile or read the disk,
  // and the call after it neither. With `graph` the call is captured into a CUDA graph (global
  // capture mode: no allocation or module load may happen in it) on a stream of its own, then
  // replayed.
  bool prepare = false, graph = false;

  int64_t dv() const { return Dv ? Dv : D; }
  int64_t seq_q() const { return seq_q_len ? seq_q_len : q_offset + Lq; }
  int64_t seq_kv() const { return seq_kv_len ? seq_kv_len : kv_offset + Lkv; }
  std::string describe() const {
    return fmt::format("{} B {} Hq {} Hkv {} Q_LEN {} KV_LEN {} D {}{}{}{}{}{}{}", dtype_name(dtype),
                       B, Hq, Hkv, Lq, Lkv, D, Dv ? fmt::format(" Dv {}", Dv) : "",
                       bshd ? " bshd" : "", pad ? " padded" : "", block_mask ? "" : " dense",
                       kernel == FwdKernel::Auto ? "" : " ",
                       kernel == FwdKernel::Auto ? "" : to_string(kernel));
  }
  // Device strides of a [B, H, S, d] tensor.
  std::vector<int64_t> strides(int64_t H, int64_t S, int64_t d) const {
    if (bshd) return {S * (H * d + pad), d, H * d + pad, 1};
    return {H * S * (d + pad), S * (d + pad), d + pad, 1};
  }
};

// A [B, H, S, d] host tensor (BHSD order) as 16-bit device memory in the case's layout.
flexc::DeviceBuffer to_device(const GpuCase& c, const std::vector<float>& x, int64_t H, int64_t S,
                            int64_t d, TensorView& view) {
  const std::vector<int64_t> st = c.strides(H, S, d);
  std::vector<uint16_t> bits(std::max<int64_t>(c.B * st[0], 8), 0xffff);  // NaN in the gaps
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t s = 0; s < S; ++s)
        for (int64_t e = 0; e < d; ++e) {
          const float v = x[((b * H + h) * S + s) * d + e];
          bits[b * st[0] + h * st[1] + s * st[2] + e] =
              c.dtype == DType::BF16 ? float_to_bf16(v) : float_to_fp16(v);
        }
  flexc::DeviceBuffer buf(bits.size() * 2);
  buf.upload(bits.data(), bits.size() * 2);
  view = TensorView{buf.get(), c.dtype, {c.B, H, S, d}, st};
  return buf;
}

// Runs the kernel with poisoned outputs and checks at most `max_rows` random rows (all when
// fewer) against the reference.
// `given`: these inputs instead of fresh random ones (to compare two runs on the same inputs).
// `given` / `given_caps`: these inputs instead of fresh random ones (one capture per the
// variant's, in its order), to compare two variants on the same ones.
Accuracy run_case(const Variant& v, const GpuCase& c, int64_t max_rows = 256,
                  const Problem* given = nullptr,
                  const std::vector<npy::Array>* given_caps = nullptr) {
  const int64_t Dv = c.dv();
  const Problem p = given ? *given : Problem(c.B, c.Hq, c.Hkv, c.Lq, c.Lkv, c.D, c.dtype, Dv);
  TensorView q, k, vv, out;
  const flexc::DeviceBuffer dq = to_device(c, p.q, c.Hq, c.Lq, c.D, q);
  const flexc::DeviceBuffer dk = to_device(c, p.k, c.Hkv, c.Lkv, c.D, k);
  const flexc::DeviceBuffer dv = to_device(c, p.v, c.Hkv, c.Lkv, Dv, vv);
  const std::vector<float> poison(c.B * c.Hq * c.Lq * Dv, std::numeric_limits<float>::quiet_NaN());
  const std::vector<int64_t> st = c.strides(c.Hq, c.Lq, Dv);
  // The output poisoned: 16-bit in the case's layout, or float32 in the same strides.
  const auto poisoned_out = [&] {
    if (!c.out_f32) return to_device(c, poison, c.Hq, c.Lq, Dv, out);
    const std::vector<float> nan(std::max<int64_t>(c.B * st[0], 4), poison.front());
    flexc::DeviceBuffer buf(nan.size() * 4);
    buf.upload(nan.data(), nan.size() * 4);
    out = TensorView{buf.get(), DType::F32, {c.B, c.Hq, c.Lq, Dv}, st};
    return buf;
  };
  const flexc::DeviceBuffer dout = poisoned_out();
  flexc::DeviceBuffer dlse(std::max<int64_t>(c.B * c.Hq * c.Lq * 4, 16));
  dlse.fill(0xff);

  AttentionOptions opts;
  ReferenceProblem ref = p.reference();
  BlockMaskOptions bmo;
  std::vector<npy::Array> caps;
  std::vector<flexc::DeviceBuffer> dcaps;
  caps.reserve(v.captures().size());
  for (const CaptureSpec& cs : v.captures()) {
    caps.push_back(given_caps ? given_caps->at(caps.size())
                              : random_capture(cs, c.B, c.Hq, c.seq_q(), c.seq_kv()));
    dcaps.emplace_back(std::max<size_t>(caps.back().bytes.size(), 16));
    dcaps.back().upload(caps.back().bytes.data(), caps.back().bytes.size());
    opts.captures[cs.name] = TensorView{dcaps.back().get(), caps.back().dtype, caps.back().shape, {}};
    ref.captures[cs.name] = caps.back().view();
    bmo.captures[cs.name] = CaptureData{caps.back().bytes.data(), dcaps.back().get(),
                                        caps.back().shape, {}};
  }
  opts.params = ref.params = bmo.params = c.params;
  opts.q_offset = ref.q_offset = bmo.q_offset = c.q_offset;
  opts.kv_offset = ref.kv_offset = bmo.kv_offset = c.kv_offset;
  opts.seq_q_len = ref.seq_q_len = bmo.seq_q_len = c.seq_q_len;
  opts.seq_kv_len = ref.seq_kv_len = bmo.seq_kv_len = c.seq_kv_len;
  opts.lse = TensorView{dlse.get(), DType::F32, {c.B, c.Hq, c.Lq}, {}};
  opts.kernel = c.kernel;
  std::optional<flexc::Stream> build_stream, run_stream;
  if (c.graph) {  // (the BlockMask built for this stream: the call waits on no other's event)
    run_stream.emplace();
    opts.stream = run_stream->get();
  }
  if (c.two_streams) {
    build_stream.emplace();
    run_stream.emplace();
    bmo.device = BuildDevice::Gpu;
    bmo.analytic = false;
    opts.stream = run_stream->get();
  }
  std::optional<BlockMask> bm;
  if (c.given_mask) {
    opts.block_mask = c.given_mask;
  } else if (c.block_mask && !v.mask_always_true()) {
    bm = create_block_mask(v, c.B, c.Hq, c.Lq, c.Lkv, bmo,
                           build_stream ? build_stream->get() : opts.stream);
    opts.block_mask = &*bm;
  }
  jit::CacheCounters prepared{};
  if (c.prepare) {
    jit::reset_cache();
    const jit::CacheCounters before = jit::cache_counters();
    prepare_attention(q, k, vv, out, v, opts);
    prepared = jit::cache_counters();
    CHECK(prepared.compiles + prepared.disk_hits > before.compiles + before.disk_hits);
  }
  if (c.graph) {
    const flexc::testing::CapturedGraph graph(opts.stream,
                                              [&] { attention(q, k, vv, out, v, opts); });
    graph.replay();
    run_stream->synchronize();
  } else {
    attention(q, k, vv, out, v, opts);
  }
  flexc::synchronize_device();
  if (c.prepare) {
    CHECK(jit::cache_counters().compiles == prepared.compiles);
    CHECK(jit::cache_counters().disk_hits == prepared.disk_hits);
  }

  const std::vector<uint16_t> bits =
      c.out_f32 ? std::vector<uint16_t>() : dout.to_vector<uint16_t>(dout.size() / 2);
  const std::vector<float> floats =
      c.out_f32 ? dout.to_vector<float>(dout.size() / 4) : std::vector<float>();
  const std::vector<float> lse = dlse.to_vector<float>(c.B * c.Hq * c.Lq);
  const int64_t rows = c.B * c.Hq * c.Lq;
  if (rows > max_rows) {
    std::uniform_int_distribution<int64_t> pick(0, rows - 1);
    for (int64_t i = 0; i < max_rows; ++i) ref.rows.push_back(pick(rng()));
  }
  const ReferenceResult r = reference_attention(c.reference ? *c.reference : v, ref);
  std::vector<float> got, got_lse;
  for (int64_t row : r.rows) {
    const int64_t b = row / (c.Hq * c.Lq), h = row / c.Lq % c.Hq, s = row % c.Lq;
    for (int64_t d = 0; d < Dv; ++d) {
      const int64_t at = b * st[0] + h * st[1] + s * st[2] + d;
      got.push_back(c.out_f32                  ? floats[at]
                    : c.dtype == DType::BF16 ? bf16_to_float(bits[at])
                                             : fp16_to_float(bits[at]));
    }
    got_lse.push_back(lse[row]);
  }
  return check_accuracy(r, got, got_lse);
}

#define SKIP_WITHOUT_GPU()      \
  if (!flexc::gpu_available()) {  \
    WARN("no GPU: skipped");    \
    return;                     \
  }

// The forward kernels this GPU runs for head dims d (and dv, v's; 0: d): the portable one, and
// on sm_90 the Hopper one.
std::vector<FwdKernel> kernels_for(int64_t d, int64_t dv = 0) {
  std::vector<FwdKernel> k{FwdKernel::Portable};
  if (flexc::current_arch() == "sm_90" && detail::fwd_sm90_supports(int(d)) &&
      detail::fwd_sm90_supports(int(dv ? dv : d)))
    k.push_back(FwdKernel::Hopper);
  return k;
}

}  // namespace

TEST_CASE("every catalogue variant matches the reference: dtypes, head dims, lengths, GQA",
          "[gpu]") {
  SKIP_WITHOUT_GPU();
  const int64_t lens[] = {1, 17, 127, 128, 129, 1000, 4096};
  const std::vector<std::string> names = Variant::catalogue_names();
  REQUIRE(names.size() >= 10);
  for (size_t vi = 0; vi < names.size(); ++vi) {
    const Variant v = Variant::from_catalogue(names[vi]);
    for (size_t i = 0; i < 7; ++i) {
      GpuCase c;
      const SweepShape s = sweep_shape(vi, i, lens);
      c.dtype = s.dtype, c.B = s.B, c.Hq = s.Hq, c.Hkv = s.Hkv, c.Lq = s.Lq, c.Lkv = s.Lkv, c.D = s.D;
      c.bshd = i % 3 == 0;
      c.block_mask = i % 4 != 1;
      for (FwdKernel kernel : kernels_for(c.D)) {
        c.kernel = kernel;
        INFO(names[vi] << ": " << c.describe());
        const Accuracy a = run_case(v, c);
        INFO(a.summary());
        CHECK(a.pass);
      }
    }
  }
}

TEST_CASE("rows with no unmasked element give 0 and -inf, never NaN", "[gpu]") {
  SKIP_WITHOUT_GPU();
  const Variant v = Variant::from_strings("where(q_idx % 5 == 1, -inf, score)", "q_idx % 3 != 0");
  for (DType d : {DType::BF16, DType::F16})
    for (bool bm : {true, false})
      for (int64_t hd : {128, 192})
        for (FwdKernel kernel : kernels_for(hd)) {
        GpuCase c{d, 2, 4, 2, 300, 200, hd, false, 0, bm, {}, kernel};
        INFO(c.describe());
        const Accuracy a = run_case(v, c, 1 << 20);
        INFO(a.summary());
        CHECK(a.pass);
        CHECK(a.masked_rows > 0);
      }
  for (FwdKernel kernel : kernels_for(64)) {
    GpuCase empty{DType::BF16, 1, 2, 2, 50, 0, 64, false, 0, false, {}, kernel};  // no keys at all
    INFO(empty.describe());
    const Accuracy a = run_case(Variant::from_catalogue("noop"), empty);
    INFO(a.summary());
    CHECK(a.pass);
    CHECK(a.masked_rows == 100);
  }
}

TEST_CASE("a BlockMask built on one stream serves attention launched on another", "[gpu]") {
  SKIP_WITHOUT_GPU();
  for (FwdKernel kernel : kernels_for(128)) {
    GpuCase c{DType::BF16, 2, 8, 8, 4096, 4096, 128, false, 0, true, {}, kernel, true};
    INFO(c.describe());
    const Accuracy a = run_case(Variant::from_catalogue("dilated_window"), c);
    INFO(a.summary());
    CHECK(a.pass);
  }
}

TEST_CASE("params, lengths and capture contents change without recompiling", "[gpu]") {
  SKIP_WITHOUT_GPU();
  const Variant window = Variant::from_catalogue("sliding_window");
  const Variant alibi = Variant::from_catalogue("alibi");
  GpuCase w{DType::BF16, 1, 4, 4, 200, 300, 64, false, 0, true, {{"window", 64}}};
  GpuCase a = w;
  a.params.clear();
  REQUIRE(run_case(window, w).pass);  // compiles (or loads) the kernels once
  REQUIRE(run_case(alibi, a).pass);
  // On Hopper a masked D 64 call takes 128-row q tiles up to KV_LEN 1536 and 192-row ones beyond
  // (two builds): the longer one compiles here too.
  GpuCase long_w = w;
  long_w.Lq = 17, long_w.Lkv = 4096;
  REQUIRE(run_case(window, long_w).pass);
  const uint64_t compiles = jit::cache_counters().compiles;
  auto check = [](const Variant& v, const GpuCase& c) {
    const Accuracy acc = run_case(v, c);
    INFO(v.name() << ": " << acc.summary());
    CHECK(acc.pass);
  };
  for (int size : {1, 33, 500}) {
    w.params["window"] = size;
    for (auto [lq, lkv] : {std::pair{200, 300}, {1000, 1000}, {17, 4096}}) {
      w.Lq = a.Lq = lq, w.Lkv = a.Lkv = lkv;
      INFO("window " << size << ": " << w.describe());
      check(window, w);
      check(alibi, a);  // fresh slopes every call
    }
  }
  CHECK(jit::cache_counters().compiles == compiles);
}

TEST_CASE("strides, MQA, per-batch masks and the other head dims", "[gpu]") {
  SKIP_WITHOUT_GPU();
  // document_batched reads b: its BlockMask has nb = B.
  for (FwdKernel kernel : kernels_for(64)) {
    GpuCase c{DType::F16, 3, 6, 1, 257, 300, 64, true, 8, true, {}, kernel};
    for (const char* name : {"document_batched", "t5_bias", "causal_bottom_right"}) {
      INFO(name << ": " << c.describe());
      const Accuracy a = run_case(Variant::from_catalogue(name), c);
      INFO(a.summary());
      CHECK(a.pass);
    }
  }
  // Head dims 96, 192 and 256 on both kernels (the Hopper one pads D 96 to two 64-column panels
  // and takes 64-wide kv tiles above D 128): lengths off the tiles, Q_LEN != KV_LEN, GQA, the
  // [B, S, H, D] layout with padded rows, captures, params, and the BlockMask's partial tiles.
  const char* names[] = {"causal", "softcap", "alibi", "document", "sliding_window", "noop"};
  for (int64_t d : {32, 96, 192, 256})
    for (FwdKernel kernel : kernels_for(d))
      for (size_t i = 0; i < std::size(names); ++i) {
        const DType t = i % 2 ? DType::F16 : DType::BF16;
        GpuCase e{t, 1 + int64_t(i % 2), 4, i % 3 ? 2 : 1, 333, 517, d, i % 2 == 0, i % 4 ? 0 : 8,
                  true, {}, kernel};
        if (i == 4) e.Lq = 1000, e.Lkv = 129, e.params["window"] = 100;
        INFO(names[i] << ": " << e.describe());
        const Accuracy a = run_case(Variant::from_catalogue(names[i]), e);
        INFO(a.summary());
        CHECK(a.pass);
      }
}

TEST_CASE("per-key capture loads, issued ahead of the scores, match the reference", "[gpu]") {
  SKIP_WITHOUT_GPU();
  // score_mod's column loads (indexed by kv_idx, not q_idx): the Hopper kernel loads them for a
  // whole kv tile before waiting for its scores, two adjacent keys at once where the capture is
  // [..., KV_LEN] with stride 1 and the pair aligned (KV_LEN 1000), one by one otherwise (KV_LEN
  // 517: odd heads' rows start unaligned; the edge tile; kvf[kv_idx // 3]). Every capture dtype,
  // three column loads in one score_mod (two are hoisted, the third stays in place), a kv-only
  // load under a q-dependent branch, and one beside a mask reading per-key captures itself.
  const std::vector<CaptureSpec> caps{{"kvb", "float32", {"H", "KV_LEN"}},
                                      {"kvh", "bf16", {"KV_LEN"}},
                                      {"kvf", "fp16", {"KV_LEN"}},
                                      {"doc", "int32", {"KV_LEN"}},
                                      {"keep", "bool", {"KV_LEN"}}};
  const Variant score_cols = Variant::from_strings(
      "score + kvb[h, kv_idx] - 0.5 * kvh[kv_idx] + where(q_idx > kv_idx, kvf[kv_idx // 3], 0.0)",
      "true", caps, {}, "score_cols");
  const Variant mask_cols = Variant::from_strings(
      "score + kvb[h, kv_idx]", "(doc[kv_idx] == doc[q_idx] || keep[kv_idx]) && kv_idx <= q_idx + 90",
      caps, {}, "kv_mask");
  const Variant fp16_bool = Variant::from_strings(
      "score + kvf[kv_idx] * where(keep[kv_idx], 1.0, 0.5)", "true", caps, {}, "fp16_bool");
  const Variant int32 =
      Variant::from_strings("score - 0.1 * float(doc[kv_idx])", "true", caps, {}, "int32");
  for (const Variant* v : {&score_cols, &mask_cols, &fp16_bool, &int32})
    for (int64_t d : {64, 128})
      for (FwdKernel kernel : kernels_for(d)) {
        GpuCase c{d == 64 ? DType::BF16 : DType::F16, 2, 4, 2, 333, d == 64 ? 1000 : 517, d,
                  d == 64, 0, true, {}, kernel};
        INFO(v->name() << ": " << c.describe());
        const Accuracy a = run_case(*v, c);
        INFO(a.summary());
        CHECK(a.pass);
      }
}

namespace {

// Runs case `c` with its queries at position 0 and at 200 (its keys extended by as many), each
// checked against the reference.
// At positions 0; as a prefill chunk at q_offset 200 (keys from 0 to its end); and as a block of
// a longer sequence (queries from 200, keys from an odd 301: a tile load's pairs misaligned;
// the sequence's two lengths longer than both, and unequal).
void check_at_offsets(const Variant& v, GpuCase c) {
  const int64_t kv_len = c.Lkv;
  for (int at = 0; at < 3; ++at) {
    c.q_offset = at ? 200 : 0;
    c.Lkv = at == 1 ? kv_len + 200 : kv_len;
    c.kv_offset = at == 2 ? 301 : 0;
    c.seq_q_len = at == 2 ? std::max(c.q_offset + c.Lq, c.kv_offset + c.Lkv) + 77 : 0;
    c.seq_kv_len = at == 2 ? c.seq_q_len + 50 : 0;
    INFO(v.name() << ": " << c.describe() << " q_offset " << c.q_offset << " kv_offset "
                  << c.kv_offset << " sequence " << c.seq_q() << " x " << c.seq_kv());
    const Accuracy a = run_case(v, c);
    INFO(a.summary());
    CHECK(a.pass);
  }
}

// noop over a user's lists, full tiles only, of the 128 x 128 tiles with (q tile + kv tile) % 3
// != 1 (those of `stripes`'s mask `(q_idx // 128 + kv_idx // 128) % 3 != 1`) at head dim d:
// noop's mask_mod keeps everything, the lists alone decide; the reference is `stripes`.
void check_stripes_lists(const Variant& stripes, int64_t d, FwdKernel kernel) {
  const int64_t lq = 1000, lkv = 900, nq = (lq + 127) / 128, nk = (lkv + 127) / 128;
  std::vector<int32_t> num(nq, 0), idx(nq * nk, 0);
  for (int64_t qt = 0; qt < nq; ++qt)
    for (int64_t kt = 0; kt < nk; ++kt)
      if ((qt + kt) % 3 != 1) idx[qt * nk + num[qt]++] = int32_t(kt);
  const BlockMask user =
      BlockMask::from_kv_blocks(1, 1, lq, lkv, 128, 128, std::vector<int32_t>(nq, 0),
                                std::vector<int32_t>(nq * nk, 0), num, idx);
  GpuCase c{DType::BF16, 2, 4, 2, lq, lkv, d, false, 0, true, {}, kernel};
  c.given_mask = &user;
  c.reference = &stripes;
  INFO("noop with stripes' lists: " << c.describe());
  const Accuracy a = run_case(Variant::from_catalogue("noop"), c);
  INFO(a.summary());
  CHECK(a.pass);
}

}  // namespace

TEST_CASE("per-score tile loads of a Q_LEN x KV_LEN bias, issued ahead, match the reference",
          "[gpu]") {
  SKIP_WITHOUT_GPU();
  // score_mod's 16-bit loads indexed by q_idx and kv_idx itself: where the capture's rows are
  // 16-byte multiples (KV_LEN 1000) and q_idx itself indexes them, the Hopper kernel's producer
  // loads the tile by TMA with K and V (kTileTma; past Q_LEN and KV_LEN as zeros) and the
  // consumers read it with ldmatrix; otherwise the consumers load a thread's share of the tile
  // before waiting for its scores, two adjacent keys a load where every row's pair is aligned,
  // element by element otherwise (KV_LEN 517: odd rows start unaligned; the edge tile), and with a
  // wrapped row index. bf16 and fp16, beside a column load (staged by the producer's loaders), a
  // relative term, a causal mask's partial tiles, queries at an offset (the TMA box's origin
  // moves), and short sequences over many work items (the persistent kernel, KV_LEN 1024).
  const std::vector<CaptureSpec> caps{{"bias", "bf16", {"Q_LEN", "KV_LEN"}},
                                      {"bhqk", "fp16", {"B", "H", "Q_LEN", "KV_LEN"}},
                                      {"rows", "bf16", {"64", "KV_LEN"}},
                                      {"kvb", "float32", {"H", "KV_LEN"}}};
  const Variant bias_2d =
      Variant::from_strings("score + bias[q_idx, kv_idx]", "q_idx >= kv_idx", caps, {}, "bias_2d");
  const Variant with_cols = Variant::from_strings(
      "score + kvb[h, kv_idx] - 0.5 * bhqk[b, h, q_idx, kv_idx]", "true", caps, {}, "bhqk_cols");
  const Variant wrapped =
      Variant::from_strings("score * 0.5 + rows[q_idx % 64, kv_idx]", "true", caps, {}, "wrapped");
  const Variant with_rel = Variant::from_strings(
      "score + bias[q_idx, kv_idx] - log(1.0 + abs(q_idx - kv_idx))", "true", caps, {}, "rel");
  int i = 0;
  for (const Variant* v : {&bias_2d, &with_cols, &wrapped, &with_rel})
    for (int64_t d : {64, 128})
      for (int64_t lkv : {1000, 517})
        for (FwdKernel kernel : kernels_for(d)) {
          const GpuCase c{++i % 2 ? DType::BF16 : DType::F16, 2, 4, 2, 333, lkv, d, false, 0, true,
                          {}, kernel};
          check_at_offsets(*v, c);
        }
  // Above D 128 the kv tiles are 64 wide (one panel a box); v's head dim apart from q's.
  for (const Variant* v : {&bias_2d, &with_cols})
    for (auto [d, dv] : {std::pair<int64_t, int64_t>{256, 256}, {192, 128}}) {
      GpuCase c{++i % 2 ? DType::BF16 : DType::F16, 2, 4, 2, 333, 1000, d, false, 0, true, {},
                FwdKernel::Hopper};
      c.Dv = dv;
      check_at_offsets(*v, c);
    }
  for (const Variant* v : {&bias_2d, &with_cols})
    for (int64_t d : {64, 128})
      check_at_offsets(
          *v, {DType::BF16, 3, 8, 2, 1000, 1024, d, false, 0, true, {}, FwdKernel::Hopper});
}

TEST_CASE("mask_mod's per-key loads, staged by the loader warps, match the reference", "[gpu]") {
  SKIP_WITHOUT_GPU();
  // mask_mod's loads indexed by kv_idx alone: the Hopper kernel's loader warps stage them per kv
  // tile after score_mod's (StagedColumns), and the consumers read them on partial tiles. A
  // document mask beside a score column load (both in one stage), two mask loads of which one is
  // a bool and one reads h (head 0 masks every key: fully masked rows), GQA, odd lengths,
  // Q_LEN != KV_LEN, queries at an offset.
  const std::vector<CaptureSpec> caps{{"kvb", "float32", {"H", "KV_LEN"}},
                                      {"doc", "int32", {"KV_LEN"}},
                                      {"flag", "bool", {"KV_LEN"}}};
  const Variant doc_cols =
      Variant::from_strings("score + kvb[h, kv_idx]", "doc[q_idx] == doc[kv_idx] && q_idx >= kv_idx",
                            caps, {}, "doc_cols");
  const Variant two = Variant::from_strings("score", "doc[kv_idx] < h && flag[kv_idx]", caps, {},
                                            "two_mask_cols");
  int i = 0;
  for (const Variant* v : {&doc_cols, &two})
    for (int64_t d : {64, 128})
      for (FwdKernel kernel : kernels_for(d)) {
        ++i;
        check_at_offsets(*v, {i % 2 ? DType::BF16 : DType::F16, 2, 4, 2, 333, i % 2 ? 517 : 1000,
                              d, false, 0, true, {}, kernel});
      }
}

TEST_CASE("the persistent Hopper kernel matches the reference over many work items", "[gpu]") {
  SKIP_WITHOUT_GPU();
  // Short sequences with more work items (q tile, head, batch) than SMs run persistent: a CTA per
  // SM loops over items, loading the next Q while it stores the last output. Heaviest q tiles
  // first over GQA heads and batches, odd lengths, Q_LEN != KV_LEN, queries at an offset; the
  // staged column loads and relative-term tables across items; items without a single kv tile
  // (rows below 600 see no key: output 0, LSE -inf) between ones with tiles. D 64 under a mask
  // runs persistent on 128-row tiles; without one (noop) on 192-row tiles, a CTA per item.
  const Variant none_below = Variant::from_strings("score", "kv_idx < q_idx - 600", {}, {}, "late");
  const std::vector<CaptureSpec> caps{{"kvb", "float32", {"H", "KV_LEN"}},
                                      {"doc", "int32", {"KV_LEN"}}};
  const Variant doc_cols = Variant::from_strings(
      "score + kvb[h, kv_idx]", "doc[q_idx] == doc[kv_idx] && q_idx >= kv_idx", caps, {}, "dc");
  int i = 0;
  for (const Variant& v : {Variant::from_catalogue("noop"), Variant::from_catalogue("causal"),
                           Variant::from_catalogue("t5_bias"), none_below, doc_cols})
    for (int64_t d : {64, 96, 128}) {
      ++i;
      // 192 items (128-row q tiles): more than an H100's 132 SMs.
      check_at_offsets(v, {i % 2 ? DType::BF16 : DType::F16, 3, 8, 2, 1000, 1100, d, false, 0,
                           true, {}, FwdKernel::Hopper});
    }
  // At D 128 a CTA stores an item's rows under its next item's first Q.K^T: Q_LEN 1030 leaves
  // the last q tile's second consumer without rows (it stores its last item's before it skips),
  // and the rows below 600 see no key in `none_below`.
  for (const Variant& v : {Variant::from_catalogue("causal"), none_below})
    check_at_offsets(
        v, {DType::BF16, 3, 8, 2, 1030, 1100, 128, false, 0, true, {}, FwdKernel::Hopper});
}

TEST_CASE("prepare_attention loads what the call runs: the call then compiles nothing", "[gpu]") {
  SKIP_WITHOUT_GPU();
  // Shapes whose builds attention() picks at run time on Hopper (docs/attention.md): wide kv
  // tiles (no BlockMask, D 128), D 64's 128-row tiles on the persistent grid (a mask, KV_LEN 1k,
  // more items than SMs), Q in registers (D 96), a [Q_LEN, KV_LEN] bias loaded by TMA, the
  // portable kernel (D 32), a capture-reading mask at D 256. Each after the JIT's memory is
  // emptied; the first two also captured into a graph and replayed.
  const Variant bias_2d = Variant::from_strings("score + bias[q_idx, kv_idx]", "true",
                                                {{"bias", "bf16", {"Q_LEN", "KV_LEN"}}}, {}, "b2");
  struct Pick {
    Variant v;
    GpuCase c;
  };
  const auto shape = [](DType dt, int64_t B, int64_t Hq, int64_t Hkv, int64_t Lq, int64_t Lkv,
                        int64_t D) {
    GpuCase c;
    c.dtype = dt, c.B = B, c.Hq = Hq, c.Hkv = Hkv, c.Lq = Lq, c.Lkv = Lkv, c.D = D;
    c.prepare = true;
    return c;
  };
  std::vector<Pick> picks = {
      {Variant::from_catalogue("noop"), shape(DType::BF16, 1, 4, 2, 700, 2000, 128)},
      {Variant::from_catalogue("causal"), shape(DType::BF16, 2, 16, 4, 1000, 1000, 64)},
      {Variant::from_catalogue("alibi"), shape(DType::F16, 1, 8, 2, 300, 1100, 96)},
      {bias_2d, shape(DType::BF16, 1, 2, 1, 200, 1024, 64)},
      {Variant::from_catalogue("sliding_window"), shape(DType::BF16, 1, 4, 1, 130, 333, 32)},
      {Variant::from_catalogue("document"), shape(DType::BF16, 1, 2, 2, 500, 700, 256)},
  };
  picks[4].c.params["window"] = 40;
  for (size_t i = 0; i < picks.size(); ++i) {
    Pick& p = picks[i];
    p.c.graph = i < 2;
    INFO(p.v.name() << ": " << p.c.describe() << (p.c.graph ? " graph" : ""));
    const Accuracy a = run_case(p.v, p.c);
    INFO(a.summary());
    CHECK(a.pass);
  }
}

TEST_CASE("wide kv tiles match the reference, with and without a BlockMask", "[gpu]") {
  SKIP_WITHOUT_GPU();
  // Calls without a BlockMask take kv tiles of 176 / 112 / 80 keys at D 128 / 192 / 256 (D 128
  // beside the identity score_mod only: softcap there checks the fallback); over a BlockMask of
  // 128-key tiles D 192 / 256 take them too, a kernel tile straddling two BlockMask tiles whose
  // kinds its keys take one by one (KvStraddle): stripes of empty and full tiles, and of
  // partial ones (64-key stripes), a causal mask, a window, rows that see no key (output 0, LSE
  // -inf); a user's lists marking tiles full where mask_mod says nothing (noop: the reference is
  // the stripes). Lengths a key short of a tile, a key past one and past three, Q_LEN !=
  // KV_LEN, GQA, both dtypes, a score_mod (softcap: fewer of Q's chunks in registers); at
  // offsets too.
  const Variant none_below = Variant::from_strings("score", "kv_idx < q_idx - 150", {}, {}, "late");
  const Variant stripes = Variant::from_strings("score", "(q_idx // 128 + kv_idx // 128) % 3 != 1",
                                                {}, {}, "tile_stripes");
  const Variant halves =
      Variant::from_strings("score + 0.25 * float(kv_idx % 5)",
                            "(q_idx // 64 + kv_idx // 64) % 3 != 1", {}, {}, "half_stripes");
  const Variant noop = Variant::from_catalogue("noop"),
                window = Variant::from_catalogue("sliding_window");
  int i = 0;
  for (auto [d, n] : {std::pair{128, 176}, {192, 112}, {256, 80}})
    for (const Variant& v :
         {noop, Variant::from_catalogue("softcap"), Variant::from_catalogue("causal"), none_below,
          stripes, halves, window})
      for (bool block_mask : {false, true}) {
        if (block_mask && (d == 128 || v.mask_always_true())) continue;
        for (int64_t lkv : {n - 1, n + 1, 3 * n + 1}) {
          ++i;
          GpuCase c{i % 2 ? DType::BF16 : DType::F16,
                    1 + i % 2,
                    4,
                    2,
                    200 + 3 * n,
                    lkv,
                    d,
                    i % 3 == 0,
                    0,
                    block_mask,
                    {},
                    FwdKernel::Hopper};
          if (v.name() == window.name()) c.params["window"] = 100;
          INFO(v.name() << ": " << c.describe());
          const Accuracy a = run_case(v, c);
          INFO(a.summary());
          CHECK(a.pass);
          if (lkv == 3 * n + 1 && (block_mask || v.mask_always_true())) check_at_offsets(v, c);
        }
      }
  // noop over a user's lists of stripes' tiles (full ones only): straddled tiles are full and
  // empty, whatever mask_mod says.
  for (int64_t d : {192, 256}) check_stripes_lists(stripes, d, FwdKernel::Hopper);
}

TEST_CASE("relative terms tabulated per tile match the reference", "[gpu]") {
  SKIP_WITHOUT_GPU();
  // score_mod's costly terms in kv_idx - q_idx alone (dsl/emit_cuda.cpp): the Hopper kernel's
  // loader warps fill a table per consumer and kv tile in the staged stages, 64 + 128 - 1 entries
  // (64 + 64 - 1 above D 128); the portable kernel's threads one per CTA (128 + 64 - 1; 64 + 32 - 1
  // at D 256), two tables in flight. A gathered
  // table with GQA, T5's buckets (exact log2 under fast math), two integer terms (one table under
  // fast math, as the two subtracted ones), a decay with a causal mask's partial tiles, a term
  // beside a column load (the Hopper kernel reads both from its loads ahead; the portable one
  // computes that score_mod per score); odd lengths, Q_LEN != KV_LEN, queries at an offset.
  const std::vector<CaptureSpec> caps{{"rel", "float32", {"H", "511"}},
                                      {"kvb", "float32", {"H", "KV_LEN"}}};
  const Variant rel_table = Variant::from_strings(
      "score + rel[h, clamp(kv_idx - q_idx, -255, 255) + 255]", "true", caps, {}, "rel_table");
  const Variant int_terms = Variant::from_strings(
      "score + where((q_idx - kv_idx) % 7 == 0, 0.5, 0.0) - float(abs(q_idx - kv_idx) // 64) * 0.01",
      "true", {}, {}, "int_terms");
  const Variant decay = Variant::from_strings("score - 0.5 * sqrt(float(abs(kv_idx - q_idx)))",
                                              "q_idx >= kv_idx", {}, {}, "decay");
  // Fast math adds a sum's terms first (one table): int_terms' a - b, and here b + c subtracted.
  const Variant minus_terms = Variant::from_strings(
      "score - sqrt(float(abs(kv_idx - q_idx))) * 0.5 - float(abs(q_idx - kv_idx) // 64)", "true",
      {}, {}, "minus_terms");
  const Variant with_cols = Variant::from_strings(
      "score + kvb[h, kv_idx] - rel[h, clamp(q_idx - kv_idx, -255, 255) + 255]", "true", caps, {},
      "rel_with_cols");
  const Variant t5 = Variant::from_catalogue("t5_bias");
  int i = 0;
  for (const Variant* v : {&rel_table, &t5, &int_terms, &decay, &minus_terms, &with_cols})
    for (int64_t d : {64, 128, 256})
      for (FwdKernel kernel : kernels_for(d)) {
        ++i;
        check_at_offsets(*v, {i % 2 ? DType::BF16 : DType::F16, 2, 4, i % 3 ? 2 : 4, 333, 517, d,
                              false, 0, true, {}, kernel});
      }
}

TEST_CASE("192-row q tiles over two BlockMask rows match the reference", "[gpu]") {
  SKIP_WITHOUT_GPU();
  // At D 64 the Hopper kernel's q tiles hold 192 rows, its consumers' 64-row slices lying in two
  // BlockMask rows of 128: its producer merges both rows' tiles, and a tile of one row only is
  // empty for the other's consumers. Masks whose tiles differ from row to row (full and empty
  // tiles only; partial ones), odd lengths (consumers past Q_LEN), GQA (KV_LEN above 1536: 192-row
  // tiles; at 448 the 128-row ones short masked sequences take); and a user's BlockMask that
  // leaves out tiles mask_mod keeps: those count as masked, as FlexAttention has it. A consumer
  // whose BlockMask row has no tile left skips the union's later ones (kSkipDone): `early_end`'s
  // even rows end after two tiles, the odd ones run to KV_LEN. Beside a score_mod without per-key
  // loads (`halves`, `early_end`) the 192-row build runs the item's first tile in the mainloop;
  // beside the identity (`stripes`, `causal`) it peels it. `rel_early_end`: a relative term's
  // tables (filled by the loaders) where consumers skip.
  const Variant early_end =
      Variant::from_strings("score - 0.125 * float(kv_idx % 7)",
                            "q_idx // 128 % 2 == 1 || kv_idx < 200", {}, {}, "early_end");
  const Variant rel_early_end =
      Variant::from_strings("score - 0.03 * float(abs(kv_idx - q_idx) % 13)",
                            "q_idx // 128 % 2 == 1 || kv_idx < 200", {}, {}, "rel_early_end");
  const Variant stripes = Variant::from_strings(
      "score", "(q_idx // 128 + kv_idx // 128) % 3 != 1", {}, {}, "tile_stripes");
  const Variant halves = Variant::from_strings(
      "score + 0.25 * float(kv_idx % 5)", "(q_idx // 64 + kv_idx // 64) % 3 != 1", {}, {},
      "half_tile_stripes");
  const Variant causal = Variant::from_catalogue("causal");
  int i = 0;
  for (const Variant* v : {&stripes, &halves, &causal, &early_end, &rel_early_end})
    for (auto [lq, lkv] : {std::pair<int64_t, int64_t>{1000, 1700}, {193, 1600}, {448, 448}})
      for (FwdKernel kernel : kernels_for(64)) {
        GpuCase c{++i % 2 ? DType::BF16 : DType::F16, 2, 4, 2, lq, lkv, 64,
                  false, 0, true, {}, kernel};
        INFO(v->name() << ": " << c.describe());
        const Accuracy a = run_case(*v, c);
        INFO(a.summary());
        CHECK(a.pass);
      }
  // noop with a user's lists (full tiles only) of stripes' tiles: the reference is stripes.
  for (FwdKernel kernel : kernels_for(64)) check_stripes_lists(stripes, 64, kernel);
}

TEST_CASE("v's head dim apart from q's and k's (MLA's 192 / 128) matches the reference", "[gpu]") {
  SKIP_WITHOUT_GPU();
  // O takes v's head dim: staged over Q's shared memory (the wider of the two), tiles for the
  // wider; odd lengths, GQA, padded [B, S, H, D] layouts, captures, fully masked rows.
  const char* names[] = {"causal", "softcap", "alibi", "document"};
  const std::pair<int64_t, int64_t> dims[] = {{192, 128}, {128, 192}, {64, 256}, {256, 64}, {96, 128}};
  for (size_t di = 0; di < std::size(dims); ++di)
    for (FwdKernel kernel : kernels_for(dims[di].first, dims[di].second))
      for (size_t i = 0; i < std::size(names); ++i) {
        GpuCase c{i % 2 ? DType::F16 : DType::BF16, 2, 4, i % 2 ? 1 : 2, 300, 517,
                  dims[di].first, (i + di) % 2 == 0, (i + di) % 3 ? 0 : 8, true, {}, kernel};
        c.Dv = dims[di].second;
        INFO(names[i] << ": " << c.describe());
        const Accuracy a = run_case(Variant::from_catalogue(names[i]), c);
        INFO(a.summary());
        CHECK(a.pass);
      }
  const Variant none = Variant::from_strings("where(q_idx % 5 == 1, -inf, score)", "q_idx % 3 != 0");
  for (FwdKernel kernel : kernels_for(192, 128)) {
    GpuCase c{DType::BF16, 1, 2, 2, 200, 129, 192, false, 0, true, {}, kernel};
    c.Dv = 128;
    INFO(c.describe());
    const Accuracy a = run_case(none, c, 1 << 20);
    INFO(a.summary());
    CHECK(a.pass);
    CHECK(a.masked_rows > 0);
  }
}

TEST_CASE("chunked prefill: queries at q_offset match the reference and the full prefill's rows",
          "[gpu]") {
  SKIP_WITHOUT_GPU();
  // A chunk of Q_LEN queries at positions [q_offset, q_offset + Q_LEN) against the keys up to
  // (and past) its end, with a BlockMask built at the same offset: mods see positions.
  const char* names[] = {"causal", "sliding_window", "alibi", "document", "causal_bottom_right",
                         "prefix_lm"};
  const int64_t offsets[] = {37, 128, 1000};
  for (FwdKernel kernel : kernels_for(128))
    for (size_t i = 0; i < std::size(names); ++i) {
      GpuCase c{i % 2 ? DType::F16 : DType::BF16, 2, 4, 2, 200, 0, i % 3 ? 128 : 64, false, 0,
                true, {}, kernel};
      c.q_offset = offsets[i % 3];
      c.Lkv = c.q_offset + c.Lq + (i % 2 ? 0 : 77);
      if (std::string(names[i]) == "sliding_window") c.params["window"] = 150;
      if (std::string(names[i]) == "prefix_lm") c.params["prefix"] = 90;
      if (kernel == FwdKernel::Hopper && c.D == 64) c.D = 128;
      INFO(names[i] << ": " << c.describe() << " q_offset " << c.q_offset);
      const Accuracy a = run_case(Variant::from_catalogue(names[i]), c);
      INFO(a.summary());
      CHECK(a.pass);
    }

  // At a tile-aligned offset the chunk's rows are the full prefill's, bit for bit (same tiles,
  // same order); a BlockMask built for another offset is refused.
  const Variant causal = Variant::from_catalogue("causal");
  const int64_t L = 700, first = 256, n = 300, D = 128;
  const Problem full(1, 4, 2, L, L, D, DType::BF16);
  for (FwdKernel kernel : kernels_for(D)) {
    auto bits = [](const std::vector<float>& x) {
      std::vector<uint16_t> b(x.size());
      for (size_t i = 0; i < x.size(); ++i) b[i] = float_to_bf16(x[i]);
      return flexc::DeviceBuffer::from<uint16_t>(b);
    };
    const flexc::DeviceBuffer q = bits(full.q), k = bits(full.k), v = bits(full.v);
    flexc::DeviceBuffer out_full(4 * L * D * 2), out_chunk(4 * n * D * 2);
    const TensorView kv{k.get(), DType::BF16, {1, 2, L, D}, {}}, vv{v.get(), DType::BF16, {1, 2, L, D}, {}};
    AttentionOptions o;
    o.kernel = kernel;
    const BlockMask bm_full = create_block_mask(causal, 1, 4, L, L);
    o.block_mask = &bm_full;
    attention(TensorView{q.get(), DType::BF16, {1, 4, L, D}, {}}, kv, vv,
              TensorView{out_full.get(), DType::BF16, {1, 4, L, D}, {}}, causal, o);
    BlockMaskOptions bo;
    bo.q_offset = first;
    const BlockMask bm_chunk = create_block_mask(causal, 1, 4, n, L, bo);
    o.block_mask = &bm_chunk;
    o.q_offset = first;
    // q rows [first, first + n) of each head: a strided view of the full q.
    const TensorView q_chunk{static_cast<uint16_t*>(q.get()) + first * D, DType::BF16, {1, 4, n, D},
                             {4 * L * D, L * D, D, 1}};
    const TensorView out_view{out_chunk.get(), DType::BF16, {1, 4, n, D}, {}};
    attention(q_chunk, kv, vv, out_view, causal, o);
    flexc::synchronize_device();
    const std::vector<uint16_t> a = out_full.to_vector<uint16_t>(4 * L * D);
    const std::vector<uint16_t> b = out_chunk.to_vector<uint16_t>(4 * n * D);
    int64_t differ = 0;
    for (int64_t h = 0; h < 4; ++h)
      for (int64_t i = 0; i < n * D; ++i) differ += a[(h * L + first) * D + i] != b[h * n * D + i];
    INFO(to_string(kernel));
    CHECK(differ == 0);
    o.q_offset = first + 1;
    CHECK_THROWS_WITH(attention(q_chunk, kv, vv, out_view, causal, o),
                      Contains("block_mask was built with q_offset 256; the call has 257"));
  }
}

TEST_CASE("a block of a longer sequence: queries and keys at their positions match the reference",
          "[gpu]") {
  SKIP_WITHOUT_GPU();
  // Context parallelism (ring attention's steps): queries [q_offset, + Q_LEN) against keys
  // [kv_offset, + KV_LEN) of a sequence whose lengths (unequal here) the mods see, with a
  // BlockMask built at the same positions: length-dependent masks (bottom-right causal),
  // captures indexed by position (document), relative biases (alibi), windows; blocks below,
  // across and above the diagonal, and at offsets 0 with the sequence's lengths alone.
  const char* names[] = {"causal", "sliding_window", "alibi", "document", "causal_bottom_right",
                         "prefix_lm"};
  const int64_t offsets[][2] = {{640, 128}, {700, 520}, {333, 410}, {0, 0}, {100, 700}};
  int64_t at = 0;
  for (FwdKernel kernel : kernels_for(128))
    for (size_t i = 0; i < std::size(names); ++i, ++at) {
      GpuCase c{i % 2 ? DType::F16 : DType::BF16, 2, 4, 2, 300, 250 + 37 * int64_t(i % 3),
                i % 3 ? 128 : 64, false, 0, true, {}, kernel};
      c.q_offset = offsets[at % 5][0], c.kv_offset = offsets[at % 5][1];
      c.seq_q_len = 1200, c.seq_kv_len = 1300;
      if (std::string(names[i]) == "sliding_window") c.params["window"] = 400;
      if (std::string(names[i]) == "prefix_lm") c.params["prefix"] = 300;
      INFO(names[i] << ": " << c.describe() << " q_offset " << c.q_offset << " kv_offset "
                    << c.kv_offset);
      const Accuracy a = run_case(Variant::from_catalogue(names[i]), c);
      INFO(a.summary());
      CHECK(a.pass);
    }
}

TEST_CASE("packed sequences (varlen) match the reference sequence by sequence", "[gpu]") {
  SKIP_WITHOUT_GPU();
  // Sequences of unequal lengths packed along the rows, with padded token strides (NaN in the
  // gaps): empty sequences of queries and of keys (rows 0 and LSE -inf), odd lengths, GQA. Each
  // sequence against the reference as a batch of its own: the mods see b = the sequence, its
  // positions from 0 and its lengths (causal_bottom_right reads them: no BlockMask there).
  const std::vector<int64_t> lq{300, 1, 0, 517, 129, 64}, lkv{250, 64, 17, 517, 1000, 0};
  // (Hq 16: enough work items, 480, for the Hopper kernel's persistent grid at these lengths,
  // which noop, causal, softcap, sliding_window and causal_bottom_right take.)
  const int64_t n = int64_t(lq.size()), Hq = 16, Hkv = 4, pad = 8;
  const Variant bias_b = Variant::from_strings("score + bias[b]", "q_idx >= kv_idx",
                                               {{"bias", "float32", {"B"}}}, {}, "bias_b");
  const char* names[] = {
      "noop", "causal", "alibi", "softcap", "t5_bias", "sliding_window", "causal_bottom_right"};
  std::vector<Variant> variants;
  for (const char* name : names) variants.push_back(Variant::from_catalogue(name));
  variants.push_back(bias_b);
  std::vector<int32_t> cu_q{0}, cu_kv{0};
  for (int64_t i = 0; i < n; ++i)
    cu_q.push_back(cu_q.back() + int32_t(lq[i])), cu_kv.push_back(cu_kv.back() + int32_t(lkv[i]));
  const int64_t total_q = cu_q.back(), total_kv = cu_kv.back();
  const flexc::DeviceBuffer dcu_q = flexc::DeviceBuffer::from<int32_t>(cu_q);
  const flexc::DeviceBuffer dcu_kv = flexc::DeviceBuffer::from<int32_t>(cu_kv);
  size_t vi = 0;
  for (FwdKernel kernel : kernels_for(128))
    for (const Variant& v : variants) {
      const int64_t D = vi % 2 ? 64 : 128;
      const DType dtype = vi++ % 3 ? DType::BF16 : DType::F16;
      // Per sequence: random q, k, v ([1, H, L, D]), packed as [TOTAL, H, D + pad].
      std::vector<Problem> seqs;
      for (int64_t i = 0; i < n; ++i) seqs.emplace_back(1, Hq, Hkv, lq[i], lkv[i], D, dtype);
      const auto pack = [&](auto member, int64_t H, const std::vector<int32_t>& cu) {
        std::vector<uint16_t> bits(std::max<int64_t>(cu.back() * H * (D + pad), 8), 0xffff);
        for (int64_t i = 0; i < n; ++i) {
          const std::vector<float>& x = seqs[i].*member;
          const int64_t L = cu[i + 1] - cu[i];
          for (int64_t h = 0; h < H; ++h)
            for (int64_t t = 0; t < L; ++t)
              for (int64_t e = 0; e < D; ++e)
                bits[((cu[i] + t) * H + h) * (D + pad) + e] =
                    dtype == DType::BF16 ? float_to_bf16(x[(h * L + t) * D + e])
                                         : float_to_fp16(x[(h * L + t) * D + e]);
        }
        return flexc::DeviceBuffer::from<uint16_t>(bits);
      };
      const flexc::DeviceBuffer q = pack(&Problem::q, Hq, cu_q), k = pack(&Problem::k, Hkv, cu_kv),
                                vv = pack(&Problem::v, Hkv, cu_kv);
      flexc::DeviceBuffer out(std::max<int64_t>(total_q * Hq * D * 2, 16)),
          lse(std::max<int64_t>(total_q * Hq * 4, 16));
      out.fill(0xff), lse.fill(0xff);
      const auto view = [&](const flexc::DeviceBuffer& b, int64_t T, int64_t H) {
        return TensorView{b.get(), dtype, {T, H, D}, {H * (D + pad), D + pad, 1}};
      };
      AttentionOptions o;
      o.kernel = kernel;
      o.packed = PackedSequences{{dcu_q.get(), DType::I32, {n + 1}, {}},
                                 {dcu_kv.get(), DType::I32, {n + 1}, {}},
                                 517,
                                 1000,
                                 true};
      o.lse = TensorView{lse.get(), DType::F32, {Hq, total_q}, {}};
      std::vector<npy::Array> caps;
      std::vector<flexc::DeviceBuffer> dcaps;
      for (const CaptureSpec& cs : v.captures()) {
        caps.push_back(random_capture(cs, n, Hq, 517, 1000));
        dcaps.push_back(flexc::DeviceBuffer::from<std::byte>(caps.back().bytes));
        o.captures[cs.name] =
            TensorView{dcaps.back().get(), caps.back().dtype, caps.back().shape, {}};
      }
      if (std::string(v.name()) == "sliding_window") o.params["window"] = 100;
      std::optional<BlockMask> bm;
      if (!v.mask_always_true() && std::string(v.name()) != "causal_bottom_right") {
        BlockMaskOptions bo;
        for (size_t c = 0; c < caps.size(); ++c)
          bo.captures[v.captures()[c].name] =
              CaptureData{caps[c].bytes.data(), dcaps[c].get(), caps[c].shape, {}};
        bo.params = o.params;
        bm = create_block_mask(v, n, Hq, 517, 1000, bo);
        o.block_mask = &*bm;
      }
      attention(view(q, total_q, Hq), view(k, total_kv, Hkv), view(vv, total_kv, Hkv),
                TensorView{out.get(), dtype, {total_q, Hq, D}, {}}, v, o);
      flexc::synchronize_device();
      const std::vector<uint16_t> bits = out.to_vector<uint16_t>(total_q * Hq * D);
      const std::vector<float> lses = lse.to_vector<float>(total_q * Hq);
      for (int64_t i = 0; i < n; ++i) {
        if (lq[i] == 0) continue;
        ReferenceProblem ref = seqs[i].reference();
        ref.params = o.params;
        if (lq[i] * Hq > 256) {  // a sample of the rows
          std::uniform_int_distribution<int64_t> pick(0, lq[i] * Hq - 1);
          for (int r = 0; r < 256; ++r) ref.rows.push_back(pick(rng()));
        }
        // Captures with a B dim: this sequence's entry, as a batch of one.
        std::vector<npy::Array> mine = caps;
        for (size_t c = 0; c < caps.size(); ++c) {
          if (v.captures()[c].dims.empty() || v.captures()[c].dims[0] != "B") continue;
          const size_t row = caps[c].bytes.size() / size_t(n);
          mine[c].shape[0] = 1;
          mine[c].bytes.assign(caps[c].bytes.begin() + i * row,
                               caps[c].bytes.begin() + (i + 1) * row);
        }
        for (size_t c = 0; c < caps.size(); ++c)
          ref.captures[v.captures()[c].name] = mine[c].view();
        const ReferenceResult r = reference_attention(v, ref);
        std::vector<float> got, got_lse;
        for (int64_t row : r.rows) {
          const int64_t h = row / lq[i], t = cu_q[i] + row % lq[i];
          for (int64_t e = 0; e < D; ++e) {
            const uint16_t x = bits[(t * Hq + h) * D + e];
            got.push_back(dtype == DType::BF16 ? bf16_to_float(x) : fp16_to_float(x));
          }
          got_lse.push_back(lses[h * total_q + t]);
        }
        const Accuracy a = check_accuracy(r, got, got_lse);
        INFO(v.name() << " " << to_string(kernel) << " " << dtype_name(dtype) << " D " << D
                      << ": sequence " << i << " (" << lq[i] << " x " << lkv[i] << ") "
                      << a.summary());
        CHECK(a.pass);
      }
    }

  // Offsets past the rows never read or write out of bounds: the last sequence's keys past k's
  // rows make its rows and LSEs NaN, its queries past q's rows skip it (its rows and LSEs keep
  // the poison, a finite pattern); the other sequences' rows are the mean of zeros. 16-bit and
  // float32 outputs. With check_device_args, an error names the argument.
  const int64_t D = 128;
  flexc::DeviceBuffer zq(total_q * Hq * D * 2), zkv(total_kv * Hkv * D * 2);
  zq.fill(0), zkv.fill(0);
  const TensorView q{zq.get(), DType::BF16, {total_q, Hq, D}, {}},
      kv{zkv.get(), DType::BF16, {total_kv, Hkv, D}, {}};
  flexc::DeviceBuffer out(total_q * Hq * D * 4), lse(total_q * Hq * 4);
  const int64_t last = cu_q[n - 1];  // the last sequence's first row
  for (FwdKernel kernel : kernels_for(D))
    for (bool f32 : {false, true})
      for (bool bad_q : {false, true}) {
        std::vector<int32_t> bad_cu = bad_q ? cu_q : cu_kv;
        bad_cu.back() += 5;
        const flexc::DeviceBuffer dbad = flexc::DeviceBuffer::from<int32_t>(bad_cu);
        AttentionOptions o;
        o.kernel = kernel;
        o.packed = PackedSequences{{(bad_q ? dbad : dcu_q).get(), DType::I32, {n + 1}, {}},
                                   {(bad_q ? dcu_kv : dbad).get(), DType::I32, {n + 1}, {}},
                                   517,
                                   1000};
        o.lse = TensorView{lse.get(), DType::F32, {Hq, total_q}, {}};
        out.fill(0x7b), lse.fill(0x7b);  // finite: 0x7b7b in bf16, 0x7b7b7b7b in float32
        const TensorView out_view{out.get(), f32 ? DType::F32 : DType::BF16, {total_q, Hq, D}, {}};
        attention(q, kv, kv, out_view, Variant::from_catalogue("noop"), o);
        flexc::synchronize_device();
        // The outputs as floats, the poison as NaN-free `poison`.
        std::vector<float> x;
        float poison;
        if (f32) {
          x = out.to_vector<float>(total_q * Hq * D);
          std::memcpy(&poison, "\x7b\x7b\x7b\x7b", 4);
        } else {
          for (uint16_t bits : out.to_vector<uint16_t>(total_q * Hq * D))
            x.push_back(bf16_to_float(bits));
          poison = bf16_to_float(0x7b7b);
        }
        const std::vector<float> l = lse.to_vector<float>(total_q * Hq);
        INFO(to_string(kernel) << (f32 ? " float32 out" : " bf16 out")
                               << (bad_q ? ", bad cu_seqlens_q" : ", bad cu_seqlens_kv"));
        CHECK(std::all_of(x.begin(), x.begin() + last * Hq * D, [](float y) { return y == 0; }));
        const auto bad_row = [&](float y) { return bad_q ? y == poison : std::isnan(y); };
        CHECK(std::all_of(x.begin() + last * Hq * D, x.end(), bad_row));
        float lse_poison;
        std::memcpy(&lse_poison, "\x7b\x7b\x7b\x7b", 4);
        for (int64_t h = 0; h < Hq; ++h)
          for (int64_t t = last; t < total_q; ++t)
            CHECK((bad_q ? l[h * total_q + t] == lse_poison : std::isnan(l[h * total_q + t])));
        o.packed->check_device_args = true;
        CHECK_THROWS_WITH(attention(q, kv, kv, out_view, Variant::from_catalogue("noop"), o),
                          Contains(fmt::format("packed.cu_seqlens_{} must run from 0 to {} (the "
                                               "packed rows); it runs from 0 to {}",
                                               bad_q ? "q" : "kv", bad_q ? total_q : total_kv,
                                               (bad_q ? total_q : total_kv) + 5)));
      }
}

TEST_CASE("a float32 out is the output unrounded", "[gpu]") {
  SKIP_WITHOUT_GPU();
  // Ring attention merges its blocks' outputs in float32 and rounds once. The same inputs into a
  // 16-bit out and a float32 one: the float32 one must be nearer float64 (its error lacks the
  // output's rounding), and both pass the rule; padded rows, both kernels and dtypes.
  for (int64_t d : {64, 128})
    for (FwdKernel kernel : kernels_for(d)) {
      GpuCase c{d == 64 ? DType::F16 : DType::BF16, 2, 4, 2, 333, 517, d, false, 8, true, {},
                kernel};
      const Problem p(c.B, c.Hq, c.Hkv, c.Lq, c.Lkv, c.D, c.dtype);
      const Variant v = Variant::from_catalogue(d == 64 ? "alibi" : "causal");
      const std::mt19937_64 rows = rng();  // the same sampled rows both ways
      const Accuracy a16 = run_case(v, c, 256, &p);
      rng() = rows;
      c.out_f32 = true;
      const Accuracy a32 = run_case(v, c, 256, &p);
      INFO(c.describe() << "\n  16-bit  " << a16.summary() << "\n  float32 " << a32.summary());
      CHECK(a16.pass);
      CHECK(a32.pass);
      CHECK(a32.out_rmse < 0.8 * a16.out_rmse);
      CHECK(a32.lse_rmse <= 1.1 * a16.lse_rmse + 1e-7);
    }
}

TEST_CASE("accumulate merges calls over parts of the keys into one softmax", "[gpu]") {
  SKIP_WITHOUT_GPU();
  // Ring attention's forward: each block merges itself into float32 accumulators and their LSE
  // (0 and -inf at first). Keys [0, 256) then [256, 517) of the same queries, each call at its
  // positions (with its BlockMask there), must equal attention over all 517 keys: under a causal
  // mask the queries before 256 see nothing in the second part (it must leave them as they are).
  const int64_t split = 256;
  int at = 0;
  for (int64_t d : {64, 128})
    for (FwdKernel kernel : kernels_for(d))
      for (const char* name : {"causal", "softcap"}) {
        const DType dt = at++ % 2 ? DType::F16 : DType::BF16;
        const int64_t B = 2, Hq = 4, Hkv = 2, Lq = 300, Lkv = 517;
        const Problem p(B, Hq, Hkv, Lq, Lkv, d, dt);
        const Variant v = Variant::from_catalogue(name);
        const flexc::DeviceBuffer dq = flexc::testing::upload16(dt, p.q);
        flexc::DeviceBuffer acc(size_t(B * Hq * Lq * d) * 4), lse(size_t(B * Hq * Lq) * 4);
        acc.fill(0);
        const std::vector<float> none(size_t(B * Hq * Lq), -std::numeric_limits<float>::infinity());
        lse.upload(none.data(), none.size() * 4);
        std::vector<flexc::DeviceBuffer> kept;
        std::vector<BlockMask> masks;
        masks.reserve(2);
        for (const auto& [k0, n] : {std::pair<int64_t, int64_t>{0, split}, {split, Lkv - split}}) {
          kept.push_back(flexc::testing::upload16(dt, rows_of(p.k, B * Hkv, Lkv, d, k0, n)));
          kept.push_back(flexc::testing::upload16(dt, rows_of(p.v, B * Hkv, Lkv, d, k0, n)));
          AttentionOptions o;
          o.accumulate = true;
          o.kernel = kernel;
          o.lse = TensorView{lse.get(), DType::F32, {B, Hq, Lq}, {}};
          o.kv_offset = k0, o.seq_q_len = Lq, o.seq_kv_len = Lkv;
          if (!v.mask_always_true()) {
            BlockMaskOptions bmo;
            bmo.kv_offset = k0, bmo.seq_q_len = Lq, bmo.seq_kv_len = Lkv;
            masks.push_back(create_block_mask(v, B, Hq, Lq, n, bmo));
            o.block_mask = &masks.back();
          }
          attention(TensorView{dq.get(), dt, {B, Hq, Lq, d}, {}},
                    TensorView{kept[kept.size() - 2].get(), dt, {B, Hkv, n, d}, {}},
                    TensorView{kept.back().get(), dt, {B, Hkv, n, d}, {}},
                    TensorView{acc.get(), DType::F32, {B, Hq, Lq, d}, {}}, v, o);
        }
        flexc::synchronize_device();
        const std::vector<float> out = acc.to_vector<float>(size_t(B * Hq * Lq * d)),
                                 got_lse = lse.to_vector<float>(size_t(B * Hq * Lq));
        ReferenceProblem rp = p.reference();
        const ReferenceResult r = reference_attention(v, rp);
        const Accuracy a = check_accuracy(r, out, got_lse);
        INFO(name << " " << dtype_name(dt) << " D " << d << " " << to_string(kernel) << ": "
                  << a.summary());
        CHECK(a.pass);
        // Unrounded: nearer float64 than the reference, which rounds the output once.
        CHECK(a.out_rmse < a.out_ref_rmse);
      }
}

TEST_CASE("row terms added to the LSE instead of every score match the reference", "[gpu]") {
  SKIP_WITHOUT_GPU();
  // Fast precision: the forward kernels compute score_mod without its terms of q_idx alone (and
  // without a positive constant factor, in the exponent instead) and add them to each row's LSE. A
  // per-query bias (the scores then the identity); a subtracted, scaled one beside a per-key term,
  // rows whose term is -inf (no key: 0 and -inf) and rows shifted by thousands (which rounded every
  // score when added to it); no score at all (a uniform softmax). At positions, and checked against
  // exact precision's error too.
  const std::vector<CaptureSpec> caps{{"qb", "float32", {"H", "Q_LEN"}},
                                      {"kvb", "float32", {"KV_LEN"}}};
  const Variant q_bias = Variant::from_strings("score + qb[h, q_idx]", "true", caps, {}, "q_bias");
  const Variant mixed = Variant::from_strings(
      "score * 0.5 - qb[h, q_idx] * 2.0 + kvb[kv_idx] + "
      "where(q_idx % 29 == 3, log(0.0), float(q_idx % 7) * 1000.0)",
      "kv_idx <= q_idx + 40", caps, {}, "mixed");
  const Variant rows_only =
      Variant::from_strings("qb[h, q_idx] * 3.0", "kv_idx <= q_idx", caps, {}, "rows_only");
  // Units: a positive constant factor of the rest scales the exponent instead of every score.
  const Variant capped = Variant::from_strings("30.0 * tanh(score / 30.0) + qb[h, q_idx]",
                                               "kv_idx <= q_idx + 40", caps, {}, "capped");
  const Variant temperature = Variant::from_strings("score * 0.5", "true", {}, {}, "temperature");
  for (const Variant* v : {&q_bias, &mixed, &rows_only, &capped, &temperature})
    for (int64_t d : {64, 128})
      for (FwdKernel kernel : kernels_for(d)) {
        REQUIRE(v->precision() == Precision::Fast);
        GpuCase c{
            d == 64 ? DType::BF16 : DType::F16, 2, 4, 2, 203, 333, d, false, 0, true, {}, kernel};
        check_at_offsets(*v, c);
        c.q_offset = c.kv_offset = c.seq_q_len = c.seq_kv_len = 0;
        const Problem p(c.B, c.Hq, c.Hkv, c.Lq, c.Lkv, c.D, c.dtype);
        std::vector<npy::Array> cv;
        for (const CaptureSpec& cs : v->captures())
          cv.push_back(random_capture(cs, c.B, c.Hq, c.Lq, c.Lkv));
        const Variant exact = v->with_precision(Precision::Exact);
        const Accuracy a_fast = run_case(*v, c, 4096, &p, &cv),
                       a_exact = run_case(exact, c, 4096, &p, &cv);
        INFO(v->name() << ": " << c.describe() << "\n  fast  " << a_fast.summary() << "\n  exact "
                       << a_exact.summary());
        CHECK(a_fast.pass);
        CHECK(a_fast.out_rmse <= 1.1 * a_exact.out_rmse + 1e-7);
        CHECK(a_fast.lse_rmse <= 1.1 * a_exact.lse_rmse + 1e-6);
      }
}

namespace {

// One score_mod in fast precision and in `other` on the same inputs, D 64 on the portable kernel
// and D 128 on the Hopper one where there is one (B * Hq * Q_LEN <= 256: every row is checked, the
// same rows both ways); `check` judges the two accuracies.
template <class Check>
void compare_precisions(const char* name, const char* mod, Precision other, Check check) {
  const Variant fast = Variant::from_strings(mod, "kv_idx <= q_idx + 40", {}, {}, name);
  REQUIRE(fast.precision() == Precision::Fast);
  const Variant v = fast.with_precision(other);
  for (int64_t d : {64, 128}) {
    const std::vector<FwdKernel> k = kernels_for(d);
    GpuCase c{d == 64 ? DType::F16 : DType::BF16, 1, 2, 1, 128, 301, d, false, 0, true, {},
              d == 64 ? k.front() : k.back()};
    const Problem p(c.B, c.Hq, c.Hkv, c.Lq, c.Lkv, c.D, c.dtype);
    const Accuracy a_fast = run_case(fast, c, 256, &p), a_other = run_case(v, c, 256, &p);
    INFO(name << ": " << c.describe() << "\n  fast   " << a_fast.summary() << "\n  "
              << to_string(other) << " " << a_other.summary());
    check(a_fast, a_other);
  }
}

// Fast must pass the tolerance rule, and its error against float64 stay within 1.1x of exact's
// (the product bar is 1.1x FlexAttention's, whose error is exact's or more).
void check_precisions(const char* name, const char* mod) {
  compare_precisions(name, mod, Precision::Exact, [](const Accuracy& fast, const Accuracy& exact) {
    CHECK(fast.pass);
    CHECK(exact.pass);
    CHECK(fast.out_rmse <= 1.1 * exact.out_rmse + 1e-7);
    CHECK(fast.lse_rmse <= 1.1 * exact.lse_rmse + 1e-6);
  });
}

// Precision::Approx: tanh on tanh.approx passes the rule against a reference whose tanh is
// rounded to 11 bits, and errs more than fast (which shows the approximate instruction ran).
void check_approx(const char* name, const char* mod) {
  compare_precisions(name, mod, Precision::Approx,
                     [](const Accuracy& fast, const Accuracy& approx) {
                       CHECK(approx.pass);
                       CHECK(approx.lse_rmse > 2 * fast.lse_rmse);
                     });
}

}  // namespace

TEST_CASE("approx float math: tanh.approx against a reference with its error", "[gpu]") {
  SKIP_WITHOUT_GPU();
  check_approx("softcap", "30.0 * tanh(score / 30.0)");
  check_approx("tanh_gate", "4.0 * tanh(score)");
}

// One score_mod per approximate instruction (docs/dsl.md, "Precision"), in test cases of two so
// that tools/gpu/suite.sh compiles them in parallel.
TEST_CASE("fast and exact float math against float64: tanh, sigmoid", "[gpu]") {
  SKIP_WITHOUT_GPU();
  check_precisions("softcap", "30.0 * tanh(score / 30.0)");
  check_precisions("tanh_gate", "4.0 * tanh(score)");  // tanh's curved range, not its linear one
  check_precisions("silu", "score * sigmoid(score)");
}

TEST_CASE("fast and exact float math against float64: log, sqrt", "[gpu]") {
  SKIP_WITHOUT_GPU();
  check_precisions("log_distance", "score - log(1.0 + abs(float(q_idx - kv_idx)))");
  check_precisions("sqrt_distance", "score - 0.25 * sqrt(abs(float(q_idx - kv_idx)))");
  // Two relative terms: one table in fast math, two in exact (whose launch must size both).
  const char* two_terms =
      "score + where((q_idx - kv_idx) % 7 == 0, 0.5, 0.0) - float(abs(q_idx - kv_idx) // 64) * "
      "0.01";
  check_precisions("two_terms", two_terms);
  // And exact on every kernel at D 64 and 128: the Hopper kernel's loaders fill both tables for
  // each of its consumers (three at D 64).
  const Variant exact = Variant::from_strings(two_terms, "true", {}, {}, "two_terms")
                            .with_precision(Precision::Exact);
  for (int64_t d : {64, 128})
    for (FwdKernel kernel : kernels_for(d)) {
      const GpuCase c{DType::BF16, 2, 4, 2, 457, 1031, d, false, 0, true, {}, kernel};
      const Accuracy a = run_case(exact, c);
      INFO(c.describe() << ": " << a.summary());
      CHECK(a.pass);
    }
}

TEST_CASE("fast and exact float math against float64: rsqrt, sin, cos", "[gpu]") {
  SKIP_WITHOUT_GPU();
  check_precisions("inv_sqrt", "score * rsqrt(1.0 + score * score / 64.0)");
  check_precisions("rotary_bias",
                   "score + 0.5 * cos(0.05 * (q_idx - kv_idx)) - 0.25 * sin(0.01 * kv_idx)");
}

TEST_CASE("fast and exact float math against float64: exp, exp2, log2 buckets", "[gpu]") {
  SKIP_WITHOUT_GPU();
  check_precisions("exp_gate", "score * exp(-abs(score) / 8.0) + exp2(-0.01 * abs(q_idx - kv_idx))");
  check_precisions("log2_bucket",
                   "score + 0.1 * float(min(int(4.0 * log2(1.0 + abs(q_idx - kv_idx))), 20))");
}
