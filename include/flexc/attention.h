// flexc::attention: the forward pass of any variant as one fused, block-sparse GPU kernel.
//
//   flexc::attention(q, k, v, out, variant,
//                    {.block_mask = &bm, .captures = {{"slope", slopes}}, .params = {{"window", 512}},
//                     .scale = 0.125, .lse = lse, .stream = stream});
//
// Shapes: q and out [B, Hq, Q_LEN, D], k and v [B, Hkv, KV_LEN, D], bf16 or fp16 (q, k, v the
// same; out too, or float32 for an unrounded output), D in {32, 64, 96, 128, 256}, Hq % Hkv == 0
// (GQA / MQA). Any B / H / sequence strides; the head dim must be contiguous and every row
// 16-byte aligned. See docs/attention.md.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "flexc/blockmask.h"
#include "flexc/tensor.h"
#include "flexc/variant.h"

struct CUstream_st;

namespace flexc {

// Which forward kernel runs (docs/attention.md). Auto: the Hopper kernel (wgmma) on a GPU of
// compute capability 9.0 for head dims 64, 96, 128, 192 and 256 with BlockMask tiles that are
// multiples of the kernel's (128 x 128; 128 x 64 above D 128; the default 128 x 128 fits both),
// the portable kernel (mma.sync, sm_80+) otherwise. Portable and Hopper
// force one; forcing the Hopper kernel where it cannot run is an error.
enum class FwdKernel { Auto, Portable, Hopper };
// "auto", "portable", "hopper" (the command-line spellings).
std::string_view to_string(FwdKernel k);
// The inverse; throws flexc::Error naming the choices.
FwdKernel parse_fwd_kernel(std::string_view name);

// Packed sequences, as FlashAttention's varlen functions take them (docs/attention.md, "Packed
// sequences"): q and out [TOTAL_Q, Hq, D / Dv], k and v [TOTAL_KV, Hkv, D / Dv], sequence b's
// queries rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q and out, its keys rows
// cu_seqlens_kv[b] .. cu_seqlens_kv[b + 1] - 1 of k and v. The mods see b = the sequence, q_idx
// and kv_idx its rows' positions from 0, q_len and kv_len its lengths. Any token / head strides
// (16-byte aligned rows, contiguous head dim).
struct PackedSequences {
  // int32 [B + 1] on the device, non-decreasing from 0 to TOTAL_Q (TOTAL_KV).
  TensorView cu_seqlens_q, cu_seqlens_kv;
  // At least each sequence's queries / keys: the grid's and the BlockMask's lengths (create it
  // with B, Hq, max_seqlen_q, max_seqlen_kv; its mask_mod may not read q_len or kv_len), and what
  // captures' Q_LEN / KV_LEN dims take (B their sequence's).
  int64_t max_seqlen_q = 0, max_seqlen_kv = 0;
  // Copy cu_seqlens_q / _kv to the host and check them, with an error naming the argument.
  // Synchronizes the stream: for debugging, not inside a graph. Without it a bad value never
  // reads or writes out of bounds: a sequence whose queries fall outside q (or exceed
  // max_seqlen_q) is skipped, one whose keys do comes out NaN.
  bool check_device_args = false;
};

struct AttentionOptions {
  // The tiles to compute, from create_block_mask of the same variant (same lengths; nb / nh 1 or
  // B / Hq; tile sizes multiples of the kernel's, which the default 128 x 128 is). Without one
  // every tile is computed, with mask_mod on each element unless the mask is `true`.
  const BlockMask* block_mask = nullptr;
  // Device tensors for the variant's captures, by name, in their declared dtype and dims (B and H
  // resolve to the batch and the number of query heads).
  std::map<std::string, TensorView, std::less<>> captures;
  // Runtime params by name; those left out take their declared defaults. Changing a value never
  // recompiles.
  std::map<std::string, double, std::less<>> params;
  // Softmax scale applied to q.k before score_mod; default 1 / sqrt(D). Must be > 0.
  std::optional<double> scale;
  // When set: float32 [B, Hq, Q_LEN], contiguous, receives the log-sum-exp of each row's scores
  // (natural log; -inf for a row with no unmasked element, whose output is 0).
  std::optional<TensorView> lse;
  CUstream_st* stream = nullptr;  // the caller's stream; nullptr: the legacy default stream
  FwdKernel kernel = FwdKernel::Auto;
  // Positions. Chunked prefill: query i sits at position q_offset + i of its sequence, whose keys
  // are k and v's KV_LEN (the cache up to the chunk's end, say). The mods see q_idx = q_offset + i
  // and q_len = q_offset + Q_LEN; captures' Q_LEN dims take q_offset + Q_LEN. (flexc::decode
  // takes per-sequence offsets.)
  int64_t q_offset = 0;
  // A block of a longer sequence (context parallelism; flexc's ring attention computes one per
  // step): key j sits at position kv_offset + j, and the mods see the sequence's lengths, q_len
  // = seq_q_len and kv_len = seq_kv_len, which captures' Q_LEN / KV_LEN dims take too (0:
  // q_offset + Q_LEN and kv_offset + KV_LEN). With LSE, the blocks' results merge into the whole
  // sequence's (docs/attention.md, "Blocks of a longer sequence"). The BlockMask must be built
  // with the same four BlockMaskOptions fields.
  int64_t kv_offset = 0;
  int64_t seq_q_len = 0, seq_kv_len = 0;
  // true: merge this call's output into `out` (float32) and `lse` (required), which hold the
  // softmax over other keys of the same queries (0 and -inf before the first part): afterwards
  // over both, by the log-sum-exp combine. Keys split into calls (ring attention's steps, a KV
  // cache in segments) merge in place, with no buffer for the parts and no rounding between them.
  bool accumulate = false;
  // Packed sequences instead of [B, H, SEQ, D] tensors (above); lse is then float32 [Hq,
  // TOTAL_Q], contiguous. Not with the positions above, accumulate, or a backward (yet).
  std::optional<PackedSequences> packed;
};

// Enqueues the kernel on opts.stream (compiling it on first use: later calls with the same
// variant, dtype and head dim hit the JIT cache, whatever the lengths, params or captures).
// Throws flexc::Error naming the argument on invalid input; no work is enqueued then.
void attention(const TensorView& q, const TensorView& k, const TensorView& v,
               const TensorView& out, const Variant& variant, const AttentionOptions& opts = {});

// Everything flexc::attention does with these arguments but enqueue: the same checks and errors
// (named "flexc::attention"), the same choice of kernel for these shapes, strides, BlockMask,
// captures and GPU, that kernel compiled (or read from the caches) and loaded into the current
// context with its shared memory raised, a BlockMask built on the CPU uploaded (on opts.stream).
// Reads and writes no tensor data and enqueues no kernel. Afterwards the same call (any data,
// params or scale) only launches: call it before a CUDA graph's capture, or before serving, for
// each shape the graph or server will run (docs/attention.md, "Ahead of the first call").
void prepare_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                       const TensorView& out, const Variant& variant,
                       const AttentionOptions& opts = {});

// What flexc::attention_backward writes.
struct AttentionGrads {
  // q's, k's and v's shapes, in q's dtype; any B / H / sequence strides (16-byte aligned rows,
  // contiguous head dim). dk and dv are summed over the query heads of each kv head's group.
  TensorView dq, dk, dv;
  // Gradients of float captures that the score_mod reads differentiably, by name: float32
  // tensors with the capture's shape and strides. The kernel adds into them (atomically), so
  // zero them for a fresh gradient, or keep adding over several calls.
  std::map<std::string, TensorView, std::less<>> captures;
};

struct BackwardOptions {
  // The same BlockMask, captures, params, scale and positions as the forward call.
  const BlockMask* block_mask = nullptr;
  std::map<std::string, TensorView, std::less<>> captures;
  std::map<std::string, double, std::less<>> params;
  std::optional<double> scale;
  // The gradient of the loss with respect to the forward's LSE, when the loss uses it: float32
  // [B, Hq, Q_LEN], contiguous.
  std::optional<TensorView> dlse;
  CUstream_st* stream = nullptr;
  WorkspaceAllocator workspace;  // B * Hq * Q_LEN * (D + 1) floats at most; unset: flexc's pool
  // true: dq by a second kernel that walks each q tile's row and recomputes what dq needs,
  // without atomics, so dq, dk and dv are bitwise identical across runs (capture gradients still
  // use atomics). false: dq added in float32 inside the main kernel (atomics, or bulk reduce-adds
  // on Hopper), whose order varies. Unset (the default): the faster for the kernel that runs,
  // measured at 16k (docs/perf.md): false for the Hopper kernel (1.3x), true for the portable one
  // (1.5-1.7x).
  std::optional<bool> deterministic;
  // Which main kernel runs, with the forward's choices: Auto takes the Hopper kernel (wgmma, TMA)
  // on a GPU of compute capability 9.0 for head dims 64 and 128 with BlockMask tiles that are
  // multiples of 64 x 128 (the default 128 x 128 is), the portable one (mma.sync) otherwise.
  FwdKernel kernel = FwdKernel::Auto;
  // Positions, as AttentionOptions has them: the gradients of one block of a longer sequence,
  // given the whole sequence's out and LSE rows of these queries (ring attention's backward).
  int64_t q_offset = 0, kv_offset = 0;
  int64_t seq_q_len = 0, seq_kv_len = 0;
  // true: add the gradients into dq, dk and dv (float32, all three) instead of writing them, as a
  // gradient is accumulated over blocks (ring attention's steps) or micro-batches; no rounding
  // between the parts and no buffer for them.
  bool accumulate = false;
};

// The backward pass of flexc::attention: given the forward's inputs, its output `out` and its
// `lse` (float32 [B, Hq, Q_LEN], contiguous: pass AttentionOptions::lse to the forward), and
// dout = dL/dout, writes dq, dk, dv (or adds into them: opts.accumulate) and adds the capture
// gradients (docs/attention.md). dq, dk, dv are q's dtype, or float32 all three. dk and
// dv are bitwise reproducible, dq too with opts.deterministic = true; capture gradients are
// accumulated with float32 atomics. D in {32,
// 64, 96, 128}; BlockMask tiles multiples of 64 x 64. Enqueued on opts.stream with stream-ordered
// workspace (B * Hq * Q_LEN * (D + 1) floats); throws flexc::Error naming the argument.
void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& out, const TensorView& lse, const TensorView& dout,
                        const AttentionGrads& grads, const Variant& variant,
                        const BackwardOptions& opts = {});

// Everything flexc::attention_backward does with these arguments but enqueue (its kernels
// compiled and loaded; no workspace taken), as prepare_attention for the forward.
void prepare_attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                                const TensorView& out, const TensorView& lse,
                                const TensorView& dout, const AttentionGrads& grads,
                                const Variant& variant, const BackwardOptions& opts = {});

}  // namespace flexc
