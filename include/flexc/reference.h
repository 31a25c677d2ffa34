// The CPU reference for flexc::attention: float64 math through the DSL interpreter (the oracle),
// and the tolerance rule kernels are checked with (docs/attention.md).
//
// Two results per row: `gold` is exact float64 attention on the kernel's (rounded) inputs; `ref`
// is the same computation with the kernel's rounding points (scores rounded to float32, P rounded
// to the kernel's dtype before P.V, the output rounded to it, LSE rounded to float32; for a
// Precision::Approx variant tanh rounded to 11 significant bits, tanh.approx's error). rmse(ref,
// gold) is the error a correct kernel makes; a kernel passes when its own error is at most 1.5
// times that, plus 1e-6.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "flexc/tensor.h"
#include "flexc/variant.h"

namespace flexc {

struct ReferenceProblem {
  // The kernel's inputs widened to float, contiguous: q [B, Hq, Q_LEN, D], k [B, Hkv, KV_LEN, D],
  // v [B, Hkv, KV_LEN, Dv] (Dv = v_head_dim, or D when 0).
  std::span<const float> q, k, v;
  int64_t batch = 1, q_heads = 1, kv_heads = 1, q_len = 0, kv_len = 0, head_dim = 0;
  int64_t v_head_dim = 0;
  std::optional<double> scale;  // default 1 / sqrt(D)
  // Host tensors for the variant's captures and runtime params, as flexc::attention takes them.
  std::map<std::string, TensorView, std::less<>> captures;
  std::map<std::string, double, std::less<>> params;
  DType dtype = DType::BF16;  // the kernel's dtype: where `ref` rounds
  // Rows to compute, each (b * Hq + h) * Q_LEN + q_idx; empty: every row.
  std::vector<int64_t> rows;
  // Decode (flexc::decode) when set, one per batch: k and v are the cache, KV_LEN its capacity;
  // sequence b has kv_lens[b] keys and its query i sits at position q_offsets[b] + i (q_offsets
  // empty: kv_lens[b] - Q_LEN + i). The mods see q_idx = that position, q_len = the position
  // after the last query, kv_len = kv_lens[b]; captures' Q_LEN dims take KV_LEN. A query at a
  // position outside [0, KV_LEN) has no keys.
  std::vector<int64_t> kv_lens, q_offsets;
  // Positions without kv_lens, as AttentionOptions has them: query i sits at q_offset + i (chunked
  // prefill), key j at kv_offset + j, and the mods and captures' dims see the lengths seq_q_len
  // and seq_kv_len (0: q_offset + Q_LEN, kv_offset + KV_LEN).
  int64_t q_offset = 0, kv_offset = 0;
  int64_t seq_q_len = 0, seq_kv_len = 0;
};

struct ReferenceResult {
  std::vector<int64_t> rows;                 // the rows computed, in order
  std::vector<double> gold_out, ref_out;     // rows.size() x Dv
  std::vector<double> gold_lse, ref_lse;     // one per row; -inf where no element is unmasked
};

// Throws flexc::Error for inconsistent sizes, bad rows, captures or params. Multi-threaded.
ReferenceResult reference_attention(const Variant& v, const ReferenceProblem& p);

struct Accuracy {
  double out_rmse = 0, out_ref_rmse = 0;  // rmse(kernel, gold), rmse(ref, gold)
  double lse_rmse = 0, lse_ref_rmse = 0;  // over rows with an unmasked element
  int64_t bad = 0;          // non-finite kernel values; masked rows not exactly 0 / -inf
  int64_t masked_rows = 0;  // rows with no unmasked element
  bool pass = false;
  // "out rmse 3.1e-05 (ref 3.0e-05), lse rmse 2.7e-07 (ref 2.6e-07), 0 bad, 12 masked rows: PASS"
  std::string summary() const;
};

// The tolerance rule. `out`: the kernel's output for r.rows, rows.size() x Dv; `lse`: one value per
// row, or empty to check the output only.
Accuracy check_accuracy(const ReferenceResult& r, std::span<const float> out,
                        std::span<const float> lse);

// ---- The backward pass (flexc::attention_backward)
//
// `gold` is the float64 gradient of sum(out * dout) + sum(lse * dlse) through FlexAttention's
// backward math: delta = rowsum(dout * out) - dlse, P = exp(score_mod(s) - lse), dS = P (dP -
// delta) d score_mod / d score, dq = scale dS k, dk = scale dS^T q, dv = P^T dout, and each float
// capture's gradient sum P (dP - delta) d score_mod / d element. `ref` is the same with the
// kernels' rounding points: scores and score_mod in float32, P and dS in float32 and rounded to
// the kernel's dtype before their products, dq / dk / dv rounded to it, capture gradients to
// float32.

struct ReferenceBackwardProblem {
  ReferenceProblem forward;  // q, k, v, sizes, scale, captures, params, dtype (`rows` unused)
  std::span<const float> dout;  // q's shape
  std::span<const float> dlse;  // [B, Hq, Q_LEN], or empty: the loss does not read the LSE
  // The forward's output and LSE as the backward receives them (q's shape; [B, Hq, Q_LEN]): gold
  // and ref both start from them, so a kernel is measured on its backward alone. Empty: the
  // reference forward's (gold from gold, ref from ref), which makes gold the exact gradient.
  std::span<const float> out, lse;
};

// One gradient tensor, contiguous in its tensor's shape. `magnitude` is, per element, the sum of
// its terms with every factor and every difference taken in absolute value (|dP| + |delta| for
// dP - delta): float32 arithmetic cannot promise better than a few units of 2^-24 of it, which
// sets the rule's floor where both errors are at that level (a row with one unmasked element has
// dP = delta exactly and a gradient of rounding noise). It is 0 only where no element contributes.
struct ReferenceGradient {
  std::vector<double> gold, ref, magnitude;
};

struct ReferenceBackward {
  ReferenceGradient dq, dk, dv;
  // Every float capture that the score_mod reads differentiably, by name (its declared shape).
  std::map<std::string, ReferenceGradient, std::less<>> captures;
};

// Throws flexc::Error for inconsistent sizes, captures or params. Multi-threaded.
ReferenceBackward reference_attention_backward(const Variant& v, const ReferenceBackwardProblem& p);

struct GradientAccuracy {
  std::string name;            // "dq", "dk", "dv", or a capture's name
  double rmse = 0, ref_rmse = 0;  // rmse(kernel, gold), rmse(ref, gold)
  double floor = 0;            // 2^-16 times the rms of `magnitude`
  int64_t bad = 0;  // non-finite values; nonzero values where no element contributes (masked rows)
  bool pass = false;
};

struct BackwardAccuracy {
  std::vector<GradientAccuracy> grads;
  bool pass = false;
  // "dq rmse 1.2e-03 (ref 1.1e-03), dk ..., 0 bad: PASS"
  std::string summary() const;
};

// The tolerance rule for each gradient: rmse(kernel, gold) <= 1.5 rmse(ref, gold) + floor + 1e-6
// and no bad values. `dq`, `dk`, `dv`: the kernel's, contiguous; `captures`: the kernel's capture
// gradients, one per capture of r.captures (a missing or extra one is an error).
BackwardAccuracy check_gradients(const ReferenceBackward& r, std::span<const float> dq,
                                 std::span<const float> dk, std::span<const float> dv,
                                 const std::map<std::string, std::span<const float>, std::less<>>&
                                     captures = {});

}  // namespace flexc
