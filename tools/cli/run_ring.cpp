#include "cli/run_ring.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <thread>

#include "flexc/device.h"
#include "flexc/error.h"

namespace flexc::cli {

namespace {

// A rank's shard of a [BH, S, d] array: the rows of its chunks (each `len` long) of every
// (batch, head), concatenated in order; and back.
template <class T>
std::vector<T> gather_rows(const std::vector<T>& whole, int64_t bh, int64_t s, int64_t d,
                           const std::vector<int64_t>& chunks, int64_t len) {
  std::vector<T> shard;
  shard.reserve(size_t(bh * len * int64_t(chunks.size()) * d));
  for (int64_t i = 0; i < bh; ++i)
    for (int64_t c : chunks) {
      const auto from = whole.begin() + (i * s + c * len) * d;
      shard.insert(shard.end(), from, from + len * d);
    }
  return shard;
}
template <class T>
void scatter_rows(const std::vector<T>& shard, std::vector<T>& whole, int64_t bh, int64_t s,
                  int64_t d, const std::vector<int64_t>& chunks, int64_t len) {
  auto from = shard.begin();
  for (int64_t i = 0; i < bh; ++i)
    for (int64_t c : chunks) {
      std::copy(from, from + len * d, whole.begin() + (i * s + c * len) * d);
      from += len * d;
    }
}

}  // namespace

RingRunResult run_ring(const RingRunArgs& a) {
  const RingShape& s = a.shape;
  const int n = int(s.ranks);
  RingPlanOptions popts;
  popts.params = a.params;
  for (const auto& [name, arr] : a.captures)  // host copies: each rank's analysis reads them
    popts.captures[name] = CaptureData{arr->bytes.data(), nullptr, arr->shape, {}};
  RingRunResult r;
  r.plan = plan_ring(*a.variant, s, popts);
  const int64_t S = s.seq_len, L = S / n, C = r.plan.chunk_len, B = s.batch;
  const int64_t Dv = s.v_head_dim ? s.v_head_dim : s.head_dim;
  r.out.assign(size_t(B * s.q_heads * S * Dv), 0.f);
  r.lse.assign(size_t(B * s.q_heads * S), 0.f);
  r.stats.resize(n);
  std::vector<double> first(n), warm(n);
  std::vector<std::exception_ptr> errors(n);
  std::atomic<int> first_failed{-1};  // the root cause; the others may fail from the abort

  LocalCommunicators comms(n);
  auto rank_main = [&](int rank) {
    try {
      use_device(rank);
      const std::vector<int64_t>& chunks = r.plan.chunks[rank];
      const std::vector<uint16_t> q = gather_rows(a.q->bits, B * s.q_heads, S, s.head_dim, chunks,
                                                  C),
                                  k = gather_rows(a.k->bits, B * s.kv_heads, S, s.head_dim, chunks,
                                                  C),
                                  v = gather_rows(a.v->bits, B * s.kv_heads, S, Dv, chunks, C);
      const DeviceBuffer dq = DeviceBuffer::from<uint16_t>(q), dk = DeviceBuffer::from<uint16_t>(k),
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
      std::vector<uint16_t> out_bits = dout.to_vector<uint16_t>(size_t(B * s.q_heads * L * Dv));
      std::vector<float> out(out_bits.size()),
          lse = dlse.to_vector<float>(size_t(B * s.q_heads * L));
      for (size_t i = 0; i < out.size(); ++i)
        out[i] = s.dtype == DType::BF16 ? bf16_to_float(out_bits[i]) : fp16_to_float(out_bits[i]);
      // Ranks write disjoint rows of the whole.
      scatter_rows(out, r.out, B * s.q_heads, S, Dv, chunks, C);
      scatter_rows(lse, r.lse, B * s.q_heads, S, 1, chunks, C);
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
  return r;
}

}  // namespace flexc::cli
