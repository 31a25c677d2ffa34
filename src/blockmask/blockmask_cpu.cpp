// The BlockMask's host side: tiles classified by the interpreter, and the lists from a verdict
// grid. The CPU builder is the reference the GPU builder is tested against.
#include <fmt/format.h>

#include <algorithm>

#include "blockmask/blockmask_impl.h"
#include "flexc/error.h"

namespace flexc::detail {

constexpr int64_t kProbe = 16;  // probe points per tile side

TileKind classify_tile_cpu(const MaskProblem& p, int64_t b, int64_t h, int64_t qt, int64_t kt,
                           std::vector<dsl::Value>& scratch) {
  const int64_t q0 = qt * p.q_tile, q1 = std::min(q0 + p.q_tile, p.q_len);
  const int64_t k0 = kt * p.kv_tile, k1 = std::min(k0 + p.kv_tile, p.kv_len);
  dsl::EvalEnv env;
  env.ints[static_cast<int>(dsl::Input::B)] = b;
  env.ints[static_cast<int>(dsl::Input::H)] = h;
  env.ints[static_cast<int>(dsl::Input::QLen)] = p.pos.seq_q_len;
  env.ints[static_cast<int>(dsl::Input::KvLen)] = p.pos.seq_kv_len;
  env.params = p.params;
  env.captures = p.captures;
  bool seen_true = false, seen_false = false;
  auto eval = [&](int64_t q, int64_t k) {
    env.ints[static_cast<int>(dsl::Input::QIdx)] = p.pos.q_offset + q;
    env.ints[static_cast<int>(dsl::Input::KvIdx)] = p.pos.kv_offset + k;
    (dsl::evaluate(*p.mask, env, dsl::Precision::F32, scratch).i ? seen_true : seen_false) = true;
    return seen_true && seen_false;
  };
  // A coarse probe over the whole tile first (corners included): a boundary crossing the tile
  // anywhere is usually found within it, before the row-by-row sweep.
  const int64_t pr = std::min<int64_t>(kProbe, q1 - q0), pc = std::min<int64_t>(kProbe, k1 - k0);
  for (int64_t i = 0; i < pr; ++i)
    for (int64_t j = 0; j < pc; ++j)
      if (eval(q0 + (pr > 1 ? i * (q1 - q0 - 1) / (pr - 1) : 0),
               k0 + (pc > 1 ? j * (k1 - k0 - 1) / (pc - 1) : 0)))
        return TileKind::Partial;
  for (int64_t q = q0; q < q1; ++q)
    for (int64_t k = k0; k < k1; ++k)
      if (eval(q, k)) return TileKind::Partial;
  return seen_true ? TileKind::Full : TileKind::Empty;
}

BlockMask::Host lists_from_grid(std::span<const uint8_t> grid, int64_t groups, int64_t nqt,
                                int64_t nkt) {
  BlockMask::Host m;
  const int64_t rows = groups * nqt, cols = groups * nkt;
  m.kv_num.assign(rows, 0);
  m.full_kv_num.assign(rows, 0);
  m.kv_idx.assign(rows * nkt, 0);
  m.full_kv_idx.assign(rows * nkt, 0);
  m.q_num.assign(cols, 0);
  m.full_q_num.assign(cols, 0);
  m.q_idx.assign(cols * nqt, 0);
  m.full_q_idx.assign(cols * nqt, 0);
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t qt = 0; qt < nqt; ++qt) {
      const int64_t row = g * nqt + qt;
      for (int64_t kt = 0; kt < nkt; ++kt) {
        const auto kind = static_cast<TileKind>(grid[row * nkt + kt]);
        if (kind == TileKind::Empty) continue;
        const bool full = kind == TileKind::Full;
        const int64_t col = g * nkt + kt;
        (full ? m.full_kv_idx : m.kv_idx)[row * nkt + (full ? m.full_kv_num : m.kv_num)[row]++] =
            int32_t(kt);
        (full ? m.full_q_idx : m.q_idx)[col * nqt + (full ? m.full_q_num : m.q_num)[col]++] =
            int32_t(qt);
      }
    }
  return m;
}

TileKeptCounter::TileKeptCounter(const MaskProblem& p) : p_(p) {
  env_.ints[static_cast<int>(dsl::Input::QLen)] = p.pos.seq_q_len;
  env_.ints[static_cast<int>(dsl::Input::KvLen)] = p.pos.seq_kv_len;
  env_.params = p.params;
  env_.captures = p.captures;
}

double TileKeptCounter::kept(const BlockMask& bm, int64_t b, int64_t h, int64_t qt, int64_t kt) {
  const int64_t q0 = qt * p_.q_tile, q1 = std::min(p_.q_len, q0 + p_.q_tile);
  const int64_t k0 = kt * p_.kv_tile, k1 = std::min(p_.kv_len, k0 + p_.kv_tile);
  const TileKind kind = bm.tile(b, h, qt, kt);
  if (kind != TileKind::Partial) return kind == TileKind::Full ? double(q1 - q0) * (k1 - k0) : 0;
  env_.ints[static_cast<int>(dsl::Input::B)] = b;
  env_.ints[static_cast<int>(dsl::Input::H)] = h;
  double kept = 0;
  for (int64_t q = q0; q < q1; ++q)
    for (int64_t k = k0; k < k1; ++k) {
      env_.ints[static_cast<int>(dsl::Input::QIdx)] = p_.pos.q_offset + q;
      env_.ints[static_cast<int>(dsl::Input::KvIdx)] = p_.pos.kv_offset + k;
      kept += dsl::evaluate(*p_.mask, env_, dsl::Precision::F32, scratch_).i != 0;
    }
  return kept;
}

}  // namespace flexc::detail

namespace flexc {

double mask_density(const Variant& v, const BlockMask& bm, int64_t B, int64_t H,
                    const BlockMaskOptions& opts) {
  const detail::MaskProblem p = detail::resolve_problem(v, B, H, bm.q_len(), bm.kv_len(), opts);
  if (p.nb != bm.nb() || p.nh != bm.nh() || p.q_tile != bm.q_tile() || p.kv_tile != bm.kv_tile() ||
      p.pos.q_offset != bm.q_offset() || p.pos.kv_offset != bm.kv_offset() ||
      p.pos.seq_q_len != bm.seq_q_len() || p.pos.seq_kv_len != bm.seq_kv_len())
    throw Error(fmt::format(
        "mask_density: the BlockMask ({} x {} groups, {} x {} tiles) was not built for '{}' with "
        "B {}, H {} and these options",
        bm.nb(), bm.nh(), bm.q_tile(), bm.kv_tile(), p.variant_name, B, H));
  if (p.q_len == 0 || p.kv_len == 0) return 0.0;
  detail::TileKeptCounter counter(p);
  double kept = 0;  // over one batch and head of each broadcast group, which weigh the same
  for (int64_t b = 0; b < p.nb; ++b)
    for (int64_t h = 0; h < p.nh; ++h)
      for (int64_t qt = 0; qt < p.nqt; ++qt)
        for (int64_t kt = 0; kt < p.nkt; ++kt) kept += counter.kept(bm, b, h, qt, kt);
  return kept / (double(p.nb * p.nh) * double(p.q_len) * double(p.kv_len));
}

}  // namespace flexc
