// flexc::BlockMask: construction (analytic + CPU or GPU), validation of user lists, inspection.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <limits>

#include "blockmask/blockmask_impl.h"
#include "file_read.h"
#include "flexc/device.h"
#include "flexc/error.h"
#include "jit/abi.h"
#include "jit/jit.h"

namespace flexc {
namespace detail {

void check_geometry(std::string_view what,
                    std::initializer_list<std::pair<const char*, int64_t>> v) {
  constexpr int64_t kMaxInt = std::numeric_limits<int32_t>::max();
  for (auto [name, value] : v)
    if (value < 1 || value > kMaxInt)
      throw Error(fmt::format("{}: {} = {} is not in [1, {}]", what, name, value, kMaxInt));
}

void check_tile_grid(std::string_view what, int64_t nb, int64_t nh, int64_t q_len, int64_t kv_len,
                     int64_t q_tile, int64_t kv_tile) {
  const int64_t nqt = (q_len + q_tile - 1) / q_tile, nkt = (kv_len + kv_tile - 1) / kv_tile;
  check_geometry(what, {{"q_len rounded up to whole tiles", nqt * q_tile},
                        {"kv_len rounded up to whole tiles", nkt * kv_tile}});
  // The lists hold groups * num_q_tiles * num_kv_tiles int32 entries, four times over.
  constexpr int64_t kMaxInt = std::numeric_limits<int32_t>::max();
  int64_t groups = 0, rows = 0, cols = 0, tiles = 0;
  if (__builtin_mul_overflow(nb, nh, &groups) || __builtin_mul_overflow(groups, nqt, &rows) ||
      __builtin_mul_overflow(groups, nkt, &cols) || __builtin_mul_overflow(rows, nkt, &tiles) ||
      rows > kMaxInt || cols > kMaxInt || tiles > (int64_t(1) << 36))
    throw Error(fmt::format("{}: {} x {} x {} x {} tiles are too many; use larger tiles", what, nb,
                            nh, nqt, nkt));
}

void check_mask_bytes(std::string_view what, int64_t groups, int64_t nqt, int64_t nkt,
                      uint64_t max_bytes) {
  const uint64_t limit = max_bytes ? max_bytes : BlockMaskOptions::kDefaultMaxBytes;
  // check_tile_grid bounds tiles by 2^36 and rows / columns by 2^31: no overflow here.
  const auto tiles = static_cast<uint64_t>(groups * nqt * nkt);
  const uint64_t bytes = 17 * tiles + 8 * static_cast<uint64_t>(groups * (nqt + nkt));
  if (bytes > limit)
    throw Error(
        fmt::format("{}: {} groups x {} x {} tiles need {} of lists; the limit is {} "
                    "(BlockMaskOptions::max_bytes); use larger tiles",
                    what, groups, nqt, nkt, human_size(bytes), human_size(limit)));
}

}  // namespace detail

namespace {

using detail::Analysis;
using detail::MaskProblem;
using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

std::shared_ptr<BlockMask::State> new_state(int64_t nb, int64_t nh, int64_t q_len, int64_t kv_len,
                                            int64_t q_tile, int64_t kv_tile) {
  auto s = std::make_shared<BlockMask::State>();
  s->nb = nb, s->nh = nh, s->q_len = q_len, s->kv_len = kv_len;
  s->q_tile = q_tile, s->kv_tile = kv_tile;
  s->nqt = (q_len + q_tile - 1) / q_tile;
  s->nkt = (kv_len + kv_tile - 1) / kv_tile;
  s->stats.tiles = nb * nh * s->nqt * s->nkt;
  s->pos = {0, 0, q_len, kv_len};
  return s;
}

BlockMask::Host build_on_cpu(const MaskProblem& p, const Analysis& a) {
  std::vector<uint8_t> grid(p.tiles(), uint8_t(TileKind::Empty));
  auto at = [&](int64_t b, int64_t h, int64_t qt, int64_t kt) -> uint8_t& {
    return grid[((b * p.nh + h) * p.nqt + qt) * p.nkt + kt];
  };
  auto each_tile = [](const detail::TileBox& x, auto&& f) {
    for (int64_t b = x.b0; b < x.b1; ++b)
      for (int64_t h = x.h0; h < x.h1; ++h)
        for (int64_t qt = x.q0; qt < x.q1; ++qt)
          for (int64_t kt = x.k0; kt < x.k1; ++kt) f(b, h, qt, kt);
  };
  for (const auto& x : a.full)
    each_tile(
        x, [&](auto b, auto h, auto qt, auto kt) { at(b, h, qt, kt) = uint8_t(TileKind::Full); });
  std::vector<dsl::Value> scratch;
  for (const auto& x : a.undecided)
    each_tile(x, [&](auto b, auto h, auto qt, auto kt) {
      at(b, h, qt, kt) = uint8_t(detail::classify_tile_cpu(p, b, h, qt, kt, scratch));
    });
  return detail::lists_from_grid(grid, p.groups(), p.nqt, p.nkt);
}

}  // namespace

BlockMask create_block_mask(const Variant& v, int64_t B, int64_t H, int64_t q_len, int64_t kv_len,
                            const BlockMaskOptions& opts, CUstream_st* stream) {
  const auto t0 = Clock::now();
  const MaskProblem p = detail::resolve_problem(v, B, H, q_len, kv_len, opts);
  const bool gpu = opts.device == BuildDevice::Gpu ||
                   (opts.device == BuildDevice::Auto && flexc::gpu_available());
  if (gpu && !flexc::gpu_available())
    throw Error(fmt::format("create_block_mask for '{}': device = gpu, but no GPU is available",
                            p.variant_name));
  auto s = new_state(p.nb, p.nh, q_len, kv_len, p.q_tile, p.kv_tile);
  s->pos = p.pos;
  const Analysis a =
      !opts.analytic ? detail::no_analysis(p)
      : gpu          ? detail::analyse(p, detail::gpu_leaf_tiles(opts), detail::gpu_box_budget(p))
                     : detail::analyse(p, 1, std::numeric_limits<int64_t>::max());
  BlockMaskStats& st = s->stats;
  st.analysis_ms = ms_since(t0);
  st.device = gpu ? "gpu" : "cpu";
  st.analytic = opts.analytic;
  st.decided_tiles = a.decided_tiles;
  st.boxes = a.boxes;
  for (const auto& x : a.undecided) st.evaluated_tiles += x.area();
  if (gpu)
    s->device = detail::build_on_gpu(p, a, stream);
  else
    s->host = build_on_cpu(p, a);
  st.host_ms = ms_since(t0);
  return detail::BlockMaskAccess::make(std::move(s));
}

BlockMask BlockMask::from_kv_blocks(int64_t nb, int64_t nh, int64_t q_len, int64_t kv_len,
                                    int64_t q_tile, int64_t kv_tile,
                                    std::span<const int32_t> kv_num,
                                    std::span<const int32_t> kv_idx,
                                    std::span<const int32_t> full_kv_num,
                                    std::span<const int32_t> full_kv_idx) {
  constexpr std::string_view what = "BlockMask::from_kv_blocks";
  detail::check_geometry(what, {{"nb", nb},
                                {"nh", nh},
                                {"q_len", q_len},
                                {"kv_len", kv_len},
                                {"q_tile", q_tile},
                                {"kv_tile", kv_tile}});
  detail::check_tile_grid(what, nb, nh, q_len, kv_len, q_tile, kv_tile);
  auto s = new_state(nb, nh, q_len, kv_len, q_tile, kv_tile);
  const int64_t nqt = s->nqt, nkt = s->nkt, rows = nb * nh * nqt;
  auto fail = [&](const std::string& msg) { throw Error(fmt::format("{}: {}", what, msg)); };
  auto check_size = [&](std::string_view name, size_t got, int64_t want) {
    if (int64_t(got) != want)
      fail(fmt::format("{} has {} entries; nb * nh * num_q_tiles{} = {} x {} x {}{} = {}", name,
                       got, name.ends_with("num") ? "" : " * num_kv_tiles", nb, nh, nqt,
                       name.ends_with("num") ? "" : fmt::format(" x {}", nkt), want));
  };
  const bool has_full = !full_kv_num.empty() || !full_kv_idx.empty();
  check_size("kv_num", kv_num.size(), rows);
  check_size("kv_idx", kv_idx.size(), rows * nkt);
  if (has_full) {
    check_size("full_kv_num", full_kv_num.size(), rows);
    check_size("full_kv_idx", full_kv_idx.size(), rows * nkt);
  }
  auto row_name = [&](int64_t row) {
    return fmt::format("row {} (b {}, h {}, q tile {})", row, row / nqt / nh, row / nqt % nh,
                       row % nqt);
  };
  std::vector<uint8_t> grid(rows * nkt, uint8_t(TileKind::Empty));
  // prefix "" or "full_": names the arrays kv_num / kv_idx or full_kv_num / full_kv_idx.
  auto paint = [&](std::string_view prefix, std::span<const int32_t> num,
                   std::span<const int32_t> idx, TileKind kind) {
    for (int64_t row = 0; row < rows; ++row) {
      if (num[row] < 0 || num[row] > nkt)
        fail(fmt::format("{}kv_num[{}] = {} is not in [0, {}]", prefix, row_name(row), num[row],
                         nkt));
      for (int64_t i = 0; i < num[row]; ++i) {
        const int32_t kt = idx[row * nkt + i];
        if (kt < 0 || kt >= nkt)
          fail(fmt::format("{}kv_idx[{}][{}] = {} is out of range [0, {})", prefix, row_name(row),
                           i, kt, nkt));
        if (i > 0 && kt <= idx[row * nkt + i - 1])
          fail(fmt::format("{}kv_idx[{}] is not ascending: entry {} is {} after {}", prefix,
                           row_name(row), i, kt, idx[row * nkt + i - 1]));
        uint8_t& g = grid[row * nkt + kt];
        if (g != uint8_t(TileKind::Empty))
          fail(fmt::format("kv tile {} of {} is listed both as partial and as full", kt,
                           row_name(row)));
        g = uint8_t(kind);
      }
    }
  };
  paint("", kv_num, kv_idx, TileKind::Partial);
  if (has_full) paint("full_", full_kv_num, full_kv_idx, TileKind::Full);
  s->host = detail::lists_from_grid(grid, nb * nh, nqt, nkt);
  return detail::BlockMaskAccess::make(std::move(s));
}

int64_t BlockMask::nb() const { return s_->nb; }
int64_t BlockMask::nh() const { return s_->nh; }
int64_t BlockMask::q_len() const { return s_->q_len; }
int64_t BlockMask::q_offset() const { return s_->pos.q_offset; }
int64_t BlockMask::kv_offset() const { return s_->pos.kv_offset; }
int64_t BlockMask::seq_q_len() const { return s_->pos.seq_q_len; }
int64_t BlockMask::seq_kv_len() const { return s_->pos.seq_kv_len; }
int64_t BlockMask::kv_len() const { return s_->kv_len; }
int64_t BlockMask::q_tile() const { return s_->q_tile; }
int64_t BlockMask::kv_tile() const { return s_->kv_tile; }
int64_t BlockMask::num_q_tiles() const { return s_->nqt; }
int64_t BlockMask::num_kv_tiles() const { return s_->nkt; }
const BlockMaskStats& BlockMask::stats() const { return s_->stats; }

const BlockMask::Host& BlockMask::host() const {
  std::lock_guard lock(s_->mu);
  if (!s_->host) s_->host = detail::download_mask(*s_->device, s_->nb * s_->nh, s_->nqt, s_->nkt);
  return *s_->host;
}

TileKind BlockMask::tile(int64_t b, int64_t h, int64_t qt, int64_t kt) const {
  if (b < 0 || h < 0 || qt < 0 || qt >= s_->nqt || kt < 0 || kt >= s_->nkt)
    throw Error(fmt::format("BlockMask::tile({}, {}, {}, {}): out of range (tiles {} x {})", b, h,
                            qt, kt, s_->nqt, s_->nkt));
  const Host& m = host();
  const int64_t row = ((b % s_->nb) * s_->nh + h % s_->nh) * s_->nqt + qt;
  auto listed = [&](const std::vector<int32_t>& num, const std::vector<int32_t>& idx) {
    const int32_t* first = idx.data() + row * s_->nkt;
    return std::binary_search(first, first + num[row], int32_t(kt));
  };
  if (listed(m.full_kv_num, m.full_kv_idx)) return TileKind::Full;
  if (listed(m.kv_num, m.kv_idx)) return TileKind::Partial;
  return TileKind::Empty;
}

int64_t BlockMask::count(TileKind k) const {
  const Host& m = host();
  auto sum = [](const std::vector<int32_t>& v) {
    int64_t n = 0;
    for (int32_t x : v) n += x;
    return n;
  };
  switch (k) {
    case TileKind::Full:
      return sum(m.full_kv_num);
    case TileKind::Partial:
      return sum(m.kv_num);
    case TileKind::Empty:
      return s_->stats.tiles - sum(m.full_kv_num) - sum(m.kv_num);
  }
  return 0;
}

double BlockMask::sparsity() const {
  return 100.0 * double(count(TileKind::Empty)) / double(s_->stats.tiles);
}

std::string BlockMask::to_string(int64_t max_rows, int64_t max_cols, int64_t max_heads) const {
  const Host& m = host();
  const int64_t nqt = s_->nqt, nkt = s_->nkt;
  const int64_t rstep = (nqt + std::max<int64_t>(max_rows, 1) - 1) / std::max<int64_t>(max_rows, 1);
  const int64_t cstep = (nkt + std::max<int64_t>(max_cols, 1) - 1) / std::max<int64_t>(max_cols, 1);
  std::string out = fmt::format(
      "BlockMask(nb={}, nh={}, q_len={}, kv_len={}, tile={}x{}, tiles={}x{}, sparsity={:.2f}%",
      s_->nb, s_->nh, s_->q_len, s_->kv_len, s_->q_tile, s_->kv_tile, nqt, nkt, sparsity());
  if (rstep > 1 || cstep > 1) out += fmt::format(", one cell = {}x{} tiles", rstep, cstep);
  out += ")\n";
  // Per cell: does it hold a full / a non-full non-empty / an empty tile?
  std::vector<uint8_t> has_full, has_partial, has_empty;
  const int64_t cells = (nkt + cstep - 1) / cstep;
  const int64_t groups = s_->nb * s_->nh;
  for (int64_t g = 0; g < groups; ++g) {
    if (g == max_heads) {
      out += "...\n";
      break;
    }
    if (groups > 1) out += fmt::format("(b={}, h={})\n", g / s_->nh, g % s_->nh);
    for (int64_t r0 = 0; r0 < nqt; r0 += rstep) {
      has_full.assign(cells, 0), has_partial.assign(cells, 0), has_empty.assign(cells, 0);
      for (int64_t qt = r0; qt < std::min(r0 + rstep, nqt); ++qt) {
        const int64_t row = g * nqt + qt;
        std::vector<int64_t> per_cell(cells, 0);  // non-empty tiles in this row, per cell
        for (int64_t i = 0; i < m.full_kv_num[row]; ++i) {
          has_full[m.full_kv_idx[row * nkt + i] / cstep] = 1;
          ++per_cell[m.full_kv_idx[row * nkt + i] / cstep];
        }
        for (int64_t i = 0; i < m.kv_num[row]; ++i) {
          has_partial[m.kv_idx[row * nkt + i] / cstep] = 1;
          ++per_cell[m.kv_idx[row * nkt + i] / cstep];
        }
        for (int64_t c = 0; c < cells; ++c)
          if (per_cell[c] < std::min(cstep, nkt - c * cstep)) has_empty[c] = 1;
      }
      for (int64_t c = 0; c < cells; ++c) {
        const bool all_full = has_full[c] && !has_partial[c] && !has_empty[c];
        const bool all_empty = !has_full[c] && !has_partial[c];
        out += all_full ? "██" : all_empty ? "  " : "░░";
      }
      out += '\n';
    }
  }
  return out;
}

}  // namespace flexc

namespace flexc::detail {

const FlexcBlockMask& device_view(const BlockMask& m, CUstream_st* stream) {
  BlockMask::State& s = detail::BlockMaskAccess::state(m);
  std::lock_guard lock(s.mu);
  if (!s.view) {
    if (!s.device) {
      if (!flexc::gpu_available())
        throw Error("device_view: no GPU is available to hold the BlockMask");
      s.device = upload_mask(*s.host, s.nb * s.nh, s.nqt, s.nkt, stream);
    }
    auto v = std::make_unique<FlexcBlockMask>();
    fill_view(*s.device, *v);
    v->nb = int(s.nb), v->nh = int(s.nh);
    v->num_q_tiles = int(s.nqt), v->num_kv_tiles = int(s.nkt);
    v->q_tile = int(s.q_tile), v->kv_tile = int(s.kv_tile);
    s.view = std::move(v);
  }
  // On every call: each caller's stream must see the lists complete, not only the first's.
  wait_written(*s.device, stream);
  return *s.view;
}

}  // namespace flexc::detail
