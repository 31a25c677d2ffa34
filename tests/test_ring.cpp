// Ring attention's schedule (src/ring/plan.cpp): which shard pairs each rank computes per step,
// which K/V (and, in the backward, dK / dV) sends are needed, and the balance of the work,
// against counts worked out by hand; flexc::RingAttention's argument checks; and on two GPUs,
// ring attention against the float64 reference.
#include <fmt/format.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <limits>
#include <map>
#include <optional>
#include <mutex>
#include <numeric>
#include <thread>

#include "flexc/device.h"
#include "flexc/error.h"
#include "flexc/reference.h"
#include "flexc/ring.h"
#include "test_tensors.h"

using namespace flexc;

namespace {

int64_t total(const std::vector<int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), int64_t(0));
}

}  // namespace

TEST_CASE("a ring without a mask computes every shard pair once and sends every shard on",
          "[ring]") {
  const RingPlan plan = plan_ring(Variant::from_catalogue("noop"),
                                  {.ranks = 4, .seq_len = 4 * 256, .batch = 2, .q_heads = 4,
                                   .kv_heads = 2, .head_dim = 64,
                                   .sharding = Sharding::Contiguous});
  REQUIRE(plan.steps.size() == 4);
  CHECK(plan.chunk_len == 256);
  CHECK(plan.computed_blocks == 16);
  CHECK(plan.skipped_blocks == 0);
  CHECK(plan.skipped_sends == 0);
  for (size_t t = 0; t < 4; ++t)
    for (int64_t r = 0; r < 4; ++r) {
      const RingBlock& b = plan.steps[t].blocks[r];
      CHECK(b.kv_rank == (r - int64_t(t) + 4) % 4);
      CHECK(b.full_tiles == 2 * 4 * 2 * 2);  // B x Hq x (256 / 128)^2
      CHECK(b.partial_tiles == 0);
      CHECK(b.density == 1.0);
    }
  // A shard of k and v: 2 x B 2 x Hkv 2 x 256 tokens x D 64 x 2 bytes, four per step but the last.
  CHECK(plan.steps[0].sends == 4);
  CHECK(plan.steps[0].bytes_sent == 4 * 2 * 2 * 2 * 256 * 64 * 2);
  CHECK(plan.steps[3].sends == 0);
  CHECK(plan.imbalance == 1.0);
}

TEST_CASE("causal: contiguous shards skip the upper pairs, zigzag shards balance the work",
          "[ring]") {
  const Variant causal = Variant::from_catalogue("causal");
  const int64_t n = 4, tile = 128;
  // Contiguous: rank r needs the shards of ranks <= r; at step t it holds shard r - t, so it
  // computes while t <= r: 10 of 16 blocks. Shard s is needed by ranks s .. 3, so it travels
  // 3 - s hops: 6 of 12 sends.
  const RingPlan contiguous = plan_ring(
      causal, {.ranks = n, .seq_len = n * 2 * tile, .sharding = Sharding::Contiguous});
  CHECK(contiguous.computed_blocks == 10);
  CHECK(contiguous.skipped_blocks == 6);
  CHECK(contiguous.skipped_sends == 6);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t r = 0; r < n; ++r) {
      INFO("step " << t << " rank " << r);
      const RingBlock& b = contiguous.steps[t].blocks[r];
      CHECK(b.computes() == (t <= r));
      if (t == 0) CHECK(b.partial_tiles == 2);  // the diagonal tiles of the 2 x 2 block
      if (t > 0 && t <= r) CHECK(b.full_tiles == 4);
    }
  // Tile row i of the causal mask holds i + 1 tiles; rank r has rows 2r and 2r + 1: 4r + 3 of
  // the 36 tiles (a mean of 9).
  CHECK(contiguous.rank_tiles == std::vector<int64_t>{3, 7, 11, 15});
  CHECK(contiguous.imbalance == Approx(15.0 / 9.0));

  // Zigzag: rank r holds chunks (one tile row each) r and 7 - r: (r + 1) + (8 - r) = 9 tiles.
  const RingPlan zigzag =
      plan_ring(causal, {.ranks = n, .seq_len = n * 2 * tile, .sharding = Sharding::Zigzag});
  CHECK(zigzag.chunks[0] == std::vector<int64_t>{0, 7});
  CHECK(zigzag.chunks[3] == std::vector<int64_t>{3, 4});
  CHECK(total(zigzag.rank_tiles) == total(contiguous.rank_tiles));
  for (int64_t r = 0; r < n; ++r) CHECK(zigzag.rank_tiles[r] == 9);
  CHECK(zigzag.imbalance == 1.0);
  CHECK(zigzag.skipped_blocks == 0);  // every pair of zigzag shards holds some causal work
  // The kept elements are the causal triangle's: S (S + 1) / 2.
  const double kept =
      std::accumulate(zigzag.rank_elements.begin(), zigzag.rank_elements.end(), 0.0);
  CHECK(kept == 1024.0 * 1025.0 / 2.0);
}

TEST_CASE("a sliding window's ring skips the pairs beyond the window and their sends", "[ring]") {
  // A window of 256 tokens over 8 contiguous shards of 512: rank r needs shards r and r - 1 only.
  RingPlanOptions opts;
  opts.params["window"] = 256;
  const RingPlan plan =
      plan_ring(Variant::from_catalogue("sliding_window"),
                {.ranks = 8, .seq_len = 8 * 512, .sharding = Sharding::Contiguous}, opts);
  CHECK(plan.computed_blocks == 8 + 7);
  for (size_t t = 2; t < plan.steps.size(); ++t)
    for (const RingBlock& b : plan.steps[t].blocks) CHECK_FALSE(b.computes());
  // Each shard is sent once (to the next rank), except the last rank's.
  CHECK(plan.steps[0].sends == 7);
  for (size_t t = 1; t < plan.steps.size(); ++t) CHECK(plan.steps[t].sends == 0);
  // Which rank passes its shard on: ranks 0..6 after step 0 (rank 7's shard, chunk 7, is needed
  // by no later rank: rank 0 holds chunk 0), none later.
  CHECK(plan.steps[0].passes ==
        std::vector<bool>{true, true, true, true, true, true, true, false});
  for (const RingStep& step : plan.steps) {
    CHECK(step.passes.size() == 8);
    CHECK(std::count(step.passes.begin(), step.passes.end(), true) == step.sends);
  }
}

TEST_CASE("the backward's dK / dV travel with their K/V and return to their owner once", "[ring]") {
  // Every rank that holds a shard from step 1 on passes its dK / dV on with the K/V or, where
  // they stop, back to the owner; a shard that leaves its owner comes back exactly once, and
  // every block computed away from the owner is on that path.
  RingPlanOptions window;
  window.params["window"] = 300;
  window.send_cost_bytes = 0;  // rows whenever fewer: the sends this test is about
  const struct {
    const char* variant;
    RingShape shape;
    RingPlanOptions opts;
  } plans[] = {
      {"causal", {.ranks = 8, .seq_len = 8 * 2 * 128}, {}},
      {"noop", {.ranks = 4, .seq_len = 4 * 2 * 128}, {}},
      {"causal", {.ranks = 2, .seq_len = 512, .sharding = Sharding::Contiguous}, {}},
      {"sliding_window", {.ranks = 4, .seq_len = 4 * 256, .sharding = Sharding::Contiguous},
       window},
  };
  for (const auto& c : plans) {
    INFO(c.variant << " over " << c.shape.ranks << " ranks");
    const Variant variant = Variant::from_catalogue(c.variant);
    const RingPlan plan = plan_ring(variant, c.shape, c.opts);
    const int64_t n = c.shape.ranks, per_rank = plan.chunks[0].size();
    const int64_t chunk_bytes =
        c.shape.batch * c.shape.kv_heads * plan.chunk_len * (c.shape.head_dim * 2) * 4;
    // Whether rank r's queries touch chunk kc (index in shard s) of shard s: from the whole
    // sequence's BlockMask, tile by tile.
    BlockMaskOptions bmo;
    bmo.params = c.opts.params;
    bmo.device = BuildDevice::Cpu;
    const BlockMask bm = create_block_mask(variant, c.shape.batch, c.shape.q_heads, c.shape.seq_len,
                                           c.shape.seq_len, bmo);
    const int64_t tiles = plan.chunk_len / 128;
    const auto touches = [&](int64_t r, int64_t s, int64_t kc) {
      for (int64_t qc : plan.chunks[r])
        for (int64_t b = 0; b < c.shape.batch; ++b)
          for (int64_t h = 0; h < c.shape.q_heads; ++h)
            for (int64_t qt = qc * tiles; qt < (qc + 1) * tiles; ++qt)
              for (int64_t kt = plan.chunks[s][kc] * tiles; kt < (plan.chunks[s][kc] + 1) * tiles;
                   ++kt)
                if (bm.tile(b, h, qt, kt) != TileKind::Empty) return true;
      return false;
    };
    std::vector<int64_t> returns(n, 0);
    std::vector<bool> holds(n, true);
    // By rank: the chunks of the dK / dV copy it holds that some holder touched.
    std::vector<std::vector<bool>> live(n, std::vector<bool>(per_rank, false));
    for (int64_t t = 0; t < n; ++t) {
      const RingStep& step = plan.steps[t];
      int64_t sends = 0, chunks_sent = 0;
      std::vector<std::vector<bool>> next_live(n, std::vector<bool>(per_rank, false));
      for (int64_t r = 0; r < n; ++r) {
        const int64_t shard = (r - t + n) % n, to = step.grad_to[r];
        if (t == 0 || !holds[r]) {
          CHECK(to == -1);
          CHECK((!step.blocks[r].computes() || t == 0));
          continue;
        }
        // Chunks sent: those touched so far; the last block's chunk (the highest this rank
        // touches: its blocks run K/V chunk by K/V chunk) last, after grad_early others.
        int64_t last = -1;
        for (int64_t kc = 0; kc < per_rank; ++kc)
          if (touches(r, shard, kc)) live[r][kc] = true, last = kc;
        std::vector<int64_t> want;
        for (int64_t kc = 0; kc < per_rank; ++kc)
          if (live[r][kc] && kc != last) want.push_back(kc);
        CHECK(step.grad_early[r] == int64_t(want.size()));
        if (last >= 0) want.push_back(last);
        CHECK(step.grad_chunks[r] == want);
        if (want.empty()) {
          CHECK(to == -1);
          continue;
        }
        ++sends, chunks_sent += int64_t(want.size());
        if (step.passes[r]) {
          CHECK(to == (r + 1) % n);
          next_live[(r + 1) % n] = live[r];
        } else {
          CHECK(to == shard);
          ++returns[shard];
        }
      }
      CHECK(step.grad_sends == sends);
      CHECK(step.grad_bytes_sent == chunks_sent * chunk_bytes);
      live = next_live;
      std::vector<bool> next(n, false);
      for (int64_t r = 0; r < n; ++r) next[(r + 1) % n] = holds[r] && step.passes[r];
      holds = next;
    }
    for (int64_t s = 0; s < n; ++s) CHECK(returns[s] <= (plan.steps[0].passes[s] ? 1 : 0));
  }
  // Causal zigzag over 2 ranks, step 1: rank 0 (queries 0, 3) touches both of rank 1's chunks
  // (1, 2) from query chunk 3 and sends chunk 1 while chunk 2's block runs; rank 1 (queries 1,
  // 2) touches rank 0's chunk 0 only, and sends it alone.
  const RingPlan zz =
      plan_ring(Variant::from_catalogue("causal"), {.ranks = 2, .seq_len = 4 * 256});
  CHECK(zz.steps[1].grad_chunks == std::vector<std::vector<int64_t>>{{0, 1}, {0}});
  CHECK(zz.steps[1].grad_early == std::vector<int64_t>{1, 0});
  // Contiguous causal over 2 ranks: rank 0's shard visits rank 1 and comes back; rank 1's
  // stays (rank 0 needs none of its keys).
  const RingPlan two = plan_ring(Variant::from_catalogue("causal"),
                                 {.ranks = 2, .seq_len = 512, .sharding = Sharding::Contiguous});
  CHECK(two.steps[1].grad_to == std::vector<int64_t>{-1, 0});
  CHECK_THAT(to_string(two), Catch::Contains("|     kv 0: 100% | - | 1 x 0.2 MiB"));
}

TEST_CASE("a shard is passed on with only the rows later blocks read", "[ring]") {
  // A 200-token window over 2 contiguous shards of 1024: rank 1's queries [1024, 2048) read
  // keys from 824 on, tiles 6 and 7 of rank 0's shard: rows [768, 1024), a quarter of it.
  RingPlanOptions window;
  window.params["window"] = 200;
  window.send_cost_bytes = 0;  // rows whenever fewer
  const RingShape shape{.ranks = 2, .seq_len = 2048, .batch = 2, .q_heads = 4, .kv_heads = 2,
                        .head_dim = 64, .sharding = Sharding::Contiguous};
  const Variant sliding = Variant::from_catalogue("sliding_window");
  const RingPlan plan = plan_ring(sliding, shape, window);
  using Rows = std::vector<std::pair<int64_t, int64_t>>;
  CHECK(plan.steps[0].rows_sent == Rows{{768, 1024}, {0, 0}});
  CHECK(plan.steps[0].bytes_sent == 2 * 2 * 256 * (64 + 64) * 2);
  CHECK(plan.steps[1].rows_sent == Rows{{0, 0}, {0, 0}});
  // The backward: rank 1 returns rank 0's dK / dV of those rows only (float32).
  CHECK(plan.steps[1].grad_to == std::vector<int64_t>{-1, 0});
  CHECK(plan.steps[1].grad_rows == Rows{{0, 0}, {768, 1024}});
  CHECK(plan.steps[1].grad_bytes_sent == 2 * 2 * 256 * (64 + 64) * 4);
  // At the default send cost the 768 rows left out (768 KiB of K and V over the 4 (batch,
  // head)s) do not pay for 6 more sends: the shard goes whole (one send for K, one for V).
  window.send_cost_bytes = RingPlanOptions{}.send_cost_bytes;
  const RingPlan small = plan_ring(sliding, shape, window);
  CHECK(small.steps[0].rows_sent == Rows{{0, 1024}, {0, 0}});
  CHECK(small.steps[1].grad_rows == Rows{{0, 0}, {0, 1024}});
  // One (batch, head): rows take as many sends as the whole, so they always go as rows; the
  // returned dK / dV would take two sends instead of one, not worth 768 KiB.
  const RingPlan one_head = plan_ring(
      sliding, {.ranks = 2, .seq_len = 2048, .head_dim = 64, .sharding = Sharding::Contiguous},
      window);
  CHECK(one_head.steps[0].rows_sent == Rows{{768, 1024}, {0, 0}});
  CHECK(one_head.steps[1].grad_rows == Rows{{0, 0}, {0, 1024}});
  // Shards of 16384, 16 heads, D 128: a 2000-token window's rows [14336, 16384) leave out 112
  // MiB of K / V for 30 more sends, which pays; a 9000-token window's rows [7296, 16384) 57 MiB,
  // which does not (1.9 MiB a send), but 114 MiB of float32 dK / dV for 31, which does.
  const RingShape big{.ranks = 2, .seq_len = 32768, .q_heads = 16, .kv_heads = 16,
                      .sharding = Sharding::Contiguous};
  window.params["window"] = 2000;
  const RingPlan narrow = plan_ring(sliding, big, window);
  CHECK(narrow.steps[0].rows_sent == Rows{{14336, 16384}, {0, 0}});
  CHECK(narrow.steps[1].grad_rows == Rows{{0, 0}, {14336, 16384}});
  window.params["window"] = 9000;
  const RingPlan wide = plan_ring(sliding, big, window);
  CHECK(wide.steps[0].rows_sent == Rows{{0, 16384}, {0, 0}});
  CHECK(wide.steps[1].grad_rows == Rows{{0, 0}, {7296, 16384}});
  // Causal, zigzag, 4 ranks of 8k tokens, 16 heads: a rank's first chunk alone is read at some
  // steps; half a shard left out (32 MiB for 30 more sends) does not pay (measured:
  // docs/perf.md).
  const RingShape causal_shape{.ranks = 4, .seq_len = 32768, .q_heads = 16, .kv_heads = 16};
  const Variant causal = Variant::from_catalogue("causal");
  for (const RingStep& step : plan_ring(causal, causal_shape).steps)
    for (const auto& rows : step.rows_sent) CHECK((rows.first == 0 && rows.second % 8192 == 0));
  RingPlanOptions always;
  always.send_cost_bytes = 0;
  bool trimmed = false;
  for (const RingStep& step : plan_ring(causal, causal_shape, always).steps)
    for (const auto& rows : step.rows_sent) trimmed |= rows.second - rows.first == 4096;
  CHECK(trimmed);
  // No mask: every row, every shard.
  const RingPlan noop = plan_ring(Variant::from_catalogue("noop"),
                                  {.ranks = 4, .seq_len = 4 * 256, .sharding = Sharding::Zigzag},
                                  always);
  for (int64_t r = 0; r < 4; ++r) CHECK(noop.steps[0].rows_sent[r] == std::make_pair(0L, 256L));
  // A negative cost is refused by name.
  always.send_cost_bytes = -1;
  CHECK_THROWS_WITH(plan_ring(causal, causal_shape, always),
                    Catch::Contains("send_cost_bytes must be >= 0"));
}

TEST_CASE("the rows passed on cover every later read, shrinking along the ring", "[ring]") {
  // For masks and rank counts the 2-GPU tests cannot reach: every rank that computes with a
  // shard it received has every tile it reads within the rows it received, a rank passes on a
  // subset of what it got, and every returned dK / dV chunk has rows.
  RingPlanOptions window;
  window.params["window"] = 300;
  window.send_cost_bytes = 0;  // rows whenever fewer: the sends this test is about
  RingPlanOptions always;
  always.send_cost_bytes = 0;
  const struct {
    const char* variant;
    RingPlanOptions opts;
  } masks[] = {{"causal", always}, {"sliding_window", window}, {"noop", always}};
  for (const auto& m : masks)
    for (int64_t n : {2, 3, 4, 8})
      for (Sharding sh : {Sharding::Zigzag, Sharding::Contiguous}) {
        const int64_t per = sh == Sharding::Zigzag ? 2 : 1, chunk = 1024;
        const RingShape shape{.ranks = n, .seq_len = n * per * chunk, .sharding = sh};
        INFO(m.variant << " over " << n << (per == 2 ? " zigzag" : " contiguous"));
        const Variant v = Variant::from_catalogue(m.variant);
        const RingPlan plan = plan_ring(v, shape, m.opts);
        BlockMaskOptions bmo;
        bmo.params = m.opts.params;
        bmo.device = BuildDevice::Cpu;
        const BlockMask bm = create_block_mask(v, 1, 1, shape.seq_len, shape.seq_len, bmo);
        const int64_t tiles = chunk / 128, L = per * chunk;
        // The shard-local rows [first, last) of shard s that rank r's queries read.
        const auto reads = [&](int64_t r, int64_t s) {
          std::pair<int64_t, int64_t> rows{L, 0};
          for (int64_t qc : plan.chunks[r])
            for (int64_t kc = 0; kc < per; ++kc)
              for (int64_t qt = qc * tiles; qt < (qc + 1) * tiles; ++qt)
                for (int64_t i = 0; i < tiles; ++i)
                  if (bm.tile(0, 0, qt, plan.chunks[s][kc] * tiles + i) != TileKind::Empty) {
                    rows.first = std::min(rows.first, (kc * tiles + i) * 128);
                    rows.second = std::max(rows.second, (kc * tiles + i + 1) * 128);
                  }
          return rows;
        };
        for (int64_t t = 1; t < n; ++t)
          for (int64_t r = 0; r < n; ++r) {
            const int64_t prev = (r - 1 + n) % n, s = (r - t + n) % n;
            const RingStep& step = plan.steps[t];
            if (!plan.steps[t - 1].passes[prev]) continue;  // r holds nothing at step t
            const auto got = plan.steps[t - 1].rows_sent[prev];
            const auto need = reads(r, s);
            if (need.second > 0) {
              CHECK(got.first <= need.first);
              CHECK(need.second <= got.second);
            }
            if (t + 1 < n && step.passes[r]) {
              CHECK(got.first <= step.rows_sent[r].first);
              CHECK(step.rows_sent[r].second <= got.second);
            }
            for (int64_t c : step.grad_chunks[r])
              CHECK(std::min(step.grad_rows[r].second, (c + 1) * chunk) >
                    std::max(step.grad_rows[r].first, c * chunk));
          }
      }
}

TEST_CASE("shard_rows cuts a rank's chunks out of the whole sequence, unshard_rows puts them back",
          "[ring]") {
  // Two (batch, head) rows of 8 tokens, d = 2: element = 100 * bh + 10 * token + column.
  std::vector<int> whole;
  for (int bh = 0; bh < 2; ++bh)
    for (int t = 0; t < 8; ++t)
      for (int c = 0; c < 2; ++c) whole.push_back(100 * bh + 10 * t + c);
  RingPlanOptions tiles_of_2;
  tiles_of_2.tile = 2;
  const RingPlan zigzag = plan_ring(Variant::from_catalogue("causal"),
                                    {.ranks = 2, .seq_len = 8, .head_dim = 2}, tiles_of_2);
  // Rank 1 holds chunks 1 and 2 (tokens 2-5) of each (batch, head).
  CHECK(shard_rows(zigzag, 1, whole, 2, 2) ==
        std::vector<int>{20, 21, 30, 31, 40, 41, 50, 51, 120, 121, 130, 131, 140, 141, 150, 151});
  const RingPlan contiguous =
      plan_ring(Variant::from_catalogue("causal"),
                {.ranks = 2, .seq_len = 8, .head_dim = 2, .sharding = Sharding::Contiguous},
                tiles_of_2);
  CHECK(shard_rows(contiguous, 1, whole, 2, 2) ==
        std::vector<int>{40, 41, 50, 51, 60, 61, 70, 71, 140, 141, 150, 151, 160, 161, 170, 171});
  for (const RingPlan* plan : {&zigzag, &contiguous}) {
    std::vector<int> back(whole.size(), -1);
    for (int64_t r = 0; r < 2; ++r)
      unshard_rows(*plan, r, shard_rows(*plan, r, whole, 2, 2), back, 2, 2);
    CHECK(back == whole);
  }
}

TEST_CASE("plan_ring names a bad field", "[ring]") {
  const Variant causal = Variant::from_catalogue("causal");
  CHECK_THROWS_WITH(plan_ring(causal, {.ranks = 0, .seq_len = 1024}),
                    Catch::Contains("ranks must be >= 1; got 0"));
  CHECK_THROWS_WITH(plan_ring(causal, {.ranks = 4, .seq_len = 1000}),
                    Catch::Contains("seq_len 1000 must be a multiple of 8 chunks (4 ranks, zigzag) "
                                    "x 128-token tiles = 1024"));
  CHECK_THROWS_WITH(plan_ring(causal, {.ranks = 2, .seq_len = 512, .q_heads = 6, .kv_heads = 4}),
                    Catch::Contains("q_heads 6 is not a multiple of kv_heads 4"));
  CHECK_THROWS_WITH(plan_ring(causal, {.ranks = 2, .seq_len = 1 << 30, .batch = int64_t(1) << 40,
                                       .q_heads = 1 << 20}),
                    Catch::Contains("too large to count"));
  CHECK_THROWS_WITH(plan_ring(causal, {.ranks = int64_t(1) << 40, .seq_len = 1024}),
                    Catch::Contains("must be a multiple of"));
  RingPlanOptions typo;
  typo.params["windw"] = 3;
  CHECK_THROWS_WITH(
      plan_ring(Variant::from_catalogue("sliding_window"), {.ranks = 2, .seq_len = 512}, typo),
      Catch::Contains("windw"));
}

TEST_CASE("a ring plan prints its steps, ranks and balance", "[ring]") {
  const RingPlan plan = plan_ring(Variant::from_catalogue("causal"),
                                  {.ranks = 2, .seq_len = 512, .sharding = Sharding::Contiguous});
  const std::string s = to_string(plan);
  CHECK_THAT(s, Catch::Contains("ring plan: 2 ranks, contiguous sharding, 512 tokens in chunks "
                                "of 256 (tiles of 128)"));
  CHECK_THAT(s, Catch::Contains("kv 1: -"));
  CHECK_THAT(s, Catch::Contains("rank 1: chunks 1, 7 tiles"));
  CHECK_THAT(s, Catch::Contains("blocks computed 3 of 4, skipped 1; sends skipped 1 of 2"));
}

TEST_CASE("RingAttention names a bad argument before any communication", "[ring]") {
  const Variant causal = Variant::from_catalogue("causal");
  const RingShape shape{.ranks = 2, .seq_len = 2048, .batch = 1, .q_heads = 4, .kv_heads = 2,
                        .head_dim = 64};
  CHECK_THROWS_WITH(RingAttention(causal, nullptr, shape),
                    Catch::Contains("flexc::RingAttention: comm is null"));
  RingShape fp32 = shape;
  fp32.dtype = DType::F32;
  CHECK_THROWS_WITH(RingAttention(causal, nullptr, fp32),
                    Catch::Contains("shape.dtype must be bf16 or fp16; got float32"));
  RingShape odd = shape;
  odd.seq_len = 1000;  // zigzag over 2 ranks: 4 chunks of whole 128-token tiles
  CHECK_THROWS_WITH(RingAttention(causal, nullptr, odd),
                    Catch::Contains("seq_len 1000 must be a multiple of 4 chunks"));
  // A ring of this process's GPUs needs as many of them.
  CHECK_THROWS_WITH(LocalCommunicators(flexc::device_count() + 1),
                    Catch::Contains("need as many CUDA devices"));
}

// ---- [gpu] on two GPUs: flexc::RingAttention against the float64 reference on the whole sequence

namespace {

using flexc::testing::download16;
using flexc::testing::normal;
using flexc::testing::random_capture;
using flexc::testing::upload16;

// One ring case on comms.size() GPUs (a thread per rank), twice over (the second call of each
// kind reuses the first's buffers: backward twice, forward after backward): random whole-sequence
// q, k, v, dout and captures; out, LSE and every gradient (float captures' summed over the ranks)
// from outputs poisoned with NaN, checked against the float64 reference. Returns the blocks the
// ranks computed and skipped in the last call.
RingStats check_ring_case(const Variant& v, const RingShape& shape, LocalCommunicators& comms,
                          std::optional<bool> deterministic) {
  const int n = comms.size();
  const DType dt = shape.dtype;
  const int64_t B = shape.batch, Hq = shape.q_heads, Hkv = shape.kv_heads, S = shape.seq_len,
                D = shape.head_dim, L = S / n;
  const std::vector<float> q = normal(size_t(B * Hq * S * D), dt),
                           k = normal(size_t(B * Hkv * S * D), dt), val = normal(k.size(), dt),
                           dout = normal(q.size(), dt);
  std::vector<npy::Array> caps;
  caps.reserve(v.captures().size());
  RingPlanOptions popts;
  // Rows whenever fewer: at these small shapes the default cost sends every shard whole, and
  // the per-(batch, head) row sends and returns are what needs checking.
  popts.send_cost_bytes = 0;
  ReferenceBackwardProblem rp;
  ReferenceProblem& fp = rp.forward;
  for (const CaptureSpec& cs : v.captures()) {
    caps.push_back(random_capture(cs, B, Hq, S, S));
    popts.captures[cs.name] = CaptureData{caps.back().bytes.data(), nullptr, caps.back().shape, {}};
    fp.captures[cs.name] = caps.back().view();
  }
  const RingPlan plan = plan_ring(v, shape, popts);
  const size_t q_shard = q.size() / size_t(n), kv_shard = k.size() / size_t(n);

  std::vector<float> out(q.size()), lse(size_t(B * Hq * S)), dq(q.size()), dk(k.size()),
      dv(k.size());
  std::map<std::string, std::vector<float>, std::less<>> cap_grads;
  for (const npy::Array& a : caps)
    if (a.dtype == DType::F32) cap_grads[v.captures()[&a - caps.data()].name].assign(a.numel(), 0.f);
  std::mutex gathering;
  std::vector<std::string> errors(static_cast<size_t>(n));
  RingStats total;
  auto rank_main = [&](int rank) {
    try {
      use_device(rank);
      const std::vector<float> nan_q(q_shard, std::numeric_limits<float>::quiet_NaN()),
          nan_k(kv_shard, std::numeric_limits<float>::quiet_NaN());
      const DeviceBuffer bk = upload16(dt, shard_rows(plan, rank, k, B * Hkv, D)),
                         bq = upload16(dt, shard_rows(plan, rank, q, B * Hq, D)),
                         bv = upload16(dt, shard_rows(plan, rank, val, B * Hkv, D)),
                         bdo = upload16(dt, shard_rows(plan, rank, dout, B * Hq, D));
      const std::vector<int64_t> qs{B, Hq, L, D}, ks{B, Hkv, L, D};
      const auto view = [&](const DeviceBuffer& b, const std::vector<int64_t>& sh) {
        return TensorView{b.get(), dt, sh, {}};
      };
      std::vector<DeviceBuffer> dcaps;
      std::map<std::string, DeviceBuffer, std::less<>> dgrads;
      dcaps.reserve(caps.size());
      RingForwardOptions fo;
      for (size_t i = 0; i < caps.size(); ++i) {
        dcaps.emplace_back(std::max<size_t>(caps[i].bytes.size(), 16));
        dcaps.back().upload(caps[i].bytes.data(), caps[i].bytes.size());
        fo.captures[v.captures()[i].name] =
            TensorView{dcaps.back().get(), caps[i].dtype, caps[i].shape, {}};
      }
      DeviceBuffer blse(size_t(B * Hq * L) * 4);
      const TensorView tlse{blse.get(), DType::F32, {B, Hq, L}, {}};
      fo.lse = tlse;
      const Stream stream;
      fo.stream = stream.get();
      RingBackwardOptions bwo;
      bwo.captures = fo.captures;
      bwo.stream = stream.get();
      bwo.deterministic = deterministic;
      RingAttention ring(v, comms[rank], shape, popts);
      for (int round = 0; round < 2; ++round) {
        const DeviceBuffer bo = upload16(dt, nan_q), bdq = upload16(dt, nan_q),
                           bdk = upload16(dt, nan_k), bdv = upload16(dt, nan_k);
        AttentionGrads grads{view(bdq, qs), view(bdk, ks), view(bdv, ks), {}};
        for (size_t i = 0; i < caps.size(); ++i) {
          if (caps[i].dtype != DType::F32) continue;
          const std::string& name = v.captures()[i].name;
          DeviceBuffer& g = dgrads[name] = DeviceBuffer(std::max<size_t>(caps[i].bytes.size(), 16));
          g.fill(0);
          grads.captures[name] = TensorView{g.get(), DType::F32, caps[i].shape, {}};
        }
        synchronize_device();
        ring.forward(view(bq, qs), view(bk, ks), view(bv, ks), view(bo, qs), fo);
        ring.backward(view(bq, qs), view(bk, ks), view(bv, ks), view(bo, qs), tlse, view(bdo, qs),
                      grads, bwo);
        stream.synchronize();
        if (round == 0) continue;
        const std::lock_guard<std::mutex> lock(gathering);
        unshard_rows(plan, rank, download16(dt, bo, q_shard), out, B * Hq, D);
        unshard_rows(plan, rank, blse.to_vector<float>(size_t(B * Hq * L)), lse, B * Hq, 1);
        unshard_rows(plan, rank, download16(dt, bdq, q_shard), dq, B * Hq, D);
        unshard_rows(plan, rank, download16(dt, bdk, kv_shard), dk, B * Hkv, D);
        unshard_rows(plan, rank, download16(dt, bdv, kv_shard), dv, B * Hkv, D);
        for (auto& [name, sum] : cap_grads) {
          const std::vector<float> share = dgrads.at(name).to_vector<float>(sum.size());
          for (size_t e = 0; e < sum.size(); ++e) sum[e] += share[e];
        }
        total.blocks_computed += ring.stats().blocks_computed;
        total.blocks_skipped += ring.stats().blocks_skipped;
        total.grad_sends += ring.stats().grad_sends;
      }
    } catch (const std::exception& e) {
      errors[size_t(rank)] = e.what();
      comms.abort();  // the other ranks may wait for this one's sends
    }
  };
  std::vector<std::thread> threads;
  for (int rank = 0; rank < n; ++rank) threads.emplace_back(rank_main, rank);
  for (std::thread& t : threads) t.join();
  std::string failed;
  for (int rank = 0; rank < n; ++rank)
    if (!errors[size_t(rank)].empty()) failed += fmt::format("rank {}: {}\n", rank, errors[size_t(rank)]);
  INFO(failed);
  REQUIRE(failed.empty());

  fp.q = q, fp.k = k, fp.v = val;
  fp.batch = B, fp.q_heads = Hq, fp.kv_heads = Hkv, fp.q_len = fp.kv_len = S;
  fp.head_dim = D, fp.dtype = dt;
  const Accuracy fwd = check_accuracy(reference_attention(v, fp), out, lse);
  INFO("forward: " << fwd.summary());
  CHECK(fwd.pass);
  rp.dout = dout, rp.out = out, rp.lse = lse;
  const ReferenceBackward r = reference_attention_backward(v, rp);
  std::map<std::string, std::span<const float>, std::less<>> checked;
  for (const auto& [name, g] : r.captures) checked[name] = cap_grads.at(name);
  const BackwardAccuracy bwd = check_gradients(r, dq, dk, dv, checked);
  INFO("backward: " << bwd.summary());
  CHECK(bwd.pass);
  return total;
}

}  // namespace

TEST_CASE("ring attention over 2 GPUs: every catalogue variant, forward and backward, against "
          "the reference",
          "[gpu][ring]") {
  if (flexc::device_count() < 2) {
    WARN("fewer than 2 GPUs: skipped");
    return;
  }
  // Per variant one shape: zigzag and contiguous shards, bf16 and fp16, head dims 64 and 128,
  // GQA (4 query heads on 2 kv heads), B 1 and 2, dq by atomics or deterministic.
  const std::vector<std::string> names = Variant::catalogue_names();
  REQUIRE(names.size() >= 10);
  LocalCommunicators comms(2);
  for (size_t vi = 0; vi < names.size(); ++vi) {
    const RingShape shape{.ranks = 2, .seq_len = 1024, .batch = vi % 3 == 0 ? 2 : 1,
                          .q_heads = 4, .kv_heads = 2, .head_dim = vi / 2 % 2 ? 128 : 64,
                          .dtype = (vi + vi / 2) % 2 ? DType::F16 : DType::BF16,
                          .sharding = vi % 2 ? Sharding::Contiguous : Sharding::Zigzag};
    INFO(names[vi] << ": " << (vi % 2 ? "contiguous" : "zigzag") << ", "
                   << dtype_name(shape.dtype) << ", B " << shape.batch << ", D "
                   << shape.head_dim);
    const RingStats st = check_ring_case(Variant::from_catalogue(names[vi]), shape, comms,
                                         vi % 3 == 1 ? std::optional<bool>(true) : std::nullopt);
    CHECK(st.blocks_computed > 0);
  }
}

TEST_CASE("ring attention over 4 GPUs: dK / dV passed on and returned early, skipped blocks",
          "[gpu][ring]") {
  if (flexc::device_count() < 4) {
    WARN("fewer than 4 GPUs: skipped");
    return;
  }
  // Four ranks run what two cannot: dK / dV copies passed on to a third rank, and shards whose
  // travel ends before the last step (the catalogue's 1024-token window over contiguous shards
  // of 512: a shard visits the next two ranks, then its gradient returns).
  LocalCommunicators comms(4);
  const struct {
    const char* variant;
    Sharding sharding;
    bool skips;
  } cases[] = {{"noop", Sharding::Zigzag, false},
               {"causal", Sharding::Zigzag, true},
               {"causal", Sharding::Contiguous, true},
               {"sliding_window", Sharding::Contiguous, true},
               {"sliding_window", Sharding::Zigzag, true}};
  for (const auto& c : cases) {
    const RingShape shape{.ranks = 4, .seq_len = 2048, .batch = 1, .q_heads = 4, .kv_heads = 2,
                          .head_dim = 64, .sharding = c.sharding};
    INFO(c.variant << ", " << (c.sharding == Sharding::Zigzag ? "zigzag" : "contiguous"));
    const RingStats st = check_ring_case(Variant::from_catalogue(c.variant), shape, comms, {});
    CHECK((st.blocks_skipped > 0) == c.skips);
  }
}
