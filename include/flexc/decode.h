// flexc::decode: attention of a few query tokens per sequence against a KV cache (generation,
// speculative decoding), for any variant, as split-KV FlashDecoding.
//
//   flexc::KvCache cache{.k = k_pages, .v = v_pages, .kv_lens = lens, .page_table = table};
//   flexc::decode(q, cache, out, variant, {.captures = ..., .lse = lse, .stream = stream});
//
// q and out [B, Hq, Q_LEN, D / Dv], bf16 or fp16. The cache is contiguous, k [B, Hkv, CAPACITY,
// D] and v [B, Hkv, CAPACITY, Dv], or paged: k [NUM_PAGES, Hkv, PAGE_SIZE, D] and v [NUM_PAGES,
// Hkv, PAGE_SIZE, Dv] with any page / head / slot strides (vLLM's and FlashInfer's NHD layout
// [pages, slots, heads, D] is the view with strides permuted; HND is contiguous), and an int32
// page table [B, MAX_PAGES]: key i of sequence b is slot i % PAGE_SIZE of page
// page_table[b, i / PAGE_SIZE]. PAGE_SIZE is any power of two.
//
// Positions: query i of sequence b is at position q_offsets[b] + i, by default kv_lens[b] - Q_LEN
// + i (the queries are the sequence's last tokens, already in the cache). That is the q_idx the
// mods see; their q_len is the position after the last query and kv_len is kv_lens[b], so causal,
// sliding-window, ALiBi, document and every other variant mean what they mean in prefill.
// Captures with Q_LEN or KV_LEN dims take the cache's CAPACITY there (positions index one
// sequence). A query at a position outside [0, CAPACITY) attends to nothing: out 0, LSE -inf.
//
// Lengths, offsets and the page table are device data: a step that changes them costs no host
// work and no recompile, so a decode step can be captured in a CUDA graph. See docs/decode.md.
#pragma once

#include <map>
#include <optional>
#include <string>

#include "flexc/tensor.h"
#include "flexc/variant.h"

struct CUstream_st;

namespace flexc {

struct KvCache {
  TensorView k, v;  // contiguous [B, Hkv, CAPACITY, D] or paged [NUM_PAGES, Hkv, PAGE_SIZE, D]
  TensorView kv_lens;  // int32 [B] on the device: the number of keys of each sequence
  // int32 [B, MAX_PAGES] on the device (any strides, the last 1): set for a paged cache.
  std::optional<TensorView> page_table;
  // int32 [B] on the device: the position of each sequence's first query (see above).
  std::optional<TensorView> q_offsets;
};

struct DecodeOptions {
  // Device tensors for the variant's captures and runtime params, as flexc::attention takes
  // them (B and H resolve to the batch and Hq, Q_LEN and KV_LEN to the cache's CAPACITY).
  std::map<std::string, TensorView, std::less<>> captures;
  std::map<std::string, double, std::less<>> params;
  std::optional<double> scale;  // default 1 / sqrt(D)
  // float32 [B, Hq, Q_LEN], contiguous: receives each query's log-sum-exp (natural log).
  std::optional<TensorView> lse;
  CUstream_st* stream = nullptr;
  WorkspaceAllocator workspace;  // for splits > 1: B * Hq * Q_LEN * splits * (Dv + 1) floats
  // KV splits per sequence. 0: chosen so that the launch fills the GPU (FlashAttention's
  // wave-efficiency rule, for sequences of max_kv_len keys); 1 to 256: forced.
  int num_splits = 0;
  // The longest sequence the call may see, for the split rule; 0: the cache's CAPACITY.
  int64_t max_kv_len = 0;
  // Copy kv_lens, q_offsets and the page table to the host and check them (a length above the
  // capacity, a page index out of range, ...) with an error naming the argument. Synchronizes
  // the stream: for debugging, not inside a graph. Without it a bad value never reads out of
  // bounds: the rows of its sequence come out NaN.
  bool check_device_args = false;
};

// Enqueues the decode kernel (and the combine of its splits) on opts.stream; the kernel is
// compiled on first use per variant, dtype, head dims and Q_LEN x (Hq / Hkv) bucket. Throws
// flexc::Error naming the argument on invalid input; no work is enqueued then.
void decode(const TensorView& q, const KvCache& cache, const TensorView& out,
            const Variant& variant, const DecodeOptions& opts = {});

// Everything flexc::decode does with these arguments but enqueue, as flexc::prepare_attention
// for the forward: the decode kernel for this Q_LEN x (Hq / Hkv) bucket, and the combine where
// the call splits the keys (the split count follows B, Hkv and max_kv_len, not kv_lens), are
// compiled and loaded. check_device_args is not run (it reads the device data). Call it before
// capturing decode steps into a CUDA graph, once per batch size the graphs take.
void prepare_decode(const TensorView& q, const KvCache& cache, const TensorView& out,
                    const Variant& variant, const DecodeOptions& opts = {});

// The number of KV splits decode chooses for these sizes on a GPU with `sms` multiprocessors
// (exposed for tests and benchmarks).
int decode_splits(int64_t batch, int64_t kv_heads, int64_t row_blocks, int64_t max_kv_len, int sms);

}  // namespace flexc
