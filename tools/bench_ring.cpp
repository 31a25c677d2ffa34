// bench_ring: ring attention (flexc::RingAttention over NCCL, docs/ring.md) on this machine's first
// --ranks GPUs against single-GPU flexc on the whole sequence (issue 14's benchmark): B 1, H 16,
// D 128, --seq-lens tokens in total; no mask and causal (zigzag shards), and a sliding window
// (contiguous shards: its work follows the window, not the sequence). --backward times forward +
// backward instead.
//
//   bench_ring [--ranks 2] [--seq-lens 65536,262144] [--cases noop,causal,sliding_window]
//              [--window 4096] [--reps 5] [--backward] [--json]
//
// Per case: the single GPU's time on the whole sequence (device 0, flexc::attention with the
// whole BlockMask; and attention_backward), the ring's time per call (every rank a thread driving
// its GPU, as `flexc run --ranks` does; per repetition the slowest rank's CUDA-event time from a
// common start, median of --reps after 2 warm-ups), ideal = single / ranks, efficiency =
// ideal / ring, and the busiest rank's blocks alone on one GPU (time_blocks: the ring's compute
// without its communication). TFLOP/s: 4 * B * H * S * S * D * density over the time (3.5 times
// that with --backward, the backward counting 2.5 times the forward as the peers do; the ring's:
// the whole sequence's FLOPs, all GPUs).
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cstdio>
#include <exception>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "bench_util.h"
#include "flexc/attention.h"
#include "flexc/blockmask.h"
#include "flexc/device.h"
#include "flexc/error.h"
#include "flexc/ring.h"
#include "flexc/variant.h"

using namespace flexc;
using flexc_bench::median;
using flexc_bench::random_bits;

namespace {

constexpr int64_t kHeads = 16, kHeadDim = 128;
constexpr int kWarmups = 2;

struct Case {
  std::string name;
  Sharding sharding;
};

// q, k, dout, v (random; k and v apart), out, dq, dk, dv of [1, H, rows, D] and the LSE, on the
// current device.
struct Tensors {
  DeviceBuffer buf, lse_buf;
  std::vector<TensorView> views;  // q, k, dout, v, out, dq, dk, dv
  TensorView lse;
  explicit Tensors(int64_t rows)
      : buf(size_t(8 * kHeads * rows * kHeadDim) * 2), lse_buf(size_t(kHeads * rows) * 4) {
    const size_t n = size_t(kHeads * rows * kHeadDim);
    const std::vector<uint16_t> host = random_bits(4 * n, DType::BF16, std::random_device{}());
    buf.upload(host.data(), host.size() * 2);
    for (size_t i = 0; i < 8; ++i)
      views.push_back({static_cast<uint16_t*>(buf.get()) + i * n, DType::BF16,
                       {1, kHeads, rows, kHeadDim}, {}});
    lse = TensorView{lse_buf.get(), DType::F32, {1, kHeads, rows}, {}};
  }
  const TensorView& q() const { return views[0]; }
  const TensorView& k() const { return views[1]; }
  const TensorView& dout() const { return views[2]; }
  const TensorView& v() const { return views[3]; }
  const TensorView& out() const { return views[4]; }
  AttentionGrads grads() const { return {views[5], views[6], views[7], {}}; }
};

// Single-GPU flexc on the whole sequence, on device 0 (forward, and backward): median ms.
double time_single(const Variant& v, const RingPlanOptions& popts, int64_t S, int reps,
                   bool backward) {
  use_device(0);
  Tensors t(S);
  const Stream stream;
  AttentionOptions ao;
  ao.params = popts.params;
  ao.stream = stream.get();
  ao.lse = t.lse;
  std::optional<BlockMask> bm;
  if (!v.mask_always_true()) {
    BlockMaskOptions bmo;
    bmo.params = popts.params;
    bm = create_block_mask(v, 1, kHeads, S, S, bmo, stream.get());
    ao.block_mask = &*bm;
  }
  BackwardOptions bo;
  bo.block_mask = ao.block_mask;
  bo.params = ao.params;
  bo.stream = stream.get();
  std::vector<double> ms;
  for (int r = 0; r < reps + kWarmups; ++r) {
    EventTimer timer;
    timer.start(stream.get());
    attention(t.q(), t.k(), t.v(), t.out(), v, ao);
    if (backward)
      attention_backward(t.q(), t.k(), t.v(), t.out(), t.lse, t.dout(), t.grads(), v, bo);
    timer.stop(stream.get());
    if (r >= kWarmups) ms.push_back(timer.elapsed_ms());
  }
  return median(ms);
}

// The busiest rank's blocks (plan_ring's schedule: per step its (query chunk, K/V chunk) pairs
// with their BlockMasks at global positions, K/V chunk by K/V chunk, as RingAttention runs them)
// one after another on device 0, without the ring: adding into float32 accumulators as the ring's
// blocks do (the same K/V stand in for every step's shard). The ring's compute alone: ring ms
// minus this is what communication and waiting cost, this minus ideal what cutting the work into
// blocks costs.
double time_blocks(const Variant& v, const RingPlan& plan, const RingPlanOptions& popts, int reps,
                   bool backward) {
  use_device(0);
  const RingShape& s = plan.shape;
  const int64_t n = s.ranks, C = plan.chunk_len, L = s.seq_len / n;
  const int64_t rank =
      std::max_element(plan.rank_tiles.begin(), plan.rank_tiles.end()) - plan.rank_tiles.begin();
  const int64_t per_rank = int64_t(plan.chunks[rank].size());
  Tensors t(L);
  const Stream stream;
  // float32: the output (chunk by chunk) and its LSE; dq of the shard; dk, dv of a chunk.
  DeviceBuffer acc(size_t(kHeads * L * (kHeadDim + 1)) * 4), dq(size_t(kHeads * L * kHeadDim) * 4),
      dkv(size_t(2 * kHeads * C * kHeadDim) * 4);
  float* acc_out = static_cast<float*>(acc.get());
  float* acc_lse = acc_out + kHeads * L * kHeadDim;
  const auto rows = [](const TensorView& x, int64_t r0, int64_t len) {
    return x.narrow(2, r0, len);
  };
  struct Block {
    int64_t a, c, q_offset, kv_offset;
    std::optional<BlockMask> mask;
  };
  std::vector<Block> blocks;
  for (int64_t step = 0; step < n; ++step) {
    const int64_t src = (rank - step + n) % n;
    for (int64_t c = 0; c < per_rank; ++c)
      for (int64_t a = 0; a < per_rank; ++a) {
        Block b{a, c, plan.chunks[rank][a] * C, plan.chunks[src][c] * C, std::nullopt};
        if (!v.mask_always_true()) {
          BlockMaskOptions bmo;
          bmo.params = popts.params;
          bmo.q_offset = b.q_offset, bmo.kv_offset = b.kv_offset;
          bmo.seq_q_len = bmo.seq_kv_len = s.seq_len;
          b.mask.emplace(create_block_mask(v, 1, kHeads, C, C, bmo, stream.get()));
          if (b.mask->count(TileKind::Full) + b.mask->count(TileKind::Partial) == 0) continue;
        }
        blocks.push_back(std::move(b));
      }
  }
  std::vector<double> ms;
  for (int r = 0; r < reps + kWarmups; ++r) {
    EventTimer timer;
    timer.start(stream.get());
    // A block's options (AttentionOptions or BackwardOptions), as the ring sets them.
    const auto options = [&]<class Options>(const Block& b, Options o) {
      o.params = popts.params;
      o.stream = stream.get();
      o.block_mask = b.mask ? &*b.mask : nullptr;
      o.q_offset = b.q_offset, o.kv_offset = b.kv_offset;
      o.seq_q_len = o.seq_kv_len = s.seq_len;
      o.accumulate = true;
      return o;
    };
    const auto lse_of = [&](const Block& b) {
      return TensorView{acc_lse + b.a * kHeads * C, DType::F32, {1, kHeads, C}, {}};
    };
    for (const Block& b : blocks) {
      AttentionOptions ao = options(b, AttentionOptions{});
      ao.lse = lse_of(b);
      attention(
          rows(t.q(), b.a * C, C), rows(t.k(), b.c * C, C), rows(t.v(), b.c * C, C),
          TensorView{
              acc_out + b.a * kHeads * C * kHeadDim, DType::F32, {1, kHeads, C, kHeadDim}, {}},
          v, ao);
    }
    if (backward)
      for (const Block& b : blocks) {
        float* dk = static_cast<float*>(dkv.get());
        const std::vector<int64_t> chunk{1, kHeads, C, kHeadDim};
        const AttentionGrads g{
            rows(TensorView{dq.get(), DType::F32, {1, kHeads, L, kHeadDim}, {}}, b.a * C, C),
            TensorView{dk, DType::F32, chunk, {}},
            TensorView{dk + kHeads * C * kHeadDim, DType::F32, chunk, {}},
            {}};
        attention_backward(rows(t.q(), b.a * C, C), rows(t.k(), b.c * C, C),
                           rows(t.v(), b.c * C, C), rows(t.out(), b.a * C, C), lse_of(b),
                           rows(t.dout(), b.a * C, C), g, v, options(b, BackwardOptions{}));
      }
    timer.stop(stream.get());
    if (r >= kWarmups) ms.push_back(timer.elapsed_ms());
  }
  return median(ms);
}

struct RingResult {
  double ms = 0;
  RingStats stats;  // rank 0's
};

// The ring on devices 0 .. ranks - 1, a thread per rank; per repetition the slowest rank's time.
RingResult time_ring(const Variant& v, const RingShape& shape, const RingPlanOptions& popts,
                     int reps, bool backward) {
  const int n = int(shape.ranks);
  LocalCommunicators comms(n);
  std::vector<std::vector<double>> ms(n);
  std::vector<std::exception_ptr> errors(n);
  std::atomic<int> first_failed{-1};
  std::barrier sync(n);
  RingResult result;
  auto rank_main = [&](int rank) {
    try {
      use_device(rank);
      Tensors t(shape.seq_len / n);
      const Stream stream;
      RingAttention ring(v, comms[rank], shape, popts);
      RingForwardOptions fo;
      fo.stream = stream.get();
      fo.lse = t.lse;
      RingBackwardOptions bo;
      bo.stream = stream.get();
      for (int r = 0; r < reps + kWarmups; ++r) {
        stream.synchronize();
        sync.arrive_and_wait();  // a common start: a rank's time includes waiting for its peers
        EventTimer timer;
        timer.start(stream.get());
        ring.forward(t.q(), t.k(), t.v(), t.out(), fo);
        if (backward) ring.backward(t.q(), t.k(), t.v(), t.out(), t.lse, t.dout(), t.grads(), bo);
        timer.stop(stream.get());
        if (r >= kWarmups) ms[rank].push_back(timer.elapsed_ms());
      }
      if (rank == 0) result.stats = ring.stats();
    } catch (...) {
      errors[rank] = std::current_exception();
      int none = -1;
      first_failed.compare_exchange_strong(none, rank);
      comms.abort();
      sync.arrive_and_drop();  // the others must not wait for this rank at the barrier
    }
  };
  std::vector<std::thread> threads;
  for (int rank = 0; rank < n; ++rank) threads.emplace_back(rank_main, rank);
  for (std::thread& th : threads) th.join();
  if (first_failed >= 0) std::rethrow_exception(errors[first_failed]);
  std::vector<double> slowest(size_t(reps), 0.0);
  for (int rank = 0; rank < n; ++rank)
    for (int r = 0; r < reps; ++r) slowest[r] = std::max(slowest[r], ms[rank][r]);
  result.ms = median(slowest);
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"flexc ring attention benchmark: the ring on N GPUs against one GPU"};
  int ranks = 2, reps = 5;
  int64_t window = 4096;
  std::vector<int64_t> seq_lens{65536, 262144};
  std::vector<std::string> only;
  bool json = false, backward = false;
  app.add_option("--ranks", ranks, "GPUs in the ring (devices 0 .. ranks - 1)")
      ->check(CLI::Range(2, 64));
  app.add_option("--seq-lens", seq_lens, "total tokens, comma-separated")
      ->delimiter(',')
      ->check(CLI::PositiveNumber);
  app.add_option("--cases", only, "noop, causal, sliding_window (default: all)")->delimiter(',');
  app.add_option("--window", window, "sliding_window's window")->check(CLI::PositiveNumber);
  app.add_option("--reps", reps, "timed repetitions (median reported)")->check(CLI::PositiveNumber);
  app.add_flag("--backward", backward, "time forward + backward");
  app.add_flag("--json", json, "also print one JSON object per case");
  CLI11_PARSE(app, argc, argv);
  try {
    if (device_count() < ranks) {
      std::fprintf(stderr, "bench_ring: --ranks %d needs %d GPUs; this machine has %d\n", ranks,
                   ranks, device_count());
      return 1;
    }
    const std::vector<Case> cases{{"noop", Sharding::Zigzag},
                                  {"causal", Sharding::Zigzag},
                                  {"sliding_window", Sharding::Contiguous}};
    fmt::print(
        "| case | pass | sharding | S | ranks | density | blocks computed / skipped (rank 0) | "
        "single ms | ring ms | ideal ms | blocks alone ms | efficiency | single TFLOP/s | ring "
        "TFLOP/s |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (const Case& c : cases) {
      if (!only.empty() && std::find(only.begin(), only.end(), c.name) == only.end()) continue;
      const Variant v = Variant::from_catalogue(c.name);
      RingPlanOptions popts;
      if (c.name == "sliding_window") popts.params["window"] = double(window);
      for (int64_t S : seq_lens) {
        const RingShape shape{.ranks = ranks,
                              .seq_len = S,
                              .batch = 1,
                              .q_heads = kHeads,
                              .kv_heads = kHeads,
                              .head_dim = kHeadDim,
                              .sharding = c.sharding};
        const RingPlan plan = plan_ring(v, shape, popts);
        double kept = 0;
        for (double e : plan.rank_elements) kept += e;
        const double density = kept / (double(kHeads) * double(S) * double(S));
        const double flops = (backward ? 3.5 : 1.0) * 4.0 * double(kHeads) * double(S) *
                             double(S) * kHeadDim * density;
        const double single = time_single(v, popts, S, reps, backward);
        const RingResult ring = time_ring(v, shape, popts, reps, backward);
        const double blocks = time_blocks(v, plan, popts, reps, backward);
        const double ideal = single / ranks;
        const char* sharding = c.sharding == Sharding::Zigzag ? "zigzag" : "contiguous";
        const char* pass = backward ? "fwd+bwd" : "fwd";
        fmt::print(
            "| {} | {} | {} | {} | {} | {:.4f} | {} / {} | {:.2f} | {:.2f} | {:.2f} | {:.2f} | "
            "{:.1f}% | {:.1f} | {:.1f} |\n",
            c.name, pass, sharding, S, ranks, density, ring.stats.blocks_computed,
            ring.stats.blocks_skipped, single, ring.ms, ideal, blocks, 100 * ideal / ring.ms,
            flops / single * 1e-9, flops / ring.ms * 1e-9);
        if (json)
          fmt::print(
              "{{\"case\": \"{}\", \"pass\": \"{}\", \"sharding\": \"{}\", \"s\": {}, "
              "\"ranks\": {}, \"density\": {:.6f}, \"single_ms\": {:.4f}, \"ring_ms\": {:.4f}, "
              "\"blocks_ms\": {:.4f}, \"efficiency\": {:.4f}}}\n",
              c.name, pass, sharding, S, ranks, density, single, ring.ms, blocks,
              ideal / ring.ms);
        std::fflush(stdout);
      }
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "bench_ring: %s\n", e.what());
    return 2;
  }
  return 0;
}
