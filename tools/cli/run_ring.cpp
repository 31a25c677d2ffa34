#include "cli/run_ring.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <mutex>
#include <thread>

#include "flexc/device.h"
#include "flexc/error.h"

namespace flexc::cli {

RingRunResult run_ring(const RingRunArgs& a) {
  const RingShape& s = a.shape;
  const int n = int(s.ranks);
  RingPlanOptions popts;
  popts.params = a.params;
  popts.send_cost_bytes = a.send_cost_bytes;
  for (const auto& [name, arr] : a.captures)  // host copies: each rank's analysis reads them
    popts.captures[name] = CaptureData{arr->bytes.data(), nullptr, arr->shape, {}};
  RingRunResult r;
  r.plan = plan_ring(*a.variant, s, popts);
  const int64_t S = s.seq_len, L = S / n, B = s.batch;
  const int64_t Dv = s.v_head_dim ? s.v_head_dim : s.head_dim;
  r.out.assign(size_t(B * s.q_heads * S * Dv), 0.f);
  r.lse.assign(size_t(B * s.q_heads * S), 0.f);
  r.stats.resize(n);
  const bool backward = a.dout != nullptr;
  if (backward) {
    r.dq.assign(a.q->bits.size(), 0.f), r.dk.assign(a.k->bits.size(), 0.f);
    r.dv.assign(a.v->bits.size(), 0.f);
    for (const auto& [name, arr] : a.captures)
      if (arr->dtype == DType::F32) r.capture_grads[name].assign(size_t(arr->numel()), 0.f);
  }
  std::mutex summing;  // the ranks' shares of the capture gradients
  std::vector<double> first(n), warm(n), bwd_first(n), bwd_warm(n);
  std::vector<std::exception_ptr> errors(n);
  std::atomic<int> first_failed{-1};  // the root cause; the others may fail from the abort

  LocalCommunicators comms(n);
  auto rank_main = [&](int rank) {
    try {
      use_device(rank);
      const std::vector<uint16_t> q = shard_rows(r.plan, rank, a.q->bits, B * s.q_heads, s.head_dim),
                                  k = shard_rows(r.plan, rank, a.k->bits, B * s.kv_heads, s.head_dim),
                                  v = shard_rows(r.plan, rank, a.v->bits, B * s.kv_heads, Dv);
      // k, then q, then v: k and v apart, so that code taking one for the other faults or fails.
      const DeviceBuffer dk = DeviceBuffer::from<uint16_t>(k), dq = DeviceBuffer::from<uint16_t>(q),
                         dv = DeviceBuffer::from<uint16_t>(v);
      DeviceBuffer dout(size_t(B * s.q_heads * L * Dv) * 2), dlse(size_t(B * s.q_heads * L) * 4);
      std::vector<DeviceBuffer> caps;
      RingForwardOptions fo;
      caps.reserve(a.captures.size());
      for (const auto& [name, arr] : a.captures) {
        caps.emplace_back(std::max<size_t>(arr->bytes.size(), 16));
        caps.back().upload(arr->bytes.data(), arr->bytes.size());
        fo.captures[name] = TensorView{caps.back().get(), arr->dtype, arr->shape, {}};
      }
      fo.scale = a.scale;
      fo.kernel = a.kernel;
      fo.lse = TensorView{dlse.get(), DType::F32, {B, s.q_heads, L}, {}};
      const Stream stream;
      fo.stream = stream.get();
      const TensorView tq{dq.get(), s.dtype, {B, s.q_heads, L, s.head_dim}, {}},
          tk{dk.get(), s.dtype, {B, s.kv_heads, L, s.head_dim}, {}},
          tv{dv.get(), s.dtype, {B, s.kv_heads, L, Dv}, {}},
          to{dout.get(), s.dtype, {B, s.q_heads, L, Dv}, {}};
      dout.fill(0xff);       // NaN: a row the ring missed cannot pass for a result
      synchronize_device();  // the uploads and the fill ran on the legacy stream
      const auto t0 = std::chrono::steady_clock::now();
      RingAttention ring(*a.variant, comms[rank], s, popts);
      ring.forward(tq, tk, tv, to, fo);
      stream.synchronize();
      first[rank] =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      EventTimer timer;
      timer.start(stream.get());
      ring.forward(tq, tk, tv, to, fo);
      timer.stop(stream.get());
      warm[rank] = timer.elapsed_ms();
      r.stats[rank] = ring.stats();
      // Ranks write disjoint rows of the whole.
      unshard_rows(r.plan, rank, download_16bit(dout, size_t(B * s.q_heads * L * Dv), s.dtype), r.out,
                   B * s.q_heads, Dv);
      unshard_rows(r.plan, rank, dlse.to_vector<float>(size_t(B * s.q_heads * L)), r.lse,
                   B * s.q_heads, 1);
      if (!backward) return;

      // The backward from the forward's out and LSE: gradients into poisoned buffers, capture
      // gradients from 0 (the kernels add into them), twice (the first compiles).
      const DeviceBuffer dgo =
          DeviceBuffer::from<uint16_t>(shard_rows(r.plan, rank, a.dout->bits, B * s.q_heads, Dv));
      DeviceBuffer gq(q.size() * 2), gk(k.size() * 2), gv(v.size() * 2);
      for (DeviceBuffer* g : {&gq, &gk, &gv}) g->fill(0xff);
      AttentionGrads grads{TensorView{gq.get(), s.dtype, tq.shape, {}},
                           TensorView{gk.get(), s.dtype, tk.shape, {}},
                           TensorView{gv.get(), s.dtype, tv.shape, {}},
                           {}};
      std::vector<DeviceBuffer> cap_grads;
      cap_grads.reserve(r.capture_grads.size());
      for (const auto& [name, sum] : r.capture_grads) {
        cap_grads.emplace_back(std::max<size_t>(sum.size() * 4, 16));
        grads.captures[name] =
            TensorView{cap_grads.back().get(), DType::F32, fo.captures[name].shape, {}};
      }
      RingBackwardOptions bo;
      bo.captures = fo.captures;
      bo.scale = a.scale;
      bo.stream = stream.get();
      bo.kernel = a.kernel;
      bo.deterministic = a.deterministic;
      const TensorView tgo{dgo.get(), s.dtype, to.shape, {}};
      for (int pass = 0; pass < 2; ++pass) {
        for (DeviceBuffer& g : cap_grads) g.fill(0);
        synchronize_device();
        const auto b0 = std::chrono::steady_clock::now();
        EventTimer bt;
        bt.start(stream.get());
        ring.backward(tq, tk, tv, to, *fo.lse, tgo, grads, bo);
        bt.stop(stream.get());
        stream.synchronize();
        if (pass == 0)
          bwd_first[rank] = std::chrono::duration<double, std::milli>(
                                std::chrono::steady_clock::now() - b0)
                                .count();
        else
          bwd_warm[rank] = bt.elapsed_ms();
      }
      r.stats[rank] = ring.stats();
      unshard_rows(r.plan, rank, download_16bit(gq, q.size(), s.dtype), r.dq, B * s.q_heads, s.head_dim);
      unshard_rows(r.plan, rank, download_16bit(gk, k.size(), s.dtype), r.dk, B * s.kv_heads, s.head_dim);
      unshard_rows(r.plan, rank, download_16bit(gv, v.size(), s.dtype), r.dv, B * s.kv_heads, Dv);
      const std::lock_guard<std::mutex> lock(summing);
      size_t i = 0;
      for (auto& [name, sum] : r.capture_grads) {
        const std::vector<float> share = cap_grads[i++].to_vector<float>(sum.size());
        for (size_t e = 0; e < sum.size(); ++e) sum[e] += share[e];
      }
    } catch (...) {
      errors[rank] = std::current_exception();
      int none = -1;
      first_failed.compare_exchange_strong(none, rank);
      comms.abort();  // the other ranks may be waiting for this one's sends
    }
  };
  std::vector<std::thread> threads;
  for (int rank = 0; rank < n; ++rank) threads.emplace_back(rank_main, rank);
  for (std::thread& t : threads) t.join();
  if (first_failed >= 0) std::rethrow_exception(errors[first_failed]);
  r.first_ms = *std::max_element(first.begin(), first.end());
  r.ms = *std::max_element(warm.begin(), warm.end());
  r.bwd_first_ms = *std::max_element(bwd_first.begin(), bwd_first.end());
  r.bwd_ms = *std::max_element(bwd_warm.begin(), bwd_warm.end());
  return r;
}

}  // namespace flexc::cli
