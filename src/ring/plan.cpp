// flexc::plan_ring: ring attention's schedule from the BlockMask of the whole sequence.
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <utility>

#include "blockmask/blockmask_impl.h"
#include "flexc/error.h"
#include "flexc/ring.h"

namespace flexc {
namespace {

constexpr const char* kWhat = "plan_ring";
// (batch, head)s past which a shard is sent whole: a send of K and of V rows each, and as many
// receives, in one NCCL group, which NCCL limits to 2048 operations.
constexpr int64_t kMaxRowSends = 256;
// Whether rows go as a send per (batch, head) of each of two tensors (K and V; dK and dV of a
// chunk) rather than whole: where the bytes they leave out (`saved`) pay for the extra sends
// (`extra`, at RingPlanOptions::send_cost_bytes each), and NCCL's group can take them.
bool rows_pay(int64_t saved, int64_t extra, int64_t heads, int64_t send_cost) {
  if (heads > kMaxRowSends || saved <= 0) return false;
  return extra <= 0 || saved / extra > send_cost;
}

void check_shape(const RingShape& s, int64_t tile, int64_t send_cost) {
  const auto positive = [](const char* name, int64_t v) {
    if (v < 1) throw Error(fmt::format("{}: {} must be >= 1; got {}", kWhat, name, v));
  };
  positive("ranks", s.ranks);
  positive("seq_len", s.seq_len);
  positive("batch", s.batch);
  positive("q_heads", s.q_heads);
  positive("kv_heads", s.kv_heads);
  positive("head_dim", s.head_dim);
  if (s.v_head_dim < 0)
    throw Error(fmt::format("{}: v_head_dim must be >= 0; got {}", kWhat, s.v_head_dim));
  positive("tile", tile);
  if (send_cost < 0)
    throw Error(fmt::format("{}: send_cost_bytes must be >= 0; got {}", kWhat, send_cost));
  if (s.q_heads % s.kv_heads != 0)
    throw Error(fmt::format("{}: q_heads {} is not a multiple of kv_heads {}", kWhat, s.q_heads,
                            s.kv_heads));
  // Counts are int64: the tiles of all batches and heads, and a shard's bytes, must fit.
  const double tiles_per_side = double(s.seq_len) / double(tile);
  if (double(s.batch) * double(s.q_heads) * tiles_per_side * tiles_per_side > 0x1p62 ||
      2.0 * double(s.batch) * double(s.kv_heads) * double(s.seq_len) *
              double(s.head_dim + std::max<int64_t>(s.v_head_dim, s.head_dim)) >
          0x1p62)
    throw Error(
        fmt::format("{}: B {} x {} heads over {} tokens is too large to count (tiles or "
                    "K/V bytes past 2^62)",
                    kWhat, s.batch, s.q_heads, s.seq_len));
  const int64_t per_rank = s.sharding == Sharding::Zigzag ? 2 : 1;
  int64_t chunks = 0, unit = 0;
  if (__builtin_mul_overflow(s.ranks, per_rank, &chunks) ||
      __builtin_mul_overflow(chunks, tile, &unit) || s.seq_len % unit != 0)
    throw Error(fmt::format(
        "{}: seq_len {} must be a multiple of {} chunks ({} ranks, {}) x {}-token tiles = {}; pad "
        "the sequence",
        kWhat, s.seq_len, double(s.ranks) * per_rank, s.ranks,
        per_rank == 2 ? "zigzag" : "contiguous", tile, double(s.ranks) * per_rank * tile));
}

}  // namespace

RingPlan plan_ring(const Variant& v, const RingShape& shape, const RingPlanOptions& opts) {
  check_shape(shape, opts.tile, opts.send_cost_bytes);
  const int64_t n = shape.ranks;
  const bool zigzag = shape.sharding == Sharding::Zigzag;
  RingPlan plan;
  plan.shape = shape;
  plan.tile = opts.tile;
  const int64_t num_chunks = n * (zigzag ? 2 : 1);
  plan.chunk_len = shape.seq_len / num_chunks;
  std::vector<int64_t> owner(num_chunks);
  for (int64_t c = 0; c < num_chunks; ++c) owner[c] = c < n ? c : 2 * n - 1 - c;
  plan.chunks.resize(n);
  for (int64_t c = 0; c < num_chunks; ++c) plan.chunks[owner[c]].push_back(c);

  BlockMaskOptions bo;
  bo.q_tile = bo.kv_tile = opts.tile;
  bo.params = opts.params;
  bo.captures = opts.captures;
  bo.device = BuildDevice::Cpu;
  const BlockMask bm =
      create_block_mask(v, shape.batch, shape.q_heads, shape.seq_len, shape.seq_len, bo);
  const detail::MaskProblem p =
      detail::resolve_problem(v, shape.batch, shape.q_heads, shape.seq_len, shape.seq_len, bo);
  detail::TileKeptCounter counter(p);

  // Per (query rank, kv rank): tiles and kept elements over all batches and heads (a broadcast
  // group stands for B * H / (nb * nh) of them).
  const int64_t tiles_per_chunk = plan.chunk_len / opts.tile;
  const int64_t copies = shape.batch * shape.q_heads / (p.nb * p.nh);
  std::vector<RingBlock> pair(n * n);
  std::vector<double> kept(n * n, 0.0);
  // Per (query rank, kv rank) and (query chunk, K/V chunk) of their shards: whether it has tiles.
  const int64_t per_rank = zigzag ? 2 : 1;
  std::vector<int64_t> index_in_shard(num_chunks);
  for (int64_t c = 0; c < num_chunks; ++c) index_in_shard[c] = c < n ? 0 : 1;
  std::vector<bool> chunk_pair(n * n * per_rank * per_rank, false);
  // Per (query rank, kv rank): the first and one past the last K/V tile (of the kv shard's)
  // with work.
  std::vector<std::pair<int64_t, int64_t>> kv_tiles(n * n, {INT64_MAX, 0});
  for (int64_t b = 0; b < p.nb; ++b)
    for (int64_t h = 0; h < p.nh; ++h)
      for (int64_t qt = 0; qt < p.nqt; ++qt)
        for (int64_t kt = 0; kt < p.nkt; ++kt) {
          const TileKind kind = bm.tile(b, h, qt, kt);
          if (kind == TileKind::Empty) continue;
          const int64_t qc = qt / tiles_per_chunk, kc = kt / tiles_per_chunk;
          const int64_t at = owner[qc] * n + owner[kc];
          (kind == TileKind::Full ? pair[at].full_tiles : pair[at].partial_tiles) += copies;
          chunk_pair[(at * per_rank + index_in_shard[qc]) * per_rank + index_in_shard[kc]] = true;
          const int64_t local = index_in_shard[kc] * tiles_per_chunk + kt % tiles_per_chunk;
          kv_tiles[at].first = std::min(kv_tiles[at].first, local);
          kv_tiles[at].second = std::max(kv_tiles[at].second, local + 1);
          kept[at] += double(copies) * counter.kept(bm, b, h, qt, kt);
        }
  const int64_t shard = shape.seq_len / n;
  const double block_elements = double(shape.batch * shape.q_heads) * double(shard) * shard;
  for (int64_t at = 0; at < n * n; ++at) {
    pair[at].kv_rank = at % n;
    pair[at].density = kept[at] / block_elements;
  }

  // Step t: rank r holds shard (r - t) mod n. After step t it passes that shard to rank r + 1,
  // which is worth it only if one of the ranks the shard still visits computes with it.
  const int64_t dv = shape.v_head_dim ? shape.v_head_dim : shape.head_dim;
  const int64_t shard_bytes = shape.batch * shape.kv_heads * shard * (shape.head_dim + dv) *
                              int64_t(dtype_size(shape.dtype));
  const int64_t chunk_grad_bytes =
      shape.batch * shape.kv_heads * plan.chunk_len * (shape.head_dim + dv) * 4;
  // A row of a (batch, head): its K and V, or its float32 dK and dV.
  const int64_t row_bytes = (shape.head_dim + dv) * int64_t(dtype_size(shape.dtype));
  const int64_t grad_row_bytes = (shape.head_dim + dv) * 4;
  // Whether rank r's blocks against shard s touch the shard's K/V chunk c.
  const auto touches = [&](int64_t r, int64_t s, int64_t c) {
    for (int64_t a = 0; a < per_rank; ++a)
      if (chunk_pair[((r * n + s) * per_rank + a) * per_rank + c]) return true;
    return false;
  };
  plan.rank_tiles.assign(n, 0);
  plan.rank_elements.assign(n, 0.0);
  std::vector<bool> holds(n, true);  // by rank: it holds its shard at step t (step 0: its own)
  // By rank: the chunks of its travelling dK / dV copy that some holder touched (none at step 0).
  std::vector<std::vector<bool>> live(n, std::vector<bool>(per_rank, false));
  std::vector<std::pair<int64_t, int64_t>> live_tiles(n, {INT64_MAX, 0});  // and their tiles
  for (int64_t t = 0; t < n; ++t) {
    RingStep step;
    step.grad_to.assign(n, -1);
    step.grad_chunks.assign(n, {});
    step.grad_early.assign(n, 0);
    step.grad_rows.assign(n, {0, 0});
    for (int64_t r = 0; r < n; ++r) {
      const int64_t s = (r - t + n) % n;
      const RingBlock& blk = pair[r * n + s];
      step.blocks.push_back(blk);
      (blk.computes() ? plan.computed_blocks : plan.skipped_blocks) += 1;
      plan.rank_tiles[r] += blk.full_tiles + blk.partial_tiles;
      plan.rank_elements[r] += kept[r * n + s];
      step.passes.push_back(false);
      step.rows_sent.emplace_back(0, 0);
      if (t + 1 == n) continue;
      // The tiles of the shard the ranks it still visits read.
      std::pair<int64_t, int64_t> tiles{INT64_MAX, 0};
      for (int64_t later = t + 1; later < n; ++later) {
        const int64_t at = ((s + later) % n) * n + s;
        if (!pair[at].computes()) continue;
        tiles.first = std::min(tiles.first, kv_tiles[at].first);
        tiles.second = std::max(tiles.second, kv_tiles[at].second);
      }
      if (tiles.second > 0) {
        step.passes.back() = true;
        // Rows instead of the whole shard: 2 x (B Hkv - 1) more sends.
        const int64_t heads = shape.batch * shape.kv_heads;
        if (!rows_pay((shard - (tiles.second - tiles.first) * opts.tile) * row_bytes * heads,
                      2 * (heads - 1), heads, opts.send_cost_bytes))
          tiles = {0, shard / opts.tile};
        step.rows_sent.back() = {tiles.first * opts.tile, tiles.second * opts.tile};
        ++step.sends;
        step.bytes_sent += shard_bytes / shard * (tiles.second - tiles.first) * opts.tile;
      } else {
        ++plan.skipped_sends;
      }
    }
    // The gradient of the shard a rank holds goes on with the K/V, or home where they stop
    // (the owner keeps step 0's share itself: nothing travels before step 1), with the chunks
    // some holder touched; the chunk of the rank's last block (blocks run K/V chunk by K/V
    // chunk) last, the others while that block runs.
    std::vector<std::vector<bool>> next_live(n, std::vector<bool>(per_rank, false));
    std::vector<std::pair<int64_t, int64_t>> next_tiles(n, {INT64_MAX, 0});
    for (int64_t r = 0; r < n && t > 0; ++r) {
      if (!holds[r]) continue;
      const int64_t s = (r - t + n) % n;
      int64_t last = -1;
      for (int64_t c = 0; c < per_rank; ++c)
        if (touches(r, s, c)) live[r][c] = true, last = c;
      if (pair[r * n + s].computes()) {
        live_tiles[r].first = std::min(live_tiles[r].first, kv_tiles[r * n + s].first);
        live_tiles[r].second = std::max(live_tiles[r].second, kv_tiles[r * n + s].second);
      }
      std::vector<int64_t>& chunks = step.grad_chunks[r];
      for (int64_t c = 0; c < per_rank; ++c)
        if (live[r][c] && c != last) chunks.push_back(c);
      step.grad_early[r] = int64_t(chunks.size());
      if (last >= 0) chunks.push_back(last);
      if (chunks.empty()) continue;
      step.grad_to[r] = step.passes[r] ? (r + 1) % n : s;
      if (step.passes[r]) {
        next_live[(r + 1) % n] = live[r];
        next_tiles[(r + 1) % n] = live_tiles[r];
      }
      // A return carries the touched rows only (a travelling copy whole chunks).
      std::pair<int64_t, int64_t> rows{0, shard};
      const auto [tile0, tile1] = live_tiles[r];
      if (!step.passes[r]) {
        // A chunk sent in part: the rows outside [tile0, tile1) left out, for 2 B Hkv sends
        // (dk and dv of each (batch, head)) instead of one.
        const int64_t heads = shape.batch * shape.kv_heads, r0 = tile0 * opts.tile,
                      r1 = tile1 * opts.tile;
        int64_t saved = 0, extra = 0;
        for (int64_t c : chunks) {
          const int64_t c0 = c * plan.chunk_len;
          const int64_t inside =
              std::max<int64_t>(std::min(r1, c0 + plan.chunk_len) - std::max(r0, c0), 0);
          if (inside == plan.chunk_len) continue;
          saved += (plan.chunk_len - inside) * grad_row_bytes * heads;
          extra += 2 * heads - 1;
        }
        if (rows_pay(saved, extra, heads, opts.send_cost_bytes)) rows = {r0, r1};
      }
      step.grad_rows[r] = rows;
      ++step.grad_sends;
      for (int64_t c : chunks) {
        const int64_t c0 = c * plan.chunk_len;
        const int64_t in_chunk =
            std::min(rows.second, c0 + plan.chunk_len) - std::max(rows.first, c0);
        step.grad_bytes_sent += chunk_grad_bytes / plan.chunk_len * std::max<int64_t>(in_chunk, 0);
      }
    }
    live = std::move(next_live);
    live_tiles = std::move(next_tiles);
    std::vector<bool> next(n, false);
    for (int64_t r = 0; r < n; ++r) next[(r + 1) % n] = holds[r] && step.passes[r];
    holds = std::move(next);
    plan.steps.push_back(std::move(step));
  }
  const int64_t total = std::accumulate(plan.rank_tiles.begin(), plan.rank_tiles.end(), int64_t(0));
  plan.imbalance =
      total > 0
          ? double(*std::max_element(plan.rank_tiles.begin(), plan.rank_tiles.end())) * n / total
          : 1.0;
  return plan;
}

std::string to_string(const RingPlan& plan) {
  const RingShape& s = plan.shape;
  const int64_t n = s.ranks;
  std::string out = fmt::format(
      "ring plan: {} ranks, {} sharding, {} tokens in chunks of {} (tiles of {}), B {}, Hq {}, "
      "Hkv {}, D {}, {}\n",
      n, s.sharding == Sharding::Zigzag ? "zigzag" : "contiguous", s.seq_len, plan.chunk_len,
      plan.tile, s.batch, s.q_heads, s.kv_heads, s.head_dim, dtype_name(s.dtype));
  out += "step";
  for (int64_t r = 0; r < n; ++r) out += fmt::format(" | {:>14}", fmt::format("rank {}", r));
  out += " | K/V sent | dK/dV sent (backward)\n";
  for (size_t t = 0; t < plan.steps.size(); ++t) {
    const RingStep& step = plan.steps[t];
    out += fmt::format("{:>4}", t);
    for (const RingBlock& b : step.blocks)
      out += fmt::format(" | {:>14}",
                         b.computes() ? fmt::format("kv {}: {:.0f}%", b.kv_rank, b.density * 100)
                                      : fmt::format("kv {}: -", b.kv_rank));
    const auto sent = [](int64_t count, int64_t bytes) {
      return count ? fmt::format("{} x {:.1f} MiB", count, double(bytes) / count / (1 << 20))
                   : std::string("-");
    };
    out += fmt::format(" | {} | {}\n", sent(step.sends, step.bytes_sent),
                       sent(step.grad_sends, step.grad_bytes_sent));
  }
  out +=
      "(kv R: X% = the rank computes against rank R's K/V shard, X% of that block kept by the "
      "mask; '-' = nothing to compute, skipped)\n";
  const double total = std::accumulate(plan.rank_elements.begin(), plan.rank_elements.end(), 0.0);
  for (int64_t r = 0; r < n; ++r)
    out += fmt::format("rank {}: chunks {}, {} tiles, {:.4g} elements kept ({:.1f}%)\n", r,
                       fmt::join(plan.chunks[r], ", "), plan.rank_tiles[r], plan.rank_elements[r],
                       total > 0 ? 100 * plan.rank_elements[r] / total : 0.0);
  out += fmt::format(
      "blocks computed {} of {}, skipped {}; sends skipped {} of {}; imbalance {:.3f} (busiest "
      "rank / mean: the ring runs at best {:.2f}x one GPU)\n",
      plan.computed_blocks, n * n, plan.skipped_blocks, plan.skipped_sends, n * (n - 1),
      plan.imbalance, double(n) / plan.imbalance);
  return out;
}

}  // namespace flexc
