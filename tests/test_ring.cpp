// Ring attention's schedule (src/ring/plan.cpp): which shard pairs each rank computes per step,
// which K/V sends are needed, and the balance of the work, against counts worked out by hand.
#include <algorithm>
#include <catch2/catch.hpp>
#include <numeric>

#include "flexc/device.h"
#include "flexc/error.h"
#include "flexc/ring.h"

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
