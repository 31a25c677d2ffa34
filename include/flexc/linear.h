// flexc::linear_attention: gated linear attention (GLA, Yang et al. 2023, arXiv 2312.06635) in
// its chunkwise form, and the recurrent step for decoding. Per head,
//
//   S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t,   o_t = scale * q_t S_t,
//
// S a DK x DV float32 state, g_t <= 0 the log gates. One tensor view of g covers the family:
// g [B, H, T, DK] is GLA's gate per key dim; g [B, H, T] one gate per step (Mamba-2 / SSD); a
// fixed decay per head (RetNet) is an [H] vector viewed as [B, H, T] with strides {0, 1, 0}; no
// g is plain linear attention. See docs/linear.md.
//
//   flexc::linear_attention(q, k, v, out, {.g = g, .final_state = state});
//   flexc::linear_attention_step(q1, k1, v1, state, out1, {.g = g1});  // then each new token
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "flexc/tensor.h"

struct CUstream_st;

namespace flexc {

struct LinearOptions {
  // Log gates, float32, bf16 or fp16, [B, H, T, DK] or [B, H, T], any strides (0 broadcasts).
  // Each must be <= 0; below -1e4 (or -inf) it counts as -1e4, whose exp is 0 (a reset). A
  // positive or NaN gate makes the results of its head NaN. Unset: no gate.
  std::optional<TensorView> g;
  // float32 [B, H, DK, DV], contiguous: the state before the first token (unset: zeros), and the
  // state after the last token (written; for linear_attention_step it is the state itself).
  std::optional<TensorView> initial_state;
  std::optional<TensorView> final_state;
  std::optional<double> scale;  // default 1 / sqrt(DK)
  CUstream_st* stream = nullptr;
  // linear_attention's temporaries, per chunk of 64 tokens and head: its start state (DK x DV)
  // and k scaled by the gates (64 x DK) in q's type, the gates' sums (64 x DK) and DK decays in
  // float32.
  WorkspaceAllocator workspace;
};

// q [B, H, T, DK], k [B, Hk, T, DK], v [B, Hk, T, DV] (Hk divides H: k and v shared by H / Hk
// heads), out [B, H, T, DV]; bf16 or fp16, any batch / head / token strides, contiguous head dims
// of 64 or 128. Enqueued on opts.stream; the kernels compile on first use per dtype, head dims
// and gate type. Throws flexc::Error naming the argument on invalid input (no work enqueued).
void linear_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                      const TensorView& out, const LinearOptions& opts = {});

// The recurrent form over T tokens (T = 1 when decoding): `state` (float32 [B, H, DK, DV],
// contiguous) is updated in place, token after token, and out [B, H, T, DV] receives each o_t.
// opts.initial_state and final_state must be unset; opts.g as above with this call's T.
void linear_attention_step(const TensorView& q, const TensorView& k, const TensorView& v,
                           const TensorView& state, const TensorView& out,
                           const LinearOptions& opts = {});

// ---- The float64 CPU reference and the tolerance rule (docs/linear.md).
//
// `gold` is the recurrence above in float64 on the kernel's (rounded) inputs. `ref` is the
// chunkwise computation flexc's kernels do, in float64 but rounded where they round: the
// gate-scaled q and k operands (gates per key dim) and A to the input type before their
// products, the chunk start states to it before q S, the output to it. rmse(ref, gold) is what a
// correct kernel's rounding costs.

struct LinearReferenceProblem {
  // Inputs widened to float, contiguous: q [B, H, T, DK], k [B, Hk, T, DK], v [B, Hk, T, DV],
  // g [B, H, T, DK] (per_dim_gates) or [B, H, T], or empty; initial_state [B, H, DK, DV] or empty.
  std::span<const float> q, k, v, g, initial_state;
  int64_t batch = 1, heads = 1, k_heads = 1, seq_len = 0, dk = 0, dv = 0;
  bool per_dim_gates = true;
  std::optional<double> scale;
  DType dtype = DType::BF16;  // where `ref` rounds
  // `ref` without its roundings: the chunkwise algorithm itself, for tests against `gold`.
  bool exact_ref = false;
};

struct LinearReferenceResult {
  std::vector<double> gold_out, ref_out;      // [B, H, T, DV]
  std::vector<double> gold_state, ref_state;  // [B, H, DK, DV]
};

// Throws flexc::Error for inconsistent sizes or a positive / NaN gate. Multi-threaded.
LinearReferenceResult reference_linear_attention(const LinearReferenceProblem& p);

// The backward's oracle: float64 gradients of sum(out * dout) + sum(final_state * dstate)
// through the recurrence (gold only). dout [B, H, T, DV]; dstate [B, H, DK, DV] or empty.
struct LinearReferenceGradients {
  std::vector<double> dq, dk, dv;  // q's, k's, v's shapes (k and v summed over the heads sharing them)
  std::vector<double> dg;          // g's shape; empty without gates
  std::vector<double> dh0;         // [B, H, DK, DV]: the initial state's (zeros when it is unset)
};
// Throws flexc::Error for inconsistent sizes or a positive / NaN gate. Multi-threaded.
LinearReferenceGradients reference_linear_attention_backward(const LinearReferenceProblem& p,
                                                             std::span<const float> dout,
                                                             std::span<const float> dstate);

struct LinearAccuracy {
  double out_rmse = 0, out_ref_rmse = 0;      // rmse(kernel, gold), rmse(ref, gold)
  double state_rmse = 0, state_ref_rmse = 0;
  int64_t bad = 0;  // non-finite kernel values
  bool pass = false;
  // "out rmse 3.1e-04 (ref 3.0e-04), state rmse 1.2e-06 (ref 1.1e-06), 0 bad: PASS"
  std::string summary() const;
};

// rmse(kernel, gold) <= 1.5 rmse(ref, gold) + 2^-16 rms(gold) + 1e-6 for the output and (when
// `state` is not empty) the final state, and no non-finite value. (The middle term is float32
// accumulation's floor, as for the backward's gradients: without gates `ref` rounds nothing in
// the state.)
LinearAccuracy check_linear_accuracy(const LinearReferenceResult& r, std::span<const float> out,
                                     std::span<const float> state);

}  // namespace flexc
