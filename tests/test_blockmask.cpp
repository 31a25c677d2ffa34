// BlockMask: the analytic builder, the CPU brute force and the GPU builder agree exactly with an
// element-by-element oracle; from_kv_blocks validation; the picture and sparsity.
#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <catch2/catch.hpp>
#include <cstring>
#include <limits>
#include <random>

#include "blockmask/blockmask_impl.h"
#include "dsl/analysis.h"
#include "dsl/ir.h"
#include "flexc/blockmask.h"
#include "flexc/device.h"
#include "flexc/error.h"
#include "flexc/variant.h"
#include "jit/abi.h"
#include "jit/jit.h"
#include "random_expr.h"
#include "test_random.h"
#include "variant_impl.h"

using namespace flexc;

namespace {

using flexc::testing::rng;
int64_t uniform(int64_t lo, int64_t hi) {
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng());
}

// Random contents for every capture a variant declares; document-like ids for int32 ones.
struct Captures {
  std::vector<std::vector<std::byte>> storage;
  std::map<std::string, CaptureData, std::less<>> data;
};

Captures random_captures(const Variant& v, int64_t B, int64_t H, int64_t q_len, int64_t kv_len) {
  Captures c;
  for (const CaptureSpec& s : v.captures()) {
    std::vector<int64_t> shape;
    for (const std::string& d : s.dims)
      shape.push_back(d == "B"        ? B
                      : d == "H"      ? H
                      : d == "Q_LEN"  ? q_len
                      : d == "KV_LEN" ? kv_len
                                      : std::stoll(d));
    int64_t n = 1;
    for (int64_t x : shape) n *= x;
    const int64_t last = shape.back();
    std::vector<std::byte> bytes;
    auto put = [&](auto x) {
      const auto* p = reinterpret_cast<const std::byte*>(&x);
      bytes.insert(bytes.end(), p, p + sizeof(x));
    };
    // Documents: ascending ids along the last dim, with random boundaries (some long documents,
    // some short ones, so that tiles both inside and across documents occur).
    const int64_t mean_len = uniform(1, std::max<int64_t>(2, last / uniform(1, 8)));
    int32_t doc = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (i % last == 0)
        doc = 0;
      else if (uniform(0, mean_len - 1) == 0)
        ++doc;
      if (s.dtype == "int32")
        put(doc);
      else if (s.dtype == "float32")
        put(float(uniform(-100, 100)) / 8);
      else if (s.dtype == "bf16")
        put(uint16_t(std::bit_cast<uint32_t>(float(uniform(-64, 64))) >> 16));
      else if (s.dtype == "fp16")
        put(std::bit_cast<uint16_t>(_Float16(float(uniform(-64, 64)) / 4)));
      else
        put(uint8_t(uniform(0, 1)));
    }
    c.storage.push_back(std::move(bytes));
    c.data[s.name] = CaptureData{c.storage.back().data(), nullptr, shape, {}};
  }
  return c;
}

// The oracle: every element of every tile through the interpreter, as the kernels compute it,
// for the nb x nh broadcast groups of a B x H call.
std::vector<TileKind> oracle(const Variant& v, int64_t B, int64_t H, int64_t nb, int64_t nh,
                             int64_t q_len, int64_t kv_len, const BlockMaskOptions& o) {
  const detail::MaskProblem p = detail::resolve_problem(v, B, H, q_len, kv_len, o);
  const int64_t q_tile = o.q_tile, kv_tile = o.kv_tile;
  const int64_t nqt = (q_len + q_tile - 1) / q_tile, nkt = (kv_len + kv_tile - 1) / kv_tile;
  std::vector<uint8_t> seen(nb * nh * nqt * nkt, 0);  // bit 0: a true, bit 1: a false element
  dsl::EvalEnv env;
  env.params = p.params;
  env.captures = p.captures;
  env.ints[int(dsl::Input::QLen)] = p.pos.seq_q_len;
  env.ints[int(dsl::Input::KvLen)] = p.pos.seq_kv_len;
  std::vector<dsl::Value> scratch;
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t h = 0; h < nh; ++h)
      for (int64_t q = 0; q < q_len; ++q)
        for (int64_t k = 0; k < kv_len; ++k) {
          env.ints[int(dsl::Input::B)] = b;
          env.ints[int(dsl::Input::H)] = h;
          env.ints[int(dsl::Input::QIdx)] = p.pos.q_offset + q;
          env.ints[int(dsl::Input::KvIdx)] = p.pos.kv_offset + k;
          const bool t = dsl::evaluate(*p.mask, env, dsl::Precision::F32, scratch).i != 0;
          seen[((b * nh + h) * nqt + q / q_tile) * nkt + k / kv_tile] |= t ? 1 : 2;
        }
  std::vector<TileKind> kinds;
  for (uint8_t s : seen)
    kinds.push_back(s == 3 ? TileKind::Partial : s == 1 ? TileKind::Full : TileKind::Empty);
  return kinds;
}

// Checks m's lists against the expected kinds (nb x nh x nqt x nkt), through the public host
// copy: counts, ascending entries, zero tails, the transposes, and tile().
void check_against(const BlockMask& m, const std::vector<TileKind>& want) {
  const int64_t nb = m.nb(), nh = m.nh(), nqt = m.num_q_tiles(), nkt = m.num_kv_tiles();
  REQUIRE(int64_t(want.size()) == nb * nh * nqt * nkt);
  const BlockMask::Host& h = m.host();
  REQUIRE(int64_t(h.kv_idx.size()) == nb * nh * nqt * nkt);
  REQUIRE(int64_t(h.q_idx.size()) == nb * nh * nkt * nqt);
  int64_t mismatches = 0;
  // List `at` of length `len` (partial and full) against the kinds kind_at(0 .. len - 1).
  auto check_list = [&](int64_t at, int64_t len, auto kind_at, const std::vector<int32_t>& num,
                        const std::vector<int32_t>& idx, const std::vector<int32_t>& full_num,
                        const std::vector<int32_t>& full_idx) {
    std::vector<int32_t> part, full;
    for (int64_t i = 0; i < len; ++i) {
      if (kind_at(i) == TileKind::Partial) part.push_back(int32_t(i));
      if (kind_at(i) == TileKind::Full) full.push_back(int32_t(i));
    }
    if (num[at] != int32_t(part.size()) || full_num[at] != int32_t(full.size())) ++mismatches;
    part.resize(len, 0), full.resize(len, 0);
    if (!std::equal(part.begin(), part.end(), idx.data() + at * len) ||
        !std::equal(full.begin(), full.end(), full_idx.data() + at * len))
      ++mismatches;
  };
  for (int64_t g = 0; g < nb * nh; ++g) {
    auto kind = [&](int64_t qt, int64_t kt) { return want[(g * nqt + qt) * nkt + kt]; };
    for (int64_t qt = 0; qt < nqt; ++qt) {
      check_list(
          g * nqt + qt, nkt, [&](int64_t kt) { return kind(qt, kt); }, h.kv_num, h.kv_idx,
          h.full_kv_num, h.full_kv_idx);
      for (int64_t kt = 0; kt < nkt; ++kt)
        if (m.tile(g / nh, g % nh, qt, kt) != kind(qt, kt)) ++mismatches;
    }
    for (int64_t kt = 0; kt < nkt; ++kt)
      check_list(
          g * nkt + kt, nqt, [&](int64_t qt) { return kind(qt, kt); }, h.q_num, h.q_idx,
          h.full_q_num, h.full_q_idx);
  }
  CHECK(mismatches == 0);
}

bool same(const BlockMask& a, const BlockMask& b) {
  const BlockMask::Host &x = a.host(), &y = b.host();
  return a.nb() == b.nb() && a.nh() == b.nh() && a.num_q_tiles() == b.num_q_tiles() &&
         a.num_kv_tiles() == b.num_kv_tiles() && x.kv_num == y.kv_num && x.kv_idx == y.kv_idx &&
         x.full_kv_num == y.full_kv_num && x.full_kv_idx == y.full_kv_idx && x.q_num == y.q_num &&
         x.q_idx == y.q_idx && x.full_q_num == y.full_q_num && x.full_q_idx == y.full_q_idx;
}

struct Shape {
  int64_t B, H, q_len, kv_len, q_tile, kv_tile;
  // A block of a longer sequence (BlockMaskOptions' positions; 0: none).
  int64_t q_offset = 0, kv_offset = 0, seq_q_len = 0, seq_kv_len = 0;

  int64_t seq_q() const { return seq_q_len ? seq_q_len : q_offset + q_len; }
  int64_t seq_kv() const { return seq_kv_len ? seq_kv_len : kv_offset + kv_len; }
  // Options with these tiles and positions.
  void apply(BlockMaskOptions& o) const {
    o.q_tile = q_tile, o.kv_tile = kv_tile;
    o.q_offset = q_offset, o.kv_offset = kv_offset;
    o.seq_q_len = seq_q_len, o.seq_kv_len = seq_kv_len;
  }
};

std::string describe(const std::string& name, const Shape& s) {
  return fmt::format("{}: B={} H={} q_len={} kv_len={} tiles {}x{} positions q {} kv {} of {} x {}",
                     name, s.B, s.H, s.q_len, s.kv_len, s.q_tile, s.kv_tile, s.q_offset,
                     s.kv_offset, s.seq_q(), s.seq_kv());
}

// The sizes the issue names, plus random ones; q_len != kv_len in most.
std::vector<Shape> shapes() {
  const int64_t lens[] = {1, 17, 127, 129, 1000};
  std::vector<Shape> out;
  for (int i = 0; i < 4; ++i) {
    Shape s;
    s.B = uniform(1, 2), s.H = uniform(1, 3);
    s.q_len = i < 3 ? lens[uniform(0, 4)] : uniform(1, 700);
    s.kv_len = i == 0 ? s.q_len : i < 3 ? lens[uniform(0, 4)] : uniform(1, 700);
    s.q_tile = i % 2 ? 64 : 128, s.kv_tile = 128;
    if (s.q_len * s.kv_len > 300000) s.B = s.H = 1;  // keep the oracle quick
    out.push_back(s);
  }
  out.push_back({1, 1, 1000, 1000, 128, 128});
  // A block of a longer sequence, at positions that are not tile-aligned.
  Shape block{uniform(1, 2), uniform(1, 2), uniform(1, 300), uniform(1, 300), 128, 128};
  block.q_offset = uniform(0, 400), block.kv_offset = uniform(0, 400);
  block.seq_q_len = block.q_offset + block.q_len + uniform(0, 100);
  block.seq_kv_len = block.kv_offset + block.kv_len + uniform(0, 100);
  out.push_back(block);
  return out;
}

// Variant params that make the catalogue's masks interesting at test sizes (their defaults are
// for long sequences).
BlockMaskOptions small_params(const Variant& v) {
  BlockMaskOptions o;
  for (const ParamSpec& p : v.params()) {
    if (p.is_const) continue;
    if (p.name == "window" || p.name == "prefix" || p.name == "chunk" || p.name == "global" ||
        p.name == "sink")
      o.params[p.name] = double(uniform(1, 300));
    if (p.name == "width" || p.name == "height") o.params[p.name] = double(uniform(4, 40));
    if (p.name == "radius") o.params[p.name] = double(uniform(0, 3));
  }
  return o;
}

}  // namespace

TEST_CASE("analytic == brute force == oracle for every catalogue mask", "[blockmask]") {
  for (const std::string& name : Variant::catalogue_names()) {
    const Variant v = Variant::from_catalogue(name);
    for (const Shape& s : shapes()) {
      INFO(describe(name, s));
      Captures caps = random_captures(v, s.B, s.H, s.seq_q(), s.seq_kv());
      BlockMaskOptions o = small_params(v);
      o.captures = caps.data;
      s.apply(o);
      o.device = BuildDevice::Cpu;
      const BlockMask fast = create_block_mask(v, s.B, s.H, s.q_len, s.kv_len, o);
      o.analytic = false;
      const BlockMask brute = create_block_mask(v, s.B, s.H, s.q_len, s.kv_len, o);
      CHECK(same(fast, brute));
      CHECK(fast.nb() == (v.mask_deps().b ? s.B : 1));
      CHECK(fast.nh() == (v.mask_deps().h ? s.H : 1));
      check_against(fast, oracle(v, s.B, s.H, fast.nb(), fast.nh(), s.q_len, s.kv_len, o));
      const BlockMaskStats& st = fast.stats();
      CHECK(st.device == "cpu");
      CHECK(st.decided_tiles + st.evaluated_tiles == st.tiles);
      CHECK(brute.stats().decided_tiles == 0);
      CHECK(brute.stats().evaluated_tiles == st.tiles);
    }
  }
}

TEST_CASE("a BlockMask at q_offset: the full mask's rows there, analytic == brute force",
          "[blockmask]") {
  // Chunked prefill: rows are positions q_offset + r. At a tile-aligned offset the chunk's tiles
  // are the full mask's tiles from that offset; at any offset the analysis agrees with brute
  // force.
  for (const std::string& name : Variant::catalogue_names()) {
    const Variant v = Variant::from_catalogue(name);
    const int64_t offset = 128 * uniform(1, 4), q_len = uniform(1, 400), kv_len = uniform(1, 900);
    INFO(name << " offset " << offset << " q_len " << q_len << " kv_len " << kv_len);
    Captures caps = random_captures(v, 1, 2, offset + 37 + q_len, kv_len);
    BlockMaskOptions o = small_params(v);
    o.captures = caps.data;
    o.device = BuildDevice::Cpu;
    const BlockMask full = create_block_mask(v, 1, 2, offset + q_len, kv_len, o);
    o.q_offset = offset;
    const BlockMask chunk = create_block_mask(v, 1, 2, q_len, kv_len, o);
    CHECK(chunk.q_offset() == offset);
    int64_t differ = 0;
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t qt = 0; qt < chunk.num_q_tiles(); ++qt)
        for (int64_t kt = 0; kt < chunk.num_kv_tiles(); ++kt)
          differ += chunk.tile(0, h, qt, kt) != full.tile(0, h, qt + offset / 128, kt);
    CHECK(differ == 0);
    o.q_offset = offset + 37;
    const BlockMask fast = create_block_mask(v, 1, 2, q_len, kv_len, o);
    o.analytic = false;
    const BlockMask brute = create_block_mask(v, 1, 2, q_len, kv_len, o);
    CHECK(same(fast, brute));
  }
  BlockMaskOptions o;
  o.q_offset = -1;
  CHECK_THROWS_WITH(create_block_mask(Variant::from_catalogue("causal"), 1, 1, 16, 16, o),
                    Catch::Matchers::Contains("q_offset = -1 must be >= 0"));
}

TEST_CASE("a BlockMask of a block of a longer sequence: the whole mask's tiles there",
          "[blockmask]") {
  // Context parallelism (ring attention): rows at q_offset + r, columns at kv_offset + c, the
  // mods seeing the whole sequence's lengths. For tile-aligned blocks the block's tiles are the
  // whole sequence's mask's (captures indexed by position and length-dependent masks included);
  // the random shapes above check unaligned positions against brute force and the oracle.
  for (const std::string& name : Variant::catalogue_names()) {
    const Variant v = Variant::from_catalogue(name);
    const int64_t seq = 128 * uniform(4, 9) - uniform(0, 127);
    const int64_t q_len = 128 * uniform(1, 2), kv_len = 128 * uniform(1, 2);
    const int64_t q_off = 128 * uniform(0, (seq - q_len) / 128);
    const int64_t kv_off = 128 * uniform(0, (seq - kv_len) / 128);
    INFO(name << " seq " << seq << " q [" << q_off << ", +" << q_len << ") kv [" << kv_off << ", +"
              << kv_len << ")");
    Captures caps = random_captures(v, 1, 2, seq, seq);
    BlockMaskOptions o = small_params(v);
    o.captures = caps.data;
    o.device = BuildDevice::Cpu;
    const BlockMask whole = create_block_mask(v, 1, 2, seq, seq, o);
    o.q_offset = q_off, o.kv_offset = kv_off, o.seq_q_len = seq, o.seq_kv_len = seq;
    const BlockMask block = create_block_mask(v, 1, 2, q_len, kv_len, o);
    CHECK(block.kv_offset() == kv_off);
    CHECK(block.seq_q_len() == seq);
    int64_t differ = 0;
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t qt = 0; qt < block.num_q_tiles(); ++qt)
        for (int64_t kt = 0; kt < block.num_kv_tiles(); ++kt)
          differ += block.tile(0, h, qt, kt) !=
                    whole.tile(0, h, qt + q_off / 128, kt + kv_off / 128);
    CHECK(differ == 0);
  }
  // Positions that do not fit their sequence are named.
  const Variant causal = Variant::from_catalogue("causal");
  BlockMaskOptions o;
  o.kv_offset = -3;
  CHECK_THROWS_WITH(create_block_mask(causal, 1, 1, 16, 16, o),
                    Catch::Matchers::Contains("kv_offset = -3 must be >= 0"));
  o.kv_offset = 10, o.seq_kv_len = 20;
  CHECK_THROWS_WITH(create_block_mask(causal, 1, 1, 16, 16, o),
                    Catch::Matchers::Contains("seq_kv_len = 20 must hold kv_offset + KV_LEN = 26"));
  o.seq_kv_len = 0, o.seq_q_len = 15;
  CHECK_THROWS_WITH(create_block_mask(causal, 1, 1, 16, 16, o),
                    Catch::Matchers::Contains("seq_q_len = 15 must hold q_offset + Q_LEN = 16"));
}

TEST_CASE("the analysis decides every tile off the boundary of linear masks", "[blockmask]") {
  // For these the interval analysis is exact: only truly partial tiles are evaluated.
  for (const char* name : {"causal", "causal_bottom_right", "sliding_window", "prefix_lm",
                           "chunked", "global_local", "sink_window"}) {
    const Variant v = Variant::from_catalogue(name);
    const int64_t q_len = uniform(1, 3000), kv_len = uniform(1, 3000);
    INFO(name << " q_len=" << q_len << " kv_len=" << kv_len);
    BlockMaskOptions o = small_params(v);
    o.device = BuildDevice::Cpu;
    const BlockMask m = create_block_mask(v, 1, 1, q_len, kv_len, o);
    CHECK(m.stats().evaluated_tiles == m.count(TileKind::Partial));
  }
}

TEST_CASE("document masks: decided except at document boundaries", "[blockmask]") {
  const Variant v = Variant::from_catalogue("document");
  const int64_t len = uniform(2000, 5000);
  std::vector<int32_t> doc(len);
  int64_t docs = uniform(1, 8), boundaries_tiles = 0;
  std::vector<int64_t> starts{0};
  for (int64_t i = 1; i < docs; ++i) starts.push_back(uniform(1, len - 1));
  std::sort(starts.begin(), starts.end());
  for (int64_t i = 0, d = 0; i < len; ++i) {
    while (d + 1 < docs && starts[d + 1] <= i) ++d;
    doc[i] = int32_t(d);
  }
  BlockMaskOptions o;
  o.device = BuildDevice::Cpu;
  o.captures["doc"] = CaptureData{doc.data(), nullptr, {len}, {}};
  const BlockMask m = create_block_mask(v, 1, 1, len, len, o);
  // A tile is evaluated only when its q range or its kv range holds a document boundary.
  const int64_t nt = m.num_q_tiles();
  std::vector<bool> cut(nt, false);
  for (int64_t t = 0; t < nt; ++t) cut[t] = doc[t * 128] != doc[std::min(len, (t + 1) * 128) - 1];
  for (int64_t a = 0; a < nt; ++a)
    for (int64_t b = 0; b < nt; ++b) boundaries_tiles += cut[a] || cut[b];
  INFO("docs " << docs << " len " << len);
  CHECK(m.stats().evaluated_tiles <= boundaries_tiles);
  check_against(m, oracle(v, 1, 1, 1, 1, len, len, o));

  // Strided host copy: every other element of a longer buffer.
  std::vector<int32_t> strided(2 * len);
  for (int64_t i = 0; i < len; ++i) strided[2 * i] = doc[i], strided[2 * i + 1] = -7;
  o.captures["doc"] = CaptureData{strided.data(), nullptr, {len}, {2}};
  CHECK(same(create_block_mask(v, 1, 1, len, len, o), m));
}

TEST_CASE("B and H broadcast", "[blockmask]") {
  const Variant reads_bh = Variant::from_strings(
      "score", "(q_idx + 3 * b + 5 * h) % 7 < 4 || kv_idx <= q_idx - 200 * h", {}, {}, "bh");
  const Variant reads_h = Variant::from_strings("score", "kv_idx <= q_idx + 100 * h", {}, {}, "h");
  BlockMaskOptions o;
  o.device = BuildDevice::Cpu;
  o.q_tile = 64;
  const int64_t B = uniform(2, 3), H = uniform(2, 4), q_len = uniform(100, 400),
                kv_len = uniform(100, 400);
  const BlockMask bh = create_block_mask(reads_bh, B, H, q_len, kv_len, o);
  CHECK(bh.nb() == B);
  CHECK(bh.nh() == H);
  check_against(bh, oracle(reads_bh, B, H, B, H, q_len, kv_len, o));
  const BlockMask h = create_block_mask(reads_h, B, H, q_len, kv_len, o);
  CHECK(h.nb() == 1);
  CHECK(h.nh() == H);
  check_against(h, oracle(reads_h, B, H, 1, H, q_len, kv_len, o));
  // tile() broadcasts b.
  CHECK(h.tile(B - 1, H - 1, 0, h.num_kv_tiles() - 1) == h.tile(0, H - 1, 0, h.num_kv_tiles() - 1));
  o.analytic = false;
  CHECK(same(create_block_mask(reads_bh, B, H, q_len, kv_len, o), bh));
}

TEST_CASE("mask_density counts the kept elements", "[blockmask]") {
  BlockMaskOptions o;
  o.device = BuildDevice::Cpu;
  const int64_t S = uniform(100, 700), T = uniform(50, 700);
  INFO("q_len " << S << " kv_len " << T);
  // Causal (top-left): row q keeps min(q + 1, T) keys.
  const Variant causal = Variant::from_catalogue("causal");
  double kept = 0;
  for (int64_t q = 0; q < S; ++q) kept += double(std::min(q + 1, T));
  CHECK(mask_density(causal, create_block_mask(causal, 2, 3, S, T, o), 2, 3, o) ==
        Approx(kept / double(S * T)).epsilon(1e-12));
  // Per-head masks weigh each head alike; the count is exact against a brute-force sweep.
  const Variant reads_h = Variant::from_strings("score", "kv_idx <= q_idx + 100 * h", {}, {}, "h");
  const int64_t H = uniform(2, 4);
  kept = 0;
  for (int64_t h = 0; h < H; ++h)
    for (int64_t q = 0; q < S; ++q) kept += double(std::clamp<int64_t>(q + 100 * h + 1, 0, T));
  const BlockMask mh = create_block_mask(reads_h, 2, H, S, T, o);
  CHECK(mask_density(reads_h, mh, 2, H, o) ==
        Approx(kept / double(H * S * T)).epsilon(1e-12));
  // Captures: a document mask keeps the sum of squared document lengths.
  const Variant doc_mask = Variant::from_catalogue("document");
  std::vector<int32_t> doc(S);
  for (int64_t i = 0; i < S; ++i) doc[i] = int32_t(i * 3 / S);
  o.captures["doc"] = CaptureData{doc.data(), nullptr, {S}, {}};
  kept = 0;
  for (int d = 0; d < 3; ++d) {
    const double n = double(std::count(doc.begin(), doc.end(), d));
    kept += n * n;
  }
  CHECK(mask_density(doc_mask, create_block_mask(doc_mask, 1, 1, S, S, o), 1, 1, o) ==
        Approx(kept / double(S * S)).epsilon(1e-12));
  // A BlockMask built for other sizes or options is refused, naming what differs.
  o.captures.clear();
  CHECK_THROWS_WITH(mask_density(reads_h, mh, 2, H + 1, o),
                    Catch::Contains("was not built for 'h' with B 2, H " + std::to_string(H + 1)));
  BlockMaskOptions small = o;
  small.q_tile = 64;
  CHECK_THROWS_WITH(mask_density(reads_h, mh, 2, H, small), Catch::Contains("these options"));
}

TEST_CASE("random masks: analytic == brute force", "[blockmask]") {
  // Random boolean expressions over the indices, a param and a captured int tensor, printed to
  // DSL text and parsed back as variants.
  dsl::Decls decls;
  decls.params.push_back({"p", dsl::Type::Int, 0, false});
  decls.captures.push_back({"t", dsl::DType::I32, {dsl::Dim{dsl::Dim::KvLen, 0}}});
  dsl::testing::RandomExprOptions ro;
  ro.decls = &decls;
  ro.int_lo = -40, ro.int_hi = 300;
  dsl::testing::RandomExpr gen(rng()(), ro);
  int built = 0;
  for (int i = 0; i < 60; ++i) {
    dsl::Graph g;
    g.root = gen.bool_expr(g);
    const std::string text = dsl::to_text(g, g.root, decls);
    INFO(text);
    std::optional<Variant> v;
    try {
      v = Variant::from_strings("score", text, {{"t", "int32", {"KV_LEN"}}},
                                {{"p", "int", 0, false}}, "random");
    } catch (const Error&) {
      continue;  // e.g. a division by a constant zero the checker rejects
    }
    ++built;
    // Sometimes a long kv axis, so that capture ranges span many blocks.
    const bool long_kv = i % 3 == 0;
    const int64_t B = uniform(1, 2), H = uniform(1, 2), q_len = uniform(1, long_kv ? 40 : 300),
                  kv_len = uniform(1, long_kv ? 6000 : 300);
    std::vector<int32_t> t(kv_len);
    for (auto& x : t) x = int32_t(uniform(-50, 50));
    BlockMaskOptions o;
    o.device = BuildDevice::Cpu;
    o.q_tile = uniform(1, 3) * 32, o.kv_tile = uniform(1, 3) * 32;
    o.params["p"] = double(uniform(-100, 100));
    o.captures["t"] = CaptureData{t.data(), nullptr, {kv_len}, {}};
    const BlockMask fast = create_block_mask(*v, B, H, q_len, kv_len, o);
    check_against(fast, oracle(*v, B, H, fast.nb(), fast.nh(), q_len, kv_len, o));
  }
  CHECK(built >= 40);
}

TEST_CASE("capture ranges == a scan of the box", "[blockmask]") {
  const dsl::DType dtypes[] = {dsl::DType::I32, dsl::DType::F32, dsl::DType::BF16, dsl::DType::F16,
                               dsl::DType::Bool};
  for (int iter = 0; iter < 40; ++iter) {
    const dsl::DType dt = dtypes[iter % 5];
    const size_t rank = size_t(uniform(1, 3));
    std::vector<int64_t> shape(rank);
    for (size_t i = 0; i + 1 < rank; ++i) shape[i] = uniform(1, 4);
    shape.back() = uniform(1, 5000);
    // Strided: the last dim every `step` elements, rows padded.
    const int64_t step = uniform(1, 2);
    std::vector<int64_t> strides(rank);
    strides.back() = step;
    for (size_t i = rank - 1; i-- > 0;) strides[i] = strides[i + 1] * shape[i + 1] + uniform(0, 3);
    int64_t extent = 1;
    for (size_t i = 0; i < rank; ++i) extent += (shape[i] - 1) * strides[i];
    std::vector<uint32_t> words(extent);  // wide enough for every dtype
    for (auto& w : words) {
      const int64_t x = uniform(-1000, 1000);
      w = dt == dsl::DType::I32    ? uint32_t(int32_t(x))
          : dt == dsl::DType::F32  ? std::bit_cast<uint32_t>(float(x) / 8)
          : dt == dsl::DType::BF16 ? std::bit_cast<uint32_t>(float(x)) >> 16
          : dt == dsl::DType::F16  ? std::bit_cast<uint16_t>(_Float16(float(x) / 16))
                                   : uint32_t(x > 0);
    }
    // Repack to the element size.
    const size_t es = dt == dsl::DType::Bool                            ? 1
                      : dt == dsl::DType::BF16 || dt == dsl::DType::F16 ? 2
                                                                        : 4;
    std::vector<std::byte> bytes(extent * es);
    for (int64_t i = 0; i < extent; ++i) std::memcpy(&bytes[i * es], &words[i], es);
    const dsl::HostTensor t{dt, bytes.data(), shape, strides};
    const detail::CaptureRanges ranges(t);
    // The reference: the interpreter's view of each element, through a Load.
    dsl::Graph g;
    std::vector<dsl::NodeId> idx;
    for (size_t i = 0; i < rank; ++i)
      idx.push_back(g.input(std::array{dsl::Input::B, dsl::Input::H, dsl::Input::QIdx}[i]));
    g.root = g.load(0, dsl::dtype_value_type(dt), idx);
    dsl::EvalEnv env;
    env.captures = std::span(&t, 1);
    for (int q = 0; q < 20; ++q) {
      std::vector<dsl::IntRange> box(rank);
      for (size_t i = 0; i < rank; ++i) {
        const int64_t a = uniform(0, shape[i] - 1), b = uniform(0, shape[i] - 1);
        box[i] = {std::min(a, b), std::max(a, b)};
      }
      double lo = 1e300, hi = -1e300;
      std::array<int64_t, 3> at{};
      for (at[0] = box[0].lo; at[0] <= box[0].hi; ++at[0])
        for (at[1] = rank > 1 ? box[1].lo : 0; at[1] <= (rank > 1 ? box[1].hi : 0); ++at[1])
          for (at[2] = rank > 2 ? box[2].lo : 0; at[2] <= (rank > 2 ? box[2].hi : 0); ++at[2]) {
            for (size_t i = 0; i < 3; ++i)
              env.ints[int(std::array{dsl::Input::B, dsl::Input::H, dsl::Input::QIdx}[i])] = at[i];
            const dsl::Value v = dsl::evaluate(g, env);
            const double x = v.type == dsl::Type::Float ? v.f : double(v.i);
            lo = std::min(lo, x), hi = std::max(hi, x);
          }
      const auto r = ranges.query(box);
      REQUIRE(r.has_value());
      INFO("dtype " << int(dt) << " shape " << fmt::format("{}", fmt::join(shape, "x")));
      CHECK(r->first == lo);
      CHECK(r->second == hi);
    }
  }
}

TEST_CASE("picture and sparsity", "[blockmask]") {
  const Variant causal = Variant::from_catalogue("causal");
  BlockMaskOptions o;
  o.device = BuildDevice::Cpu;
  const BlockMask m = create_block_mask(causal, 1, 1, 512, 512, o);
  CHECK(m.sparsity() == Approx(100.0 * 6 / 16));
  CHECK(m.count(TileKind::Full) == 6);
  CHECK(m.count(TileKind::Partial) == 4);
  CHECK(m.count(TileKind::Empty) == 6);
  CHECK(m.to_string() ==
        "BlockMask(nb=1, nh=1, q_len=512, kv_len=512, tile=128x128, tiles=4x4, "
        "sparsity=37.50%)\n"
        "░░      \n"
        "██░░    \n"
        "████░░  \n"
        "██████░░\n");
  // Downsampled: 4096 / 128 = 32 tiles per side, 8 cells of 4 x 4 tiles.
  const BlockMask big = create_block_mask(causal, 1, 1, 4096, 4096, o);
  CHECK(big.to_string(8, 8) ==
        "BlockMask(nb=1, nh=1, q_len=4096, kv_len=4096, tile=128x128, tiles=32x32, "
        "sparsity=48.44%, one cell = 4x4 tiles)\n"
        "░░              \n"
        "██░░            \n"
        "████░░          \n"
        "██████░░        \n"
        "████████░░      \n"
        "██████████░░    \n"
        "████████████░░  \n"
        "██████████████░░\n");
  // Several heads, at most max_heads shown.
  const Variant h = Variant::from_strings("score", "h == 0 || kv_idx == 0", {}, {}, "h0");
  const BlockMask hm = create_block_mask(h, 1, 3, 256, 256, o);
  CHECK(hm.to_string(32, 32, 2) ==
        "BlockMask(nb=1, nh=3, q_len=256, kv_len=256, tile=128x128, tiles=2x2, "
        "sparsity=33.33%)\n"
        "(b=0, h=0)\n"
        "████\n"
        "████\n"
        "(b=0, h=1)\n"
        "░░  \n"
        "░░  \n"
        "...\n");
}

TEST_CASE("edge tiles: elements past the lengths never count", "[blockmask]") {
  // kv_idx < 100 is true on every in-range element of a 100-long kv axis: one full tile.
  const Variant v = Variant::from_strings("score", "kv_idx < 100", {}, {}, "edge");
  BlockMaskOptions o;
  o.device = BuildDevice::Cpu;
  const BlockMask m = create_block_mask(v, 1, 1, 130, 100, o);
  CHECK(m.count(TileKind::Full) == 2);
  CHECK(m.count(TileKind::Partial) == 0);
  const BlockMask one = create_block_mask(Variant::from_catalogue("causal"), 1, 1, 1, 1, o);
  CHECK(one.count(TileKind::Full) == 1);
}

TEST_CASE("params and captures: values, defaults and errors", "[blockmask]") {
  const Variant w = Variant::from_catalogue("sliding_window");
  BlockMaskOptions o;
  o.device = BuildDevice::Cpu;
  o.params["window"] = 128;
  const BlockMask m = create_block_mask(w, 1, 1, 1024, 1024, o);
  CHECK(m.count(TileKind::Full) == 0);  // a 128-wide window covers no whole 128 x 128 tile
  CHECK(m.count(TileKind::Partial) == 8 + 7);
  o.params["window"] = 129;
  CHECK(create_block_mask(w, 1, 1, 1024, 1024, o).count(TileKind::Full) == 0);
  o.params["window"] = 256;
  CHECK(create_block_mask(w, 1, 1, 1024, 1024, o).count(TileKind::Full) == 7);

  auto error_of = [](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  BlockMaskOptions bad;
  bad.params["windw"] = 3;
  CHECK_THAT(
      error_of([&] { create_block_mask(w, 1, 1, 64, 64, bad); }),
      Catch::Contains("declares no param 'windw'") && Catch::Contains("did you mean 'window'"));
  bad.params.clear();
  bad.params["window"] = 2.5;
  CHECK_THAT(error_of([&] { create_block_mask(w, 1, 1, 64, 64, bad); }),
             Catch::Contains("param 'window' is an int"));
  CHECK_THAT(error_of([&] { create_block_mask(w, 1, 1, 0, 64); }),
             Catch::Contains("q_len = 0 is not in [1,"));
  BlockMaskOptions tile0;
  tile0.kv_tile = 0;
  CHECK_THAT(error_of([&] { create_block_mask(w, 1, 1, 8, 8, tile0); }),
             Catch::Contains("kv_tile = 0"));

  const Variant d = Variant::from_catalogue("document");
  CHECK_THAT(error_of([&] { create_block_mask(d, 1, 1, 64, 64); }),
             Catch::Contains("mask_mod reads capture 'doc'"));
  std::vector<int32_t> ids(64, 0);
  BlockMaskOptions wrong;
  wrong.captures["doc"] = CaptureData{ids.data(), nullptr, {63}, {}};
  CHECK_THAT(error_of([&] { create_block_mask(d, 1, 1, 64, 64, wrong); }),
             Catch::Contains("capture 'doc' has shape [63]") && Catch::Contains("needs [64]"));
  wrong.captures.clear();
  wrong.captures["dco"] = CaptureData{ids.data(), nullptr, {64}, {}};
  CHECK_THAT(error_of([&] { create_block_mask(d, 1, 1, 64, 64, wrong); }),
             Catch::Contains("no capture 'dco'") && Catch::Contains("did you mean 'doc'"));
  wrong.captures.clear();
  wrong.captures["doc"] = CaptureData{nullptr, nullptr, {64}, {}};
  CHECK_THAT(error_of([&] { create_block_mask(d, 1, 1, 64, 64, wrong); }),
             Catch::Contains("capture 'doc': the host copy is required"));
  // A misaligned device copy would fault in the build kernel: refused up front.
  wrong.captures["doc"] =
      CaptureData{ids.data(), reinterpret_cast<const void*>(uintptr_t(0x10002)), {64}, {}};
  CHECK_THAT(error_of([&] { create_block_mask(d, 1, 1, 64, 64, wrong); }),
             Catch::Contains("capture 'doc': the device copy is not aligned to its 4-byte"));
  // Tile grids past the int32 lists (or int64 products) are refused before anything is built.
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  BlockMaskOptions tile1;
  tile1.device = BuildDevice::Cpu;
  tile1.q_tile = tile1.kv_tile = 1;
  CHECK_THAT(error_of([&] { create_block_mask(w, 1, 1, kMax, kMax, tile1); }),
             Catch::Contains("tiles are too many"));
  // Captures only the score_mod reads are not needed: alibi's slope.
  BlockMaskOptions doc_only;
  doc_only.device = BuildDevice::Cpu;
  doc_only.captures["doc"] = CaptureData{ids.data(), nullptr, {64}, {}};
  const Variant alibi_doc = and_masks(Variant::from_catalogue("alibi"), d);
  CHECK(create_block_mask(alibi_doc, 1, 1, 64, 64, doc_only).count(TileKind::Full) == 1);
}

TEST_CASE("from_kv_blocks: round trip and validation", "[blockmask]") {
  BlockMaskOptions o;
  o.device = BuildDevice::Cpu;
  const BlockMask m =
      create_block_mask(Variant::from_catalogue("causal"), 1, 1, uniform(300, 900), 700, o);
  const BlockMask::Host& h = m.host();
  const BlockMask r = BlockMask::from_kv_blocks(1, 1, m.q_len(), m.kv_len(), 128, 128, h.kv_num,
                                                h.kv_idx, h.full_kv_num, h.full_kv_idx);
  CHECK(same(m, r));
  CHECK(r.stats().device == "none");

  auto error_of = [&](auto num, auto idx, auto fnum, auto fidx) {
    try {
      BlockMask::from_kv_blocks(1, 2, 256, 384, 128, 128, num, idx, fnum, fidx);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  // 1 x 2 x 2 rows of 3 kv tiles.
  std::vector<int32_t> num{1, 0, 2, 0}, idx(12, 0), fnum{0, 1, 0, 0}, fidx(12, 0);
  idx[0] = 2, idx[6] = 0, idx[7] = 1, fidx[3] = 1;
  CHECK(error_of(num, idx, fnum, fidx) == "no error");
  const BlockMask ok = BlockMask::from_kv_blocks(1, 2, 256, 384, 128, 128, num, idx, fnum, fidx);
  CHECK(ok.tile(0, 1, 0, 1) == TileKind::Partial);
  CHECK(ok.tile(0, 0, 1, 1) == TileKind::Full);
  CHECK(ok.host().q_num == std::vector<int32_t>{0, 0, 1, 1, 1, 0});
  CHECK_THAT(error_of(std::vector<int32_t>{1, 0, 2}, idx, fnum, fidx),
             Catch::Contains("kv_num has 3 entries") && Catch::Contains("= 4"));
  CHECK_THAT(error_of(num, std::vector<int32_t>(11, 0), fnum, fidx),
             Catch::Contains("kv_idx has 11 entries") && Catch::Contains("= 12"));
  auto bad = idx;
  bad[7] = 3;
  CHECK_THAT(error_of(num, bad, fnum, fidx),
             Catch::Contains("kv_idx[row 2 (b 0, h 1, q tile 0)][1] = 3 is out of range [0, 3)"));
  bad = idx;
  bad[7] = 0;
  CHECK_THAT(error_of(num, bad, fnum, fidx), Catch::Contains("not ascending"));
  auto badnum = num;
  badnum[1] = 4;
  CHECK_THAT(error_of(badnum, idx, fnum, fidx),
             Catch::Contains("kv_num[row 1") && Catch::Contains("= 4 is not in [0, 3]"));
  auto clash = fidx;
  clash[6] = 1;
  auto clash_num = fnum;
  clash_num[2] = 1;
  CHECK_THAT(
      error_of(num, idx, clash_num, clash),
      Catch::Contains("kv tile 1 of row 2") && Catch::Contains("both as partial and as full"));
  // The same tile-grid guard as create_block_mask: nb * nh * tiles would overflow int64 here.
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  auto huge = [&](int64_t nb, int64_t nh, int64_t q_len, int64_t kv_len, int64_t q_tile,
                  int64_t kv_tile) {
    try {
      BlockMask::from_kv_blocks(nb, nh, q_len, kv_len, q_tile, kv_tile, {}, {});
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK_THAT(huge(kMax, kMax, kMax, kMax, 1, 1),
             Catch::Contains("from_kv_blocks: ") && Catch::Contains("tiles are too many"));
  CHECK_THAT(huge(1, 1, 1 << 20, 1 << 20, 1, 1), Catch::Contains("tiles are too many"));
  CHECK_THAT(huge(1, 1, kMax, 8, 2, 8), Catch::Contains("q_len rounded up to whole tiles"));
}

TEST_CASE("the GPU kernels compile with NVRTC", "[blockmask]") {
  const Variant v = Variant::from_catalogue("document_batched");
  for (const char* entry :
       {"flexc_blockmask_paint", "flexc_blockmask_classify", "flexc_blockmask_lists"}) {
    const jit::Compiled c = jit::compile(v, {"blockmask.cuh", entry, {}, "sm_90"});
    CHECK(!c.cubin.empty());
  }
}

TEST_CASE("GPU builder == CPU reference over the catalogue", "[blockmask][gpu]") {
  if (!flexc::gpu_available()) {
    WARN("no GPU: skipped");
    return;
  }
  for (const std::string& name : Variant::catalogue_names()) {
    const Variant v = Variant::from_catalogue(name);
    auto all = shapes();
    all.push_back({2, 3, uniform(2000, 5000), uniform(2000, 5000), 128, 64});
    for (const Shape& s : all) {
      INFO(describe(name, s));
      Captures caps = random_captures(v, s.B, s.H, s.seq_q(), s.seq_kv());
      BlockMaskOptions o = small_params(v);
      o.captures = caps.data;
      s.apply(o);
      o.device = BuildDevice::Cpu;  // analytic: the CI tests check it against brute force
      const BlockMask ref = create_block_mask(v, s.B, s.H, s.q_len, s.kv_len, o);
      o.device = BuildDevice::Gpu;
      for (bool analytic : {true, false}) {
        o.analytic = analytic;
        const BlockMask gpu = create_block_mask(v, s.B, s.H, s.q_len, s.kv_len, o);
        CHECK(gpu.stats().device == "gpu");
        CHECK(same(gpu, ref));
      }
      // The device view of a CPU-built mask is an upload of the same lists.
      const FlexcBlockMask& view = detail::device_view(ref);
      CHECK(view.num_kv_tiles == ref.num_kv_tiles());
      CHECK(view.kv_num != nullptr);
    }
  }
}
