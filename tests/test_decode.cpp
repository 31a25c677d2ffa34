// flexc::decode: the reference's decode positions, argument errors, the split rule, the kernel
// building for every variant, and ([gpu]) the kernel against the float64 reference over the
// catalogue, ragged lengths, GQA, contiguous and paged caches and forced split counts.
#include <fmt/format.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>

#include "attention/attention_kernel.h"
#include "flexc/attention.h"
#include "flexc/decode.h"
#include "flexc/device.h"
#include "flexc/error.h"
#include "flexc/reference.h"
#include "jit/jit.h"
#include "test_graph.h"
#include "test_tensors.h"

using namespace flexc;
using namespace flexc::testing;
using Catch::Matchers::Contains;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

#define SKIP_WITHOUT_GPU()       \
  if (!flexc::gpu_available()) { \
    WARN("no GPU: skipped");     \
    return;                      \
  }

// A decode problem on the host: q [B, Hq, Q_LEN, D], the cache as contiguous [B, Hkv, CAP, D]
// values, per-sequence lengths and optional query offsets.
struct DecodeProblem {
  DType dtype = DType::BF16;
  int64_t B = 1, Hq = 1, Hkv = 1, Lq = 1, cap = 1, D = 64;
  std::vector<int64_t> kv_lens, q_offsets;
  std::vector<float> q, k, v;

  void fill() {
    q = normal(B * Hq * Lq * D, dtype);
    k = normal(B * Hkv * cap * D, dtype);
    v = normal(B * Hkv * cap * D, dtype);
  }
  ReferenceProblem reference() const {
    ReferenceProblem p;
    p.q = q, p.k = k, p.v = v;
    p.batch = B, p.q_heads = Hq, p.kv_heads = Hkv, p.q_len = Lq, p.kv_len = cap, p.head_dim = D;
    p.dtype = dtype, p.kv_lens = kv_lens, p.q_offsets = q_offsets;
    return p;
  }
};

}  // namespace

TEST_CASE("the reference's decode rows are the prefill rows at the same positions", "[decode]") {
  // Sequence of 37 keys, queries its last 3 tokens: prefill with Q_LEN = KV_LEN = 37 computes
  // the same rows 34..36 (same hooks' q_idx, q_len, kv_len), exactly.
  for (const char* name : {"causal", "sliding_window", "alibi", "causal_bottom_right", "prefix_lm"}) {
    const Variant v = Variant::from_catalogue(name);
    DecodeProblem d;
    d.Hq = 4, d.Hkv = 2, d.Lq = 3, d.cap = 48, d.D = 32, d.kv_lens = {37};
    d.fill();
    ReferenceProblem dec = d.reference();
    std::vector<float> slopes = {0.5f, -0.25f, 0.125f, 1.f};
    if (std::string(name) == "alibi")
      dec.captures["slope"] = TensorView::contiguous(slopes.data(), DType::F32, {4});
    if (std::string(name) == "sliding_window") dec.params["window"] = 5;
    if (std::string(name) == "prefix_lm") dec.params["prefix"] = 35;
    const ReferenceResult r = reference_attention(v, dec);

    // The prefill: every position's query (those of the decode at 34..36), keys 0..36.
    ReferenceProblem pre = dec;
    pre.kv_lens.clear(), pre.q_offsets.clear();
    std::vector<float> q(4 * 37 * 32, 0.f), k(2 * 37 * 32), vv(2 * 37 * 32);
    for (int64_t h = 0; h < 4; ++h)
      for (int64_t i = 0; i < 3; ++i)
        std::copy_n(d.q.begin() + (h * 3 + i) * 32, 32, q.begin() + (h * 37 + 34 + i) * 32);
    for (int64_t h = 0; h < 2; ++h) {
      std::copy_n(d.k.begin() + h * 48 * 32, 37 * 32, k.begin() + h * 37 * 32);
      std::copy_n(d.v.begin() + h * 48 * 32, 37 * 32, vv.begin() + h * 37 * 32);
    }
    pre.q = q, pre.k = k, pre.v = vv, pre.q_len = 37, pre.kv_len = 37;
    for (int64_t h = 0; h < 4; ++h)
      for (int64_t i = 0; i < 3; ++i) pre.rows.push_back(h * 37 + 34 + i);
    const ReferenceResult p = reference_attention(v, pre);
    INFO(name);
    CHECK(r.gold_out == p.gold_out);
    CHECK(r.gold_lse == p.gold_lse);
    CHECK(r.ref_out == p.ref_out);
  }
}

TEST_CASE("the reference's decode: empty sequences, positions before 0, explicit offsets", "[decode]") {
  const Variant causal = Variant::from_catalogue("causal");
  DecodeProblem d;
  d.B = 3, d.Hq = 2, d.Hkv = 1, d.Lq = 4, d.cap = 16, d.D = 32;
  d.kv_lens = {0, 2, 16};  // 2 keys, 4 queries: queries 0 and 1 sit at -2, -1
  d.fill();
  ReferenceResult r = reference_attention(causal, d.reference());
  auto lse = [&](int64_t b, int64_t h, int64_t i) { return r.gold_lse[(b * 2 + h) * 4 + i]; };
  for (int64_t i = 0; i < 4; ++i) CHECK(lse(0, 0, i) == -kInf);
  CHECK(lse(1, 1, 0) == -kInf);
  CHECK(lse(1, 1, 1) == -kInf);
  CHECK(std::isfinite(lse(1, 1, 2)));
  // Query 2 of sequence 1 is at position 0 and sees key 0 only: its output is v[key 0].
  for (int64_t e = 0; e < 32; ++e)
    CHECK(r.gold_out[((1 * 2 + 0) * 4 + 2) * 32 + e] == Approx(d.v[(1 * 16 + 0) * 32 + e]));
  // Offsets: sequence 2's queries at 3..6 of its 16 keys see keys 0..pos under causal.
  d.q_offsets = {0, 0, 3};
  r = reference_attention(causal, d.reference());
  CHECK(std::isfinite(lse(0, 0, 0)) == false);
  CHECK(std::isfinite(lse(2, 0, 0)));
  d.kv_lens = {0, 2, 17};
  CHECK_THROWS_WITH(reference_attention(causal, d.reference()),
                    Contains("kv_lens value 17 is outside [0, KV_LEN = 16]"));
}

TEST_CASE("the split rule fills the GPU and stays at 1 when the batch does", "[decode]") {
  // 132 SMs, two CTAs each: 64 CTAs (B 8 x Hkv 8) get ~4 splits; 512 CTAs none.
  CHECK(decode_splits(8, 8, 1, 32768, 132) >= 3);
  CHECK(decode_splits(8, 8, 1, 32768, 132) * 64 <= 264 * 2);
  CHECK(decode_splits(64, 8, 1, 2048, 132) == 1);
  const int one = decode_splits(1, 8, 1, 131072, 132);
  CHECK(one >= 20);
  CHECK(one <= 64);
  // Never more splits than 64-key tiles.
  CHECK(decode_splits(1, 1, 1, 100, 132) <= 2);
  CHECK(decode_splits(1, 1, 1, 1, 132) == 1);
}

TEST_CASE("decode arguments are checked and named before any GPU work", "[decode]") {
  const bool prepare = GENERATE(false, true);  // prepare_decode checks the same
  INFO((prepare ? "prepare_decode" : "decode"));
  const Variant noop = Variant::from_catalogue("noop");
  alignas(16) static uint16_t mem[1 << 16];
  alignas(16) static int32_t ints[64];
  const auto bf = [&](std::vector<int64_t> shape, size_t offset = 0) {
    return TensorView{mem + offset, DType::BF16, std::move(shape), {}};
  };
  TensorView q = bf({2, 8, 1, 64}), out = bf({2, 8, 1, 64}, 1024);
  KvCache c;
  c.k = bf({2, 2, 64, 64}, 4096), c.v = bf({2, 2, 64, 64}, 4096 + 16384);
  c.kv_lens = TensorView{ints, DType::I32, {2}, {}};
  auto throws = [&](const KvCache& cache, const std::string& what, DecodeOptions o = {},
                    std::optional<TensorView> o_q = {}, std::optional<TensorView> o_out = {}) {
    const auto call = prepare ? prepare_decode : decode;
    CHECK_THROWS_WITH(call(o_q.value_or(q), cache, o_out.value_or(out), noop, o), Contains(what));
  };
  KvCache bad = c;
  bad.kv_lens = TensorView{ints, DType::F32, {2}, {}};
  throws(bad, "cache.kv_lens must be contiguous int32 [B] = [2]");
  bad = c, bad.kv_lens.shape = {3};
  throws(bad, "cache.kv_lens must be contiguous int32 [B] = [2]");
  bad = c, bad.q_offsets = TensorView{ints, DType::I32, {1}, {}};
  throws(bad, "cache.q_offsets must be contiguous int32 [B]");
  bad = c, bad.v = bf({2, 2, 32, 64}, 4096 + 16384);
  throws(bad, "cache.v must match cache.k");
  bad = c, bad.k = bf({2, 3, 64, 64}, 4096);
  throws(bad, "Hq % Hkv == 0");
  throws(c, "out must be [B, Hq, Q_LEN, Dv] = [2, 8, 1, 64]", {}, {}, bf({2, 8, 2, 64}, 1024));
  // Paged: the page size is the k's dim 2, a power of two; the table int32 [B, MAX_PAGES].
  KvCache paged = c;
  paged.k = bf({6, 2, 24, 64}, 4096), paged.v = bf({6, 2, 24, 64}, 4096 + 20000);
  paged.page_table = TensorView{ints + 8, DType::I32, {2, 4}, {}};
  throws(paged, "the page size (cache.k's dim 2) must be a power of two");
  paged.k = bf({6, 2, 16, 64}, 4096), paged.v = bf({6, 2, 16, 64}, 4096 + 20000);
  paged.page_table = TensorView{ints + 8, DType::I32, {1, 4}, {}};
  throws(paged, "cache.page_table must be int32 [B, MAX_PAGES] = [2, *]");
  paged.page_table = TensorView{ints + 8, DType::I32, {2, 4}, {1, 2}};
  throws(paged, "contiguous rows");
  // The contiguous cache needs B sequences.
  bad = c, bad.k = bf({3, 2, 64, 64}, 4096), bad.v = bf({3, 2, 64, 64}, 4096 + 30000);
  throws(bad, "a paged cache needs cache.page_table");
  DecodeOptions o;
  o.num_splits = 257;
  throws(c, "num_splits must be 0 (automatic) or 1 to 256", o);
  o = {}, o.max_kv_len = 65;
  throws(c, "max_kv_len must be 0 (the capacity) or 1 to 64", o);
  o = {}, o.scale = -1;
  throws(c, "scale must be finite and > 0", o);
  o = {}, o.lse = TensorView{ints, DType::F32, {2, 8}, {}};
  throws(c, "lse must be contiguous float32 [B, Hq, Q_LEN] = [2, 8, 1]", o);
  throws(c, "out overlaps q", {}, {}, bf({2, 8, 1, 64}, 0));
  // Captures resolve Q_LEN / KV_LEN to the capacity.
  const Variant doc = Variant::from_catalogue("document");
  o = {};
  o.captures["doc"] = TensorView{ints, DType::I32, {2, 63}, {}};
  CHECK_THROWS_WITH(decode(q, c, out, doc, o), Contains("capture 'doc'"));
}

TEST_CASE("the decode kernel builds for every variant, both row configurations", "[decode][catalogue]") {
  for (const std::string& name : Variant::catalogue_names()) {
    const Variant v = Variant::from_catalogue(name);
    for (auto [d, mt] : {std::pair{64, 1}, {128, 2}}) {
      INFO(name << " D " << d << " mt " << mt);
      const jit::Compiled c =
          jit::compile(v, jit::attention_decode_spec({"sm_90", d == 64 ? "fp16" : "bf16", d}, mt));
      CHECK(!c.cubin.empty());
    }
  }
}

// ---- the kernel against the reference ([gpu])

namespace {

enum class Layout { Contiguous, Paged16, Paged128, PagedNhd64, Paged4 };

struct DecodeCase {
  DecodeProblem p;
  Layout layout = Layout::Contiguous;
  int splits = 0;
  std::map<std::string, double, std::less<>> params;

  std::string describe() const {
    const char* layouts[] = {"contiguous", "paged 16", "paged 128", "paged NHD 64", "paged 4"};
    return fmt::format("{} B {} Hq {} Hkv {} Q_LEN {} D {} capacity {} kv_lens [{}] {} splits {}",
                       dtype_name(p.dtype), p.B, p.Hq, p.Hkv, p.Lq, p.D, p.cap,
                       fmt::join(p.kv_lens, ", "), layouts[int(layout)], splits);
  }
};

int64_t page_size(Layout l) {
  switch (l) {
    case Layout::Paged16: return 16;
    case Layout::Paged128: return 128;
    case Layout::PagedNhd64: return 64;
    case Layout::Paged4: return 4;  // smaller than a thread's run of rows: a lookup per row
    default: return 0;
  }
}

// The outputs of one decode call (out rows and LSE in [B, Hq, Q_LEN] order, floats).
struct DecodeRun {
  std::vector<float> out, lse;
};

// Runs flexc::decode on the case's cache in its layout (paged: a shuffled page table with spare
// pages; NHD: pages stored [page, slot, head, D] and passed as a permuted view), outputs
// poisoned. `bad_page`: one page index of sequence 0 out of range (the kernel must flag it).
DecodeRun run_decode(const Variant& v, const DecodeCase& c, const DecodeOptions& base,
                     bool bad_page = false) {
  const DecodeProblem& p = c.p;
  const int64_t ps = page_size(c.layout);
  const int64_t per_seq = ps ? (p.cap + ps - 1) / ps : 0;
  const int64_t pages = p.B * per_seq + 3;  // spare pages nobody uses
  std::vector<int32_t> order(pages);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng());
  std::vector<int32_t> table(p.B * per_seq);
  for (size_t i = 0; i < table.size(); ++i) table[i] = order[i];
  if (bad_page) table[0] = int32_t(pages + 5);
  const bool nhd = c.layout == Layout::PagedNhd64;
  // Device K / V bits in the layout, NaN where nothing belongs (gaps, spare pages).
  auto layout = [&](const std::vector<float>& x) {
    const int64_t n = ps ? pages * p.Hkv * ps * p.D : p.B * p.Hkv * p.cap * p.D;
    std::vector<uint16_t> bits(n, 0xffff);
    for (int64_t b = 0; b < p.B; ++b)
      for (int64_t h = 0; h < p.Hkv; ++h)
        for (int64_t j = 0; j < p.cap; ++j) {
          int64_t at = ((b * p.Hkv + h) * p.cap + j) * p.D;
          if (ps) {
            const int64_t page = order[b * per_seq + j / ps], slot = j % ps;
            at = nhd ? ((page * ps + slot) * p.Hkv + h) * p.D : ((page * p.Hkv + h) * ps + slot) * p.D;
          }
          for (int64_t e = 0; e < p.D; ++e) {
            const float f = x[((b * p.Hkv + h) * p.cap + j) * p.D + e];
            bits[at + e] = p.dtype == DType::BF16 ? float_to_bf16(f) : float_to_fp16(f);
          }
        }
    return bits;
  };
  auto upload = [](const auto& host) {
    flexc::DeviceBuffer b(std::max<size_t>(host.size() * sizeof(host[0]), 16));
    b.upload(host.data(), host.size() * sizeof(host[0]));
    return b;
  };
  std::vector<uint16_t> qbits(p.q.size());
  for (size_t i = 0; i < qbits.size(); ++i)
    qbits[i] = p.dtype == DType::BF16 ? float_to_bf16(p.q[i]) : float_to_fp16(p.q[i]);
  const flexc::DeviceBuffer dq = upload(qbits), dk = upload(layout(p.k)), dv = upload(layout(p.v));
  const std::vector<int32_t> lens(p.kv_lens.begin(), p.kv_lens.end());
  const std::vector<int32_t> offs(p.q_offsets.begin(), p.q_offsets.end());
  const flexc::DeviceBuffer dlens = upload(lens), doffs = upload(offs), dtable = upload(table);
  flexc::DeviceBuffer dout(std::max<size_t>(p.B * p.Hq * p.Lq * p.D * 2, 16));
  flexc::DeviceBuffer dlse(std::max<size_t>(p.B * p.Hq * p.Lq * 4, 16));
  dout.fill(0xff), dlse.fill(0xff);

  KvCache cache;
  if (ps) {
    // NHD memory [page, slot, head, D] seen as [page, head, slot, D].
    const std::vector<int64_t> st =
        nhd ? std::vector<int64_t>{ps * p.Hkv * p.D, p.D, p.Hkv * p.D, 1}
            : std::vector<int64_t>{p.Hkv * ps * p.D, ps * p.D, p.D, 1};
    cache.k = TensorView{dk.get(), p.dtype, {pages, p.Hkv, ps, p.D}, st};
    cache.v = TensorView{dv.get(), p.dtype, {pages, p.Hkv, ps, p.D}, st};
    cache.page_table = TensorView{dtable.get(), DType::I32, {p.B, per_seq}, {}};
  } else {
    cache.k = TensorView{dk.get(), p.dtype, {p.B, p.Hkv, p.cap, p.D}, {}};
    cache.v = TensorView{dv.get(), p.dtype, {p.B, p.Hkv, p.cap, p.D}, {}};
  }
  cache.kv_lens = TensorView{dlens.get(), DType::I32, {p.B}, {}};
  if (!offs.empty()) cache.q_offsets = TensorView{doffs.get(), DType::I32, {p.B}, {}};
  DecodeOptions o = base;
  o.lse = TensorView{dlse.get(), DType::F32, {p.B, p.Hq, p.Lq}, {}};
  o.num_splits = c.splits;
  o.params = c.params;
  decode(TensorView{dq.get(), p.dtype, {p.B, p.Hq, p.Lq, p.D}, {}}, cache,
         TensorView{dout.get(), p.dtype, {p.B, p.Hq, p.Lq, p.D}, {}}, v, o);
  flexc::synchronize_device();
  DecodeRun r;
  const std::vector<uint16_t> bits = dout.to_vector<uint16_t>(p.B * p.Hq * p.Lq * p.D);
  for (uint16_t x : bits) r.out.push_back(p.dtype == DType::BF16 ? bf16_to_float(x) : fp16_to_float(x));
  r.lse = dlse.to_vector<float>(p.B * p.Hq * p.Lq);
  return r;
}

// The case against the reference on at most `max_rows` random rows; captures random.
Accuracy check_case(const Variant& v, const DecodeCase& c, int64_t max_rows = 96) {
  const DecodeProblem& p = c.p;
  std::vector<npy::Array> caps;
  std::vector<flexc::DeviceBuffer> dcaps;
  caps.reserve(v.captures().size());
  DecodeOptions o;
  ReferenceProblem ref = p.reference();
  for (const CaptureSpec& cs : v.captures()) {
    caps.push_back(random_capture(cs, p.B, p.Hq, p.cap, p.cap));
    dcaps.emplace_back(std::max<size_t>(caps.back().bytes.size(), 16));
    dcaps.back().upload(caps.back().bytes.data(), caps.back().bytes.size());
    o.captures[cs.name] = TensorView{dcaps.back().get(), caps.back().dtype, caps.back().shape, {}};
    ref.captures[cs.name] = caps.back().view();
  }
  ref.params = c.params;
  const DecodeRun run = run_decode(v, c, o);
  const int64_t rows = p.B * p.Hq * p.Lq;
  if (rows > max_rows) {
    std::uniform_int_distribution<int64_t> pick(0, rows - 1);
    for (int64_t i = 0; i < max_rows; ++i) ref.rows.push_back(pick(rng()));
    std::sort(ref.rows.begin(), ref.rows.end());
    ref.rows.erase(std::unique(ref.rows.begin(), ref.rows.end()), ref.rows.end());
  }
  const ReferenceResult r = reference_attention(v, ref);
  std::vector<float> got, got_lse;
  for (int64_t row : r.rows) {
    got.insert(got.end(), run.out.begin() + row * p.D, run.out.begin() + (row + 1) * p.D);
    got_lse.push_back(run.lse[row]);
  }
  return check_accuracy(r, got, got_lse);
}

}  // namespace

TEST_CASE("decode matches the reference: catalogue, ragged lengths, GQA, paged caches, splits",
          "[gpu]") {
  SKIP_WITHOUT_GPU();
  // Each variant runs a few cases walking the axes: dtypes, head dims 64 / 128, Q_LEN 1 / 3 /
  // 16, GQA 1 / 4 / 8, layouts, split counts 1 / several / the rule's / maximal (256), over a
  // ragged batch of lengths 1, 17, 1000, 4099 and (once per variant) 70000.
  const std::vector<std::string> names = Variant::catalogue_names();
  const int64_t q_lens[] = {1, 3, 16}, groups[] = {1, 4, 8};
  const int splits[] = {1, 5, 0, 256};
  const Layout layouts[] = {Layout::Contiguous, Layout::Paged16, Layout::Paged128,
                            Layout::PagedNhd64, Layout::Paged4};
  size_t n = 0;
  for (size_t vi = 0; vi < names.size(); ++vi) {
    const Variant v = Variant::from_catalogue(names[vi]);
    for (int i = 0; i < 3; ++i, ++n) {
      DecodeCase c;
      DecodeProblem& p = c.p;
      p.dtype = n % 2 ? DType::F16 : DType::BF16;
      p.D = (n / 2) % 2 ? 128 : 64;
      p.Lq = q_lens[n % 3];
      const int64_t g = groups[(n / 3) % 3];
      const bool long_one = i == 0;
      p.Hkv = long_one ? 1 : 2, p.Hq = p.Hkv * g;
      p.kv_lens = long_one ? std::vector<int64_t>{1000, 70000, 17}
                           : std::vector<int64_t>{17, 4099, 1, 1000};
      std::shuffle(p.kv_lens.begin(), p.kv_lens.end(), rng());
      p.B = int64_t(p.kv_lens.size());
      c.layout = layouts[n % 5];
      // Captures' Q_LEN / KV_LEN dims take the capacity, which a paged cache rounds up to whole
      // pages: make the reference's KV_LEN the same.
      p.cap = *std::max_element(p.kv_lens.begin(), p.kv_lens.end()) + 37;
      if (c.layout != Layout::Contiguous) p.cap = (p.cap + 127) / 128 * 128;
      c.splits = splits[(n / 4) % 4];
      if (names[vi] == "prefix_lm") c.params["prefix"] = 700;
      p.fill();
      const Accuracy a = check_case(v, c);
      INFO(names[vi] << ": " << c.describe() << "\n" << a.summary());
      CHECK(a.pass);
    }
  }
}

TEST_CASE("decode equals prefill on the same positions, also for chunked queries at q_offsets", "[gpu]") {
  SKIP_WITHOUT_GPU();
  for (const char* name : {"causal", "sliding_window", "alibi", "document"}) {
    const Variant v = Variant::from_catalogue(name);
    // Prefill of L tokens; the decode takes the last Q_LEN queries (default offsets) and, in a
    // second call, a chunk in the middle (explicit offsets), against the same keys.
    const int64_t L = 777, Hq = 8, Hkv = 2, D = 128;
    DecodeProblem d;
    d.B = 1, d.Hq = Hq, d.Hkv = Hkv, d.cap = L, d.D = D, d.kv_lens = {L};
    d.k = normal(Hkv * L * D, d.dtype), d.v = normal(Hkv * L * D, d.dtype);
    const std::vector<float> q_all = normal(Hq * L * D, d.dtype);
    std::vector<npy::Array> caps;
    std::vector<flexc::DeviceBuffer> dcaps;
    AttentionOptions ao;
    DecodeOptions dopt;
    for (const CaptureSpec& cs : v.captures()) {
      caps.push_back(random_capture(cs, 1, Hq, L, L));
      dcaps.emplace_back(std::max<size_t>(caps.back().bytes.size(), 16));
      dcaps.back().upload(caps.back().bytes.data(), caps.back().bytes.size());
      ao.captures[cs.name] = dopt.captures[cs.name] =
          TensorView{dcaps.back().get(), caps.back().dtype, caps.back().shape, {}};
    }
    // Prefill on the GPU.
    auto upload16 = [&](const std::vector<float>& x) {
      std::vector<uint16_t> bits(x.size());
      for (size_t i = 0; i < x.size(); ++i) bits[i] = float_to_bf16(x[i]);
      flexc::DeviceBuffer b(bits.size() * 2);
      b.upload(bits.data(), bits.size() * 2);
      return b;
    };
    const flexc::DeviceBuffer pq = upload16(q_all), pk = upload16(d.k), pv = upload16(d.v);
    flexc::DeviceBuffer pout(Hq * L * D * 2);
    attention(TensorView{pq.get(), DType::BF16, {1, Hq, L, D}, {}},
              TensorView{pk.get(), DType::BF16, {1, Hkv, L, D}, {}},
              TensorView{pv.get(), DType::BF16, {1, Hkv, L, D}, {}},
              TensorView{pout.get(), DType::BF16, {1, Hq, L, D}, {}}, v, ao);
    flexc::synchronize_device();
    const std::vector<uint16_t> pbits = pout.to_vector<uint16_t>(Hq * L * D);
    for (auto [lq, offset] : {std::pair<int64_t, int64_t>{5, -1}, {16, 300}}) {
      DecodeCase c;
      c.p = d;
      c.p.Lq = lq;
      const int64_t first = offset < 0 ? L - lq : offset;
      if (offset >= 0) c.p.q_offsets = {offset};
      c.p.q.resize(Hq * lq * D);
      for (int64_t h = 0; h < Hq; ++h)
        std::copy_n(q_all.begin() + (h * L + first) * D, lq * D, c.p.q.begin() + h * lq * D);
      const DecodeRun r = run_decode(v, c, dopt);
      // Both are bf16 roundings of fp32 sums in different orders: within two bf16 steps.
      double worst = 0;
      for (int64_t h = 0; h < Hq; ++h)
        for (int64_t i = 0; i < lq; ++i)
          for (int64_t e = 0; e < D; ++e) {
            const double a = r.out[(h * lq + i) * D + e];
            const double b = bf16_to_float(pbits[(h * L + first + i) * D + e]);
            worst = std::max(worst, std::abs(a - b) / std::max(1.0, std::abs(b)));
          }
      INFO(name << " Q_LEN " << lq << " first position " << first);
      CHECK(worst <= 2.0 / 128);
    }
  }
}

TEST_CASE("decode: empty sequences give 0 and -inf, bad device arguments NaN or a named error",
          "[gpu]") {
  SKIP_WITHOUT_GPU();
  const Variant causal = Variant::from_catalogue("causal");
  DecodeCase c;
  DecodeProblem& p = c.p;
  p.B = 3, p.Hq = 8, p.Hkv = 2, p.Lq = 3, p.D = 64, p.cap = 300;
  p.kv_lens = {0, 2, 300};  // sequence 1: queries at -1, 0, 1
  p.fill();
  for (Layout l : {Layout::Contiguous, Layout::Paged16})
    for (int splits : {1, 4}) {
      c.layout = l, c.splits = splits;
      const Accuracy a = check_case(causal, c, 1000);
      INFO(c.describe() << "\n" << a.summary());
      CHECK(a.pass);
      CHECK(a.masked_rows == 8 * 3 + 8);
    }
  // A page index out of range: named with check_device_args, NaN rows of that sequence without.
  c.layout = Layout::Paged16, c.splits = 2;
  c.p.kv_lens = {5, 2, 300};
  DecodeOptions checked;
  checked.check_device_args = true;
  CHECK_THROWS_WITH(run_decode(causal, c, checked, true), Contains("page_table[0, 0] = "));
  const DecodeRun r = run_decode(causal, c, {}, true);
  CHECK(std::isnan(r.out[0]));
  CHECK(std::isnan(r.lse[0]));
  CHECK(std::isfinite(r.lse[2 * 8 * 3 + 5]));  // sequence 2 untouched
  // A length above the capacity.
  c.layout = Layout::Contiguous;
  c.p.kv_lens = {5, 2, 301};
  CHECK_THROWS_WITH(run_decode(causal, c, checked), Contains("kv_lens[2] = 301 is outside [0, 300]"));
  const DecodeRun r2 = run_decode(causal, c, {});
  CHECK(std::isnan(r2.lse[2 * 8 * 3]));
  CHECK(std::isfinite(r2.lse[8 * 3 + 2]));
}

TEST_CASE("decode takes its split workspace from the caller's allocator when given one", "[gpu]") {
  SKIP_WITHOUT_GPU();
  const Variant causal = Variant::from_catalogue("causal");
  DecodeCase c;
  c.p.B = 2, c.p.Hq = 8, c.p.Hkv = 2, c.p.Lq = 2, c.p.D = 64, c.p.cap = 3000;
  c.p.kv_lens = {3000, 1234};
  c.p.fill();
  c.splits = 6;
  const DecodeRun own = run_decode(causal, c, {});
  // A caller's allocator (a framework's caching allocator): asked once, for the partials.
  std::vector<flexc::DeviceBuffer> given;
  std::vector<size_t> asked;
  DecodeOptions o;
  o.workspace = [&](size_t bytes) {
    asked.push_back(bytes);
    given.emplace_back(bytes);
    return given.back().get();
  };
  const DecodeRun theirs = run_decode(causal, c, o);
  REQUIRE(asked.size() == 1);
  CHECK(asked[0] == size_t(2 * 8 * 2) * 6 * (64 + 1) * sizeof(float));
  CHECK(theirs.out == own.out);
  CHECK(theirs.lse == own.lse);
  // One split needs no workspace; a misaligned block is refused by name.
  c.splits = 1;
  run_decode(causal, c, o);
  CHECK(asked.size() == 1);
  c.splits = 6;
  o.workspace = [&](size_t bytes) {
    given.emplace_back(bytes + 256);
    return static_cast<char*>(given.back().get()) + 16;
  };
  CHECK_THROWS_WITH(run_decode(causal, c, o),
                    Contains("the workspace allocator returned") && Contains("aligned to 256 bytes"));
}

TEST_CASE("a decode step captured in a CUDA graph replays with new lengths and page tables",
          "[gpu]") {
  SKIP_WITHOUT_GPU();
  // Inference engines capture the step once and replay it as sequences grow: lengths, offsets
  // and the page table are device data the graph reads at replay; the workspace comes from
  // stream-ordered allocation nodes and the splits' combine is part of the graph.
  const Variant v = Variant::from_catalogue("sliding_window");
  DecodeProblem p;
  p.B = 3, p.Hq = 8, p.Hkv = 2, p.Lq = 2, p.D = 128, p.cap = 5000;
  p.kv_lens = {4000, 700, 5000};
  p.fill();
  auto bits = [&](const std::vector<float>& x) {
    std::vector<uint16_t> b(x.size());
    for (size_t i = 0; i < x.size(); ++i) b[i] = float_to_bf16(x[i]);
    return flexc::DeviceBuffer::from<uint16_t>(b);
  };
  const flexc::DeviceBuffer dq = bits(p.q), dk = bits(p.k), dv = bits(p.v);
  std::vector<int32_t> lens(p.kv_lens.begin(), p.kv_lens.end());
  flexc::DeviceBuffer dlens = flexc::DeviceBuffer::from<int32_t>(lens);
  flexc::DeviceBuffer dout(p.B * p.Hq * p.Lq * p.D * 2), dlse(p.B * p.Hq * p.Lq * 4);
  KvCache cache;
  cache.k = TensorView{dk.get(), DType::BF16, {p.B, p.Hkv, p.cap, p.D}, {}};
  cache.v = TensorView{dv.get(), DType::BF16, {p.B, p.Hkv, p.cap, p.D}, {}};
  cache.kv_lens = TensorView{dlens.get(), DType::I32, {p.B}, {}};
  DecodeOptions o;
  o.params["window"] = 1500;
  o.num_splits = 6;
  o.lse = TensorView{dlse.get(), DType::F32, {p.B, p.Hq, p.Lq}, {}};
  flexc::Stream stream;
  o.stream = stream.get();
  const TensorView qv{dq.get(), DType::BF16, {p.B, p.Hq, p.Lq, p.D}, {}};
  const TensorView ov{dout.get(), DType::BF16, {p.B, p.Hq, p.Lq, p.D}, {}};
  // Compiled, loaded and the workspace pool made outside the capture, with the JIT's memory
  // emptied first: prepare_decode must compile or read the disk, the captured call neither, and
  // the capture's global mode refuses any allocation or module load in it.
  jit::reset_cache();
  const jit::CacheCounters before = jit::cache_counters();
  prepare_decode(qv, cache, ov, v, o);
  const jit::CacheCounters prepared = jit::cache_counters();
  CHECK(prepared.compiles + prepared.disk_hits > before.compiles + before.disk_hits);

  const flexc::testing::CapturedGraph graph(stream.get(), [&] { decode(qv, cache, ov, v, o); });
  CHECK(jit::cache_counters().compiles == prepared.compiles);
  CHECK(jit::cache_counters().disk_hits == prepared.disk_hits);

  for (const std::vector<int64_t>& step : {std::vector<int64_t>{4001, 701, 5000},
                                           std::vector<int64_t>{17, 2, 4096}}) {
    p.kv_lens = step;
    lens.assign(step.begin(), step.end());
    dlens.upload(lens.data(), lens.size() * 4);
    dout.fill(0xff), dlse.fill(0xff);
    graph.replay();
    stream.synchronize();
    ReferenceProblem ref = p.reference();
    ref.params = o.params;
    const ReferenceResult r = reference_attention(v, ref);
    std::vector<float> out, lse = dlse.to_vector<float>(p.B * p.Hq * p.Lq);
    for (uint16_t x : dout.to_vector<uint16_t>(p.B * p.Hq * p.Lq * p.D)) out.push_back(bf16_to_float(x));
    const Accuracy a = check_accuracy(r, out, lse);
    INFO("kv_lens " << fmt::format("{}", fmt::join(step, ", ")) << ": " << a.summary());
    CHECK(a.pass);
  }
}
