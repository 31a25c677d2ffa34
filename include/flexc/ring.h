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

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "flexc/attention.h"
#include "flexc/blockmask.h"
#include "flexc/tensor.h"
#include "flexc/variant.h"

struct ncclComm;  // NCCL's communicator: ncclComm_t is `ncclComm*`
struct CUstream_st;

namespace flexc {

enum class Sharding { Contiguous, Zigzag };

struct RingShape {
  int64_t ranks = 0;
  int64_t seq_len = 0;  // tokens of the whole sequence
  int64_t batch = 1, q_heads = 1, kv_heads = 1, head_dim = 128;
  int64_t v_head_dim = 0;     // v's and the output's; 0: head_dim
  DType dtype = DType::BF16;  // of q, k, v and the output (k's and v's: the bytes a send moves)
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
  std::vector<bool> passes;  // by rank: whether it passes its shard on (rank r + 1 receives it)
  // By rank: the rows [first, second) of the shard passed on (of its S / ranks, chunks in
  // order), whole tiles, those some later rank's blocks read (a sliding window's last rows)
  // where that pays (RingPlanOptions::send_cost_bytes), else every row; {0, 0} where nothing is
  // passed.
  std::vector<std::pair<int64_t, int64_t>> rows_sent;
  // The backward's dK / dV (float32): a shard's gradient starts at its owner (step 0's blocks
  // add into it there); from step 1 on, the ranks its K/V visits add theirs into a travelling
  // copy, passed on with the K/V, and the last one returns it to the owner. By rank: where its
  // travelling copy goes after this step (rank r + 1, or the owner), -1 for nowhere; and the
  // count and bytes of those sends. A copy carries only its chunks (RingPlan::chunks of the
  // shard, by index: 0, or 0 and 1 zigzag) that some holder's blocks touched so far: by rank,
  // `grad_chunks` lists them, those whose blocks ended before the rank's last block first (its
  // blocks run K/V chunk by K/V chunk), and the first `grad_early` of them go while that last
  // block runs. A copy no block touched is not sent (grad_to -1).
  std::vector<int64_t> grad_to;
  std::vector<std::vector<int64_t>> grad_chunks;
  std::vector<int64_t> grad_early;
  // By rank: the rows [first, second) of the shard its copy carries within those chunks: where
  // it returns to the owner, the whole tiles some holder touched where that pays
  // (RingPlanOptions::send_cost_bytes; a sliding window's last rows), else every row; {0, 0}
  // where nothing is sent.
  std::vector<std::pair<int64_t, int64_t>> grad_rows;
  int64_t grad_sends = 0;
  int64_t grad_bytes_sent = 0;
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
  // What one more NCCL send costs, in bytes of the peer link. Where later blocks read only some
  // rows of a shard (a sliding window), it goes on as a send per (batch, head) of those rows
  // (of K and of V: 2 (B Hkv - 1) more sends than whole) if the bytes left out exceed that many
  // times this, else whole; likewise a returning dK / dV chunk (2 B Hkv sends instead of 1). The
  // default, ~8 us of a ~250 GB/s NVLink peer link, is measured (docs/perf.md, ring version 5:
  // on 4 H100s 32 sends of 1 MiB rows cost more than the 32 MiB they left out). 0: rows
  // whenever fewer (up to 256 (batch, head)s: NCCL's 2048 operations a group).
  int64_t send_cost_bytes = int64_t(2) << 20;
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

// Rank `rank`'s shard of a whole-sequence tensor in host memory, [BH, seq_len, d] row-major (BH:
// batch x heads): its chunks' rows of every (batch, head), in order, as RingAttention takes them;
// and unshard_rows, the way back (a rank's output rows into the whole). For preparing inputs from
// a whole sequence and gathering outputs (`flexc run --ranks`, the tests).
template <class T>
std::vector<T> shard_rows(const RingPlan& plan, int64_t rank, const std::vector<T>& whole,
                          int64_t bh, int64_t d) {
  const int64_t s = plan.shape.seq_len, len = plan.chunk_len;
  std::vector<T> shard;
  shard.reserve(size_t(bh * (s / plan.shape.ranks) * d));
  for (int64_t i = 0; i < bh; ++i)
    for (int64_t c : plan.chunks.at(size_t(rank))) {
      const auto from = whole.begin() + (i * s + c * len) * d;
      shard.insert(shard.end(), from, from + len * d);
    }
  return shard;
}
template <class T>
void unshard_rows(const RingPlan& plan, int64_t rank, const std::vector<T>& shard,
                  std::vector<T>& whole, int64_t bh, int64_t d) {
  const int64_t s = plan.shape.seq_len, len = plan.chunk_len;
  auto from = shard.begin();
  for (int64_t i = 0; i < bh; ++i)
    for (int64_t c : plan.chunks.at(size_t(rank))) {
      std::copy(from, from + len * d, whole.begin() + (i * s + c * len) * d);
      from += len * d;
    }
}

// ---- Ring attention over NCCL (docs/ring.md)
//
//   flexc::RingAttention ring(variant, comm, {.ranks = 2, .seq_len = 65536, .batch = 1,
//                             .q_heads = 16, .kv_heads = 16, .head_dim = 128});
//   ring.forward(q, k, v, out, {.lse = lse, .stream = stream});   // every step, every call
//
// One rank's side of ring attention of one variant on one communicator (the caller's: from
// torch.distributed, MPI, or ncclCommInitAll in one process; its size is shape.ranks and this
// rank is its rank). Constructing it is collective (every rank of `comm`, the same arguments;
// the shapes are gathered and compared): it plans the ring (plan_ring), builds the BlockMask of
// every (query chunk, K/V chunk) block this rank computes, at the chunks' global positions, and
// keeps them with its buffers for every later call (a training loop constructs it once). The
// current CUDA context must be the communicator's device's.
//
// The rank's shard is its chunks in ascending order (plan().chunks[rank]: chunk r, or chunks r and
// 2 ranks - 1 - r zigzag): q [B, Hq, S / ranks, D], k [B, Hkv, S / ranks, D] and v
// [B, Hkv, S / ranks, Dv] of the sequence's S = shape.seq_len tokens, in shape.dtype. The mods see
// global positions and S, so a variant means what it means on one GPU; captures index the whole
// sequence. RingPlanOptions' params and mask captures are fixed at construction (the BlockMasks
// depend on them). Calls reuse the object's buffers (K/V slots, accumulators): each call is
// ordered after the previous one on its stream, so give every call the same stream, or order
// the streams yourself.
struct RingForwardOptions {
  // Device captures by name over the whole sequence (Q_LEN / KV_LEN dims: seq_len): every
  // capture a mod reads, on this rank's device.
  std::map<std::string, TensorView, std::less<>> captures;
  std::optional<double> scale;     // default 1 / sqrt(D)
  std::optional<TensorView> lse;   // float32 [B, Hq, S / ranks], contiguous: the shard's rows
  CUstream_st* stream = nullptr;   // compute; K/V travel on a stream of the ring's own
  FwdKernel kernel = FwdKernel::Auto;
};

// The backward's options: the forward's captures, scale and kernel choice again.
struct RingBackwardOptions {
  std::map<std::string, TensorView, std::less<>> captures;
  std::optional<double> scale;
  CUstream_st* stream = nullptr;
  FwdKernel kernel = FwdKernel::Auto;
  std::optional<bool> deterministic;  // as BackwardOptions::deterministic, for each block
};

// What this rank did in its last call.
struct RingStats {
  int64_t blocks_computed = 0;  // (query chunk, K/V chunk) attention (or backward) calls
  int64_t blocks_skipped = 0;   // chunk pairs the mask leaves empty, not computed
  int64_t sends = 0, sends_skipped = 0;  // K/V shards passed on, and not (no later rank needs them)
  int64_t grad_sends = 0;  // backward: dK / dV passed on or returned to their owner
};

// NCCL communicators for ranks 0 .. ranks - 1 on this process's CUDA devices 0 .. ranks - 1
// (ncclCommInitAll, through the NCCL flexc loads): one process driving several GPUs, a thread
// per rank calling flexc::use_device(rank) first (`flexc run --ranks`, the tests). A distributed
// job passes its own communicator instead (torch.distributed's, MPI's).
class LocalCommunicators {
 public:
  // Throws flexc::Error when there are fewer devices than ranks, or NCCL is missing or fails.
  explicit LocalCommunicators(int ranks);
  ~LocalCommunicators();
  LocalCommunicators(const LocalCommunicators&) = delete;
  LocalCommunicators& operator=(const LocalCommunicators&) = delete;
  ncclComm* operator[](int rank) const { return comms_.at(size_t(rank)); }
  int size() const { return int(comms_.size()); }
  // Aborts every communicator (ncclCommAbort), ending operations in flight: when one rank's
  // thread fails, the others, waiting for its sends, are released. Safe from any thread, once
  // or more; the communicators are unusable after it.
  void abort();

 private:
  std::vector<ncclComm*> comms_;
  std::atomic<bool> aborted_{false};
};

class RingAttention {
 public:
  // Throws flexc::Error naming the argument: a null or mismatched communicator (its size is not
  // shape.ranks, its device is not the current one), a shape plan_ring refuses, shapes that differ
  // between ranks (naming the first field and rank), NCCL missing.
  RingAttention(const Variant& v, ncclComm* comm, const RingShape& shape,
                const RingPlanOptions& opts = {});
  ~RingAttention();
  RingAttention(RingAttention&&) noexcept;
  RingAttention& operator=(RingAttention&&) noexcept;

  // The shard's output (and LSE) of attention over the whole sequence, every rank calling it
  // with its shard (collective). Enqueued on opts.stream; K/V go around the ring on the ring's
  // stream, overlapped with the blocks; the call returns once everything is enqueued, and work
  // the caller enqueues on opts.stream afterwards runs after all of it. Throws flexc::Error
  // naming the argument for shapes other than the shard's, a dtype other than shape.dtype, ...
  void forward(const TensorView& q, const TensorView& k, const TensorView& v,
               const TensorView& out, const RingForwardOptions& opts = {});

  // The gradients of the shard (collective, every rank with its shard): given the forward's q,
  // k, v, its out and LSE (RingForwardOptions::lse, float32 [B, Hq, S / ranks], contiguous) and
  // dout = dL/dout, writes grads.dq, dk, dv (the shard's shapes, shape.dtype; strides as
  // attention_backward takes them) and adds into grads.captures (float32, the captures' shapes):
  // this rank's share of a capture's gradient, which the ranks sum (an all-reduce, as for any
  // replicated parameter). Needs v_head_dim == head_dim and a head dim the backward kernels take
  // (32, 64, 96, 128); the loss may not read the LSE (no dlse). K/V go around the ring as in the
  // forward; dK / dV follow them in float32 and return to their owner (RingStep::grad_to); dq is
  // summed in float32 here. The first call checks its arguments and allocates its buffers on
  // every rank before any communication (a failure there fails every rank); a later call's bad
  // argument throws on that rank only, after which the others wait in their sends: abort the
  // communicator (ncclCommAbort; LocalCommunicators::abort), as for forward(). Throws
  // flexc::Error naming the argument.
  void backward(const TensorView& q, const TensorView& k, const TensorView& v,
                const TensorView& out, const TensorView& lse, const TensorView& dout,
                const AttentionGrads& grads, const RingBackwardOptions& opts = {});

  const RingPlan& plan() const;
  int64_t rank() const;
  const RingStats& stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace flexc
