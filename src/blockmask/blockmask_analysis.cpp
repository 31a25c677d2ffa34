// The BlockMask's build problem (validated inputs) and its interval analysis: boxes of tiles are
// decided by dsl::interval_verdict, so the cost follows the mask's boundary, not its area.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <deque>
#include <limits>

#include "attention/attention_args.h"
#include "blockmask/blockmask_impl.h"
#include "flexc/error.h"
#include "variant_impl.h"

namespace flexc::detail {
namespace {

[[noreturn]] void fail(const MaskProblem& p, const std::string& msg) {
  throw Error(fmt::format("create_block_mask for '{}': {}", p.variant_name, msg));
}

void resolve_captures(MaskProblem& p, const VariantImpl& impl, const BlockMaskOptions& opts,
                      std::string_view what) {
  for (const auto& [name, c] : opts.captures) check_capture_name(impl, name, what);
  const auto& decls = p.decls->captures;
  p.captures.resize(decls.size());
  p.capture_shapes.resize(decls.size());
  p.device_captures.resize(decls.size());
  for (uint16_t slot : p.read_captures) {
    const dsl::CaptureDecl& d = decls[slot];
    auto it = opts.captures.find(d.name);
    if (it == opts.captures.end())
      fail(p, fmt::format("mask_mod reads capture '{}': pass it in BlockMaskOptions::captures",
                          d.name));
    const CaptureData& c = it->second;
    if (!c.host)
      fail(p,
           fmt::format("capture '{}': the host copy is required (the analysis reads it)", d.name));
    // The device copy is optional (null passes); when given, it is what must be aligned.
    const TensorView device{const_cast<void*>(c.device), from_dsl(d.dtype), c.shape, c.strides};
    check_capture(d, device, CallDims{p.B, p.H, p.pos.seq_q_len, p.pos.seq_kv_len}, what,
                  "the device copy");
    p.captures[slot] = dsl::HostTensor{d.dtype, c.host, c.shape, c.strides};
    p.capture_shapes[slot] = c.shape;
    p.device_captures[slot] = device;
  }
}

}  // namespace

MaskProblem resolve_problem(const Variant& v, int64_t B, int64_t H, int64_t q_len, int64_t kv_len,
                            const BlockMaskOptions& opts) {
  const VariantImpl& impl = detail::impl_of(v);
  MaskProblem p;
  p.variant = &v;
  p.mask = &impl.mask.graph;
  p.decls = &impl.decls;
  p.variant_name = impl.name;
  p.B = B, p.H = H, p.q_len = q_len, p.kv_len = kv_len;
  p.q_tile = opts.q_tile, p.kv_tile = opts.kv_tile;
  const std::string what = fmt::format("create_block_mask for '{}'", p.variant_name);
  check_geometry(what, {{"B", B},
                        {"H", H},
                        {"q_len", q_len},
                        {"kv_len", kv_len},
                        {"q_tile", p.q_tile},
                        {"kv_tile", p.kv_tile}});
  p.pos = resolve_positions(what, q_len, kv_len, opts.q_offset, opts.kv_offset, opts.seq_q_len,
                            opts.seq_kv_len, std::numeric_limits<int32_t>::max());
  p.nqt = (q_len + p.q_tile - 1) / p.q_tile;
  p.nkt = (kv_len + p.kv_tile - 1) / p.kv_tile;

  const dsl::Deps deps = dsl::dependencies(*p.mask, p.mask->root);
  p.nb = deps.reads(dsl::Input::B) ? B : 1;
  p.nh = deps.reads(dsl::Input::H) ? H : 1;
  check_tile_grid(what, p.nb, p.nh, q_len, kv_len, p.q_tile, p.kv_tile);
  check_mask_bytes(what, p.groups(), p.nqt, p.nkt, opts.max_bytes);
  p.read_captures = deps.captures;
  p.params = resolve_params(impl, opts.params, what);
  resolve_captures(p, impl, opts, what);
  return p;
}

CaptureRanges::CaptureRanges(const dsl::HostTensor& t) : t_(t), shape_(t.shape) {
  strides_ = t.strides;
  if (strides_.empty()) {
    strides_.assign(shape_.size(), 1);
    for (size_t i = shape_.size() - 1; i-- > 0;) strides_[i] = strides_[i + 1] * shape_[i + 1];
  }
  n_ = shape_.back();
  rows_ = 1;
  for (size_t i = 0; i + 1 < shape_.size(); ++i) rows_ *= shape_[i];
  nblocks_ = (n_ + kBlock - 1) / kBlock;
  nsuper_ = (nblocks_ + kBlock - 1) / kBlock;
  levels_ = std::bit_width(static_cast<uint64_t>(nsuper_));
  base_.resize(rows_);
  nan_.assign(rows_, 0);
  bmin_.resize(rows_ * nblocks_);
  bmax_.resize(rows_ * nblocks_);
  smin_.resize(levels_ * rows_ * nsuper_);
  smax_.resize(smin_.size());
  for (int64_t r = 0; r < rows_; ++r) {
    int64_t rest = r;
    for (size_t i = shape_.size() - 1; i-- > 0;) {
      base_[r] += rest % shape_[i] * strides_[i];
      rest /= shape_[i];
    }
    for (int64_t blk = 0; blk < nblocks_; ++blk) {
      auto [lo, hi] = scan(r, blk * kBlock, std::min(n_, (blk + 1) * kBlock) - 1);
      if (std::isnan(lo) || std::isnan(hi)) nan_[r] = 1;
      bmin_[r * nblocks_ + blk] = lo;
      bmax_[r * nblocks_ + blk] = hi;
    }
    for (int64_t sb = 0; sb < nsuper_; ++sb) {
      const int64_t b0 = sb * kBlock, b1 = std::min(nblocks_, b0 + kBlock);
      const int64_t i = at(0, r, sb), j = r * nblocks_;
      smin_[i] = *std::min_element(bmin_.data() + j + b0, bmin_.data() + j + b1);
      smax_[i] = *std::max_element(bmax_.data() + j + b0, bmax_.data() + j + b1);
    }
  }
  for (int lvl = 1; lvl < levels_; ++lvl)
    for (int64_t r = 0; r < rows_; ++r)
      for (int64_t sb = 0; sb + (int64_t(1) << lvl) <= nsuper_; ++sb) {
        const int64_t a = at(lvl - 1, r, sb), b = at(lvl - 1, r, sb + (int64_t(1) << (lvl - 1)));
        smin_[at(lvl, r, sb)] = std::min(smin_[a], smin_[b]);
        smax_[at(lvl, r, sb)] = std::max(smax_[a], smax_[b]);
      }
}

std::optional<std::pair<double, double>> CaptureRanges::query(
    std::span<const dsl::IntRange> idx) const {
  // The rows the box covers: the product of the leading ranges (bounded, else unknown).
  const size_t lead = idx.size() - 1;
  int64_t nrows = 1;
  for (size_t i = 0; i < lead; ++i) nrows *= idx[i].hi - idx[i].lo + 1;
  if (nrows > kMaxRows) return std::nullopt;
  std::array<int64_t, dsl::kMaxArgs> cur{};
  for (size_t i = 0; i < lead; ++i) cur[i] = idx[i].lo;
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  for (int64_t k = 0; k < nrows; ++k) {
    int64_t r = 0;
    for (size_t i = 0; i < lead; ++i) r = r * shape_[i] + cur[i];
    if (nan_[r]) return std::nullopt;
    auto [a, b] = row_range(r, idx[lead].lo, idx[lead].hi);
    lo = std::min(lo, a);
    hi = std::max(hi, b);
    for (size_t i = lead; i-- > 0;) {  // next combination, last leading dim fastest
      if (++cur[i] <= idx[i].hi) break;
      cur[i] = idx[i].lo;
    }
  }
  return std::pair{lo, hi};
}

std::pair<double, double> CaptureRanges::scan(int64_t r, int64_t lo, int64_t hi) const {
  auto minmax = [&](const auto* data, auto convert) {
    const int64_t s = strides_.back();
    double mn = std::numeric_limits<double>::infinity(), mx = -mn;
    for (int64_t j = lo; j <= hi; ++j) {
      const double x = convert(data[base_[r] + j * s]);
      if (std::isnan(x)) return std::pair{x, x};
      mn = std::min(mn, x);
      mx = std::max(mx, x);
    }
    return std::pair{mn, mx};
  };
  auto same = [](auto x) { return double(x); };
  switch (t_.dtype) {
    case dsl::DType::I32:
      return minmax(static_cast<const int32_t*>(t_.data), same);
    case dsl::DType::F32:
      return minmax(static_cast<const float*>(t_.data), same);
    case dsl::DType::BF16:
      return minmax(static_cast<const uint16_t*>(t_.data),
                    [](uint16_t x) { return double(bf16_to_float(x)); });
    case dsl::DType::F16:
      return minmax(static_cast<const uint16_t*>(t_.data),
                    [](uint16_t x) { return double(fp16_to_float(x)); });
    case dsl::DType::Bool:
      return minmax(static_cast<const uint8_t*>(t_.data), [](uint8_t x) { return x ? 1.0 : 0.0; });
  }
  return {0, 0};
}

std::pair<double, double> CaptureRanges::scan_blocks(int64_t r, int64_t b0, int64_t b1) const {
  const int64_t j = r * nblocks_;
  return {*std::min_element(bmin_.data() + j + b0, bmin_.data() + j + b1),
          *std::max_element(bmax_.data() + j + b0, bmax_.data() + j + b1)};
}

std::pair<double, double> CaptureRanges::row_range(int64_t r, int64_t lo, int64_t hi) const {
  double mn = std::numeric_limits<double>::infinity(), mx = -mn;
  auto add = [&](std::pair<double, double> p) {
    mn = std::min(mn, p.first);
    mx = std::max(mx, p.second);
  };
  const int64_t b0 = (lo + kBlock - 1) / kBlock, b1 = (hi + 1) / kBlock;  // whole blocks
  if (b0 >= b1) {
    add(scan(r, lo, hi));
    return {mn, mx};
  }
  if (lo < b0 * kBlock) add(scan(r, lo, b0 * kBlock - 1));
  if (hi >= b1 * kBlock) add(scan(r, b1 * kBlock, hi));
  const int64_t s0 = (b0 + kBlock - 1) / kBlock, s1 = b1 / kBlock;  // whole superblocks
  if (s0 >= s1) {
    add(scan_blocks(r, b0, b1));
    return {mn, mx};
  }
  if (b0 < s0 * kBlock) add(scan_blocks(r, b0, s0 * kBlock));
  if (b1 > s1 * kBlock) add(scan_blocks(r, s1 * kBlock, b1));
  const int lvl = std::bit_width(static_cast<uint64_t>(s1 - s0)) - 1;
  const int64_t a = at(lvl, r, s0), b = at(lvl, r, s1 - (int64_t(1) << lvl));
  add({std::min(smin_[a], smin_[b]), std::max(smax_[a], smax_[b])});
  return {mn, mx};
}

Analysis analyse(const MaskProblem& p, int64_t leaf_tiles, int64_t max_boxes) {
  std::vector<std::optional<CaptureRanges>> ranges(p.captures.size());
  for (uint16_t slot : p.read_captures) ranges[slot].emplace(p.captures[slot]);

  dsl::IntervalEnv env;
  env.q_len = p.pos.seq_q_len;
  env.kv_len = p.pos.seq_kv_len;
  env.params = p.params;
  env.capture_shapes = p.capture_shapes;
  env.capture_range =
      [&](uint16_t slot,
          std::span<const dsl::IntRange> idx) -> std::optional<std::pair<double, double>> {
    if (slot >= ranges.size() || !ranges[slot]) return std::nullopt;
    return ranges[slot]->query(idx);
  };

  Analysis a;
  dsl::IntervalEvaluator evaluator(*p.mask, p.mask->root);
  auto verdict = [&](const TileBox& x) {
    env.b = {x.b0, x.b1 - 1};
    env.h = {x.h0, x.h1 - 1};
    const int64_t q0 = p.pos.q_offset, k0 = p.pos.kv_offset;
    env.q_idx = {q0 + x.q0 * p.q_tile, q0 + std::min(x.q1 * p.q_tile, p.q_len) - 1};
    env.kv_idx = {k0 + x.k0 * p.kv_tile, k0 + std::min(x.k1 * p.kv_tile, p.kv_len) - 1};
    ++a.boxes;
    return evaluator.verdict(env);
  };

  // Breadth first, so that a spent budget leaves coarse boxes, not a lopsided tree.
  std::deque<TileBox> todo{
      TileBox{0, int32_t(p.nb), 0, int32_t(p.nh), 0, int32_t(p.nqt), 0, int32_t(p.nkt)}};
  while (!todo.empty()) {
    const TileBox x = todo.front();
    todo.pop_front();
    const dsl::Verdict v = a.boxes < max_boxes ? verdict(x) : dsl::Verdict::Unknown;
    if (v != dsl::Verdict::Unknown) {
      if (v == dsl::Verdict::AlwaysTrue) a.full.push_back(x);
      a.decided_tiles += x.area();
      continue;
    }
    if (x.area() <= leaf_tiles || a.boxes >= max_boxes) {
      a.undecided.push_back(x);
      continue;
    }
    const bool spatial = x.q1 - x.q0 > 1 || x.k1 - x.k0 > 1;
    bool split_bh = (x.b1 - x.b0) * (x.h1 - x.h0) > 1;
    // Over several batches / heads: if one of them alone is decided, the spread over b / h is
    // what keeps the box undecided, so halve that rather than the tiles.
    if (split_bh && spatial)
      split_bh = verdict(TileBox{x.b0, x.b0 + 1, x.h0, x.h0 + 1, x.q0, x.q1, x.k0, x.k1}) !=
                 dsl::Verdict::Unknown;
    if (split_bh) {
      TileBox lo = x, hi = x;
      if (x.b1 - x.b0 > 1)
        lo.b1 = hi.b0 = x.b0 + (x.b1 - x.b0) / 2;
      else
        lo.h1 = hi.h0 = x.h0 + (x.h1 - x.h0) / 2;
      todo.push_back(lo);
      todo.push_back(hi);
      continue;
    }
    const int32_t qm = x.q1 - x.q0 > 1 ? x.q0 + (x.q1 - x.q0) / 2 : x.q1;
    const int32_t km = x.k1 - x.k0 > 1 ? x.k0 + (x.k1 - x.k0) / 2 : x.k1;
    for (auto [q0, q1] : {std::pair{x.q0, qm}, {qm, x.q1}})
      for (auto [k0, k1] : {std::pair{x.k0, km}, {km, x.k1}})
        if (q0 < q1 && k0 < k1) todo.push_back(TileBox{x.b0, x.b1, x.h0, x.h1, q0, q1, k0, k1});
  }
  return a;
}

Analysis no_analysis(const MaskProblem& p) {
  Analysis a;
  a.undecided.push_back(
      TileBox{0, int32_t(p.nb), 0, int32_t(p.nh), 0, int32_t(p.nqt), 0, int32_t(p.nkt)});
  return a;
}

}  // namespace flexc::detail
