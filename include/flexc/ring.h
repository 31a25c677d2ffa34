// flexc::plan_ring: the schedule of ring attention for a variant (which shard pairs each of N
// ranks computes at each ring step, which K/V sends the mask makes unnecessary, and how evenly the
// work spreads), decided by the BlockMask analysis on the CPU. Ring attention itself (the kernels
// over NCCL) builds on it; the plan alone answers "which sharding, how many ranks" for a mask.
//
//   flexc::RingPlan plan = flexc::plan_ring(flexc::Variant::from_catalogue("causal"),
//                                           {.ranks = 8, .seq_len = 1 << 17});
//   std::puts(flexc::to_string(plan).c_str());
//
// The sequence of seq_len tokens (queries and keys alike: self-attention) is cut into chunks:
// `ranks` of them for Sharding::Contiguous (rank r holds chunk r), 2 x `ranks` for
// Sharding::Zigzag (rank r holds chunks r and 2 ranks - 1 - r, which evens out a causal mask's
// work). Every chunk is a whole number of tiles: seq_len must be a multiple of the chunk count
// times the tile size (128 by default); pad the sequence otherwise. Queries stay on their rank;
// at step t (0 .. ranks - 1) rank r holds the K/V shard of rank (r - t) mod ranks, computes its
// queries against it, and then passes it on to rank r + 1. See docs/ring.md.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "flexc/blockmask.h"
#include "flexc/tensor.h"
#include "flexc/variant.h"

namespace flexc {

enum class Sharding { Contiguous, Zigzag };

struct RingShape {
  int64_t ranks = 0;
  int64_t seq_len = 0;  // tokens of the whole sequence
  int64_t batch = 1, q_heads = 1, kv_heads = 1, head_dim = 128;
  DType dtype = DType::BF16;  // of k and v (the bytes a send moves)
  Sharding sharding = Sharding::Zigzag;
};

// One rank at one ring step.
struct RingBlock {
  int64_t kv_rank = 0;        // whose K/V shard it holds
  int64_t full_tiles = 0;     // tiles of its (queries x that shard) block the kernels compute,
  int64_t partial_tiles = 0;  // summed over batches and query heads
  double density = 0;         // fraction of the block's (b, h, q, kv) elements the mask keeps
  bool computes() const { return full_tiles + partial_tiles > 0; }
};

struct RingStep {
  std::vector<RingBlock> blocks;  // by rank
  // K/V shards passed on to the next rank after this step (none after the last) that some later
  // step needs, and their bytes (k and v); a shard no later rank needs is not sent.
  int64_t sends = 0;
  int64_t bytes_sent = 0;
};

struct RingPlan {
  RingShape shape;
  int64_t tile = 0;                                // BlockMask tile size (square)
  int64_t chunk_len = 0;                           // tokens per chunk
  std::vector<std::vector<int64_t>> chunks;        // by rank: its chunks, ascending
  std::vector<RingStep> steps;                     // ranks of them
  // Totals: blocks with any tile to compute, blocks skipped (empty), sends skipped, and per rank
  // the tiles it computes (full and partial alike: a kernel's time) and the elements of them the
  // mask keeps (its FLOPs).
  int64_t computed_blocks = 0, skipped_blocks = 0, skipped_sends = 0;
  std::vector<int64_t> rank_tiles;
  std::vector<double> rank_elements;
  // The busiest rank's tiles over the mean: 1 is a perfect balance, and the ring's speed against
  // one GPU is at best ranks / imbalance.
  double imbalance = 0;
};

struct RingPlanOptions {
  int64_t tile = 128;
  // mask_mod's runtime params and captures, as for create_block_mask (positions index the whole
  // sequence: a Q_LEN or KV_LEN dim is seq_len).
  std::map<std::string, double, std::less<>> params;
  std::map<std::string, CaptureData, std::less<>> captures;
};

// Throws flexc::Error naming the bad field (ranks < 1, a seq_len that is not a multiple of the
// chunk count times the tile, head counts that do not divide, ...) or a mask the BlockMask builder
// refuses.
RingPlan plan_ring(const Variant& v, const RingShape& shape, const RingPlanOptions& opts = {});

// A table: per step the K/V shard each rank holds and its block's tiles ('-' skipped), the
// sends; then per rank its chunks and work, the totals and the imbalance.
std::string to_string(const RingPlan& plan);

}  // namespace flexc
