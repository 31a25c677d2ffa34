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
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "flexc/jit.h"
#include "flexc/reference.h"
#include "flexc/tensor.h"

struct CUstream_st;

namespace flexc {

class FeatureMap;
namespace detail {
const Variant& feature_map_variant(const FeatureMap& fm);  // the JIT's view of phi
}

// A feature map phi on q and k (linear attention over phi(q), phi(k): elu(x) + 1 as Katharopoulos
// et al., relu, ...): an expression of x in flexc's language (docs/dsl.md), e.g.
// "where(x > 0, x + 1, exp(x))". The calls below apply it elementwise by a JIT kernel (phi in
// float32, rounded to q's type) before their chunkwise or recurrent pass, and the backward
// chains phi'(x) (derived from the expression) into dq and dk.
class FeatureMap {
 public:
  // Throws flexc::Error with the language's diagnostics, `where` naming the expression.
  static FeatureMap parse(std::string_view expression_of_x,
                          std::string_view where = "feature_map");
  std::string text() const;            // checked and normalized
  double operator()(double x) const;   // phi(x), float64, by flexc's interpreter
  double derivative(double x) const;   // phi'(x), likewise

 private:
  struct Impl;
  friend const Variant& detail::feature_map_variant(const FeatureMap& fm);
  explicit FeatureMap(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

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
  std::optional<FeatureMap> feature_map;  // applied to q and k; unset: none
  CUstream_st* stream = nullptr;
  // linear_attention's temporaries, per chunk of 64 tokens and head: its start state (DK x DV)
  // and k scaled by the gates (64 x DK) in q's type, the gates' sums (64 x DK) and DK decays in
  // float32; with a feature map also phi(q) and phi(k), contiguous, in q's type.
  WorkspaceAllocator workspace;
};

// q [B, H, T, DK], k [B, Hk, T, DK], v [B, Hk, T, DV] (Hk divides H: k and v shared by H / Hk
// heads), out [B, H, T, DV]; bf16 or fp16, any batch / head / token strides, contiguous head dims
// of 64 or 128. Enqueued on opts.stream; the kernels compile on first use per dtype, head dims
// and gate type. Throws flexc::Error naming the argument on invalid input (no work enqueued).
void linear_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                      const TensorView& out, const LinearOptions& opts = {});

// The chunkwise backward of linear_attention: the gradients of a loss L(out, final_state) given
// dout = dL/dout and (optionally) d_final_state = dL/dfinal_state. It recomputes the chunk
// states from q, k, v, g and initial_state (nothing is kept from the forward) and writes
// grads.dq, dk, dv (q's, k's, v's shapes and dtype; with Hk < H, k's and v's gradients are
// summed over the heads sharing them), grads.dg (g's shape, float32 / bf16 / fp16: required
// exactly when opts.g is set; a gate clamped at -1e4 gets 0) and grads.d_initial_state (float32
// [B, H, DK, DV], optional). Every gradient is written, none accumulated into. Each output has
// its own memory (strides any, non-overlapping), distinct from the inputs.
struct LinearBackwardOptions {
  std::optional<TensorView> g;              // as in LinearOptions
  std::optional<TensorView> initial_state;  // as in LinearOptions
  std::optional<TensorView> d_final_state;  // float32 [B, H, DK, DV], contiguous; unset: zeros
  std::optional<double> scale;              // default 1 / sqrt(DK)
  std::optional<FeatureMap> feature_map;    // as in LinearOptions (dq, dk through phi')
  CUstream_st* stream = nullptr;
  // The temporaries: linear_attention's, the chunks' state gradients (DK x DV, q's type), q
  // scaled by its gates (64 x DK per chunk, q's type), and float32 per-token gate gradients
  // (64 x DK per chunk); with Hk < H also float32 dk and dv per q head.
  WorkspaceAllocator workspace;
};

struct LinearGradients {
  TensorView dq, dk, dv;
  std::optional<TensorView> dg;               // required when the forward had gates
  std::optional<TensorView> d_initial_state;  // float32 [B, H, DK, DV], contiguous; optional
};

void linear_attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                               const TensorView& dout, const LinearGradients& grads,
                               const LinearBackwardOptions& opts = {});

// The recurrent form over T tokens (T = 1 when decoding): `state` (float32 [B, H, DK, DV],
// contiguous) is updated in place, token after token, and out [B, H, T, DV] receives each o_t.
// opts.initial_state and final_state must be unset; opts.g as above with this call's T.
void linear_attention_step(const TensorView& q, const TensorView& k, const TensorView& v,
                           const TensorView& state, const TensorView& out,
                           const LinearOptions& opts = {});

// ---- Linear-attention variants as configs (docs/linear.md, "Configs"). A JSON config with
// "kind": "linear" names the gate family the kernels read, and for a fixed decay per head gives
// its log as an expression of h in flexc's language, so that a new variant of the family is a
// config, not a new kernel:
//
//   {"name": "retnet", "kind": "linear", "gate": "per_head", "log_decay": "log(1 - exp2(-5 - h))"}

enum class LinearGate { PerDim, PerStep, PerHead, None };
std::string_view to_string(LinearGate g);  // "per_dim", "per_step", "per_head", "none"

class LinearVariant {
 public:
  // Throws flexc::Error "origin: path: message" (the path in the config, e.g. "log_decay").
  static LinearVariant from_json(std::string_view json_text, std::string_view origin = "<json>");
  static LinearVariant from_json_file(const std::filesystem::path& path);
  // The built-in catalogue (examples/linear/, embedded at build time): "gla" or "@gla".
  static LinearVariant from_catalogue(std::string_view name);
  static std::vector<std::string> catalogue_names();
  // What a command line names: "@name" of either catalogue, or a JSON file: whether it is a
  // linear-attention config (the CLI's commands take both kinds), and loading it.
  static bool is_linear_config(std::string_view config);
  static LinearVariant load(std::string_view config);

  const std::string& name() const;
  const std::string& description() const;
  LinearGate gate() const;
  // PerHead: the log decay, checked and normalized (an expression of h alone).
  std::string log_decay_text() const;
  std::optional<double> scale() const;
  // The config's "feature_map" (an expression of x), if it has one.
  const std::optional<FeatureMap>& feature_map() const;
  // PerHead: log_decay at h = 0 .. heads - 1, in float64 by flexc's interpreter, as float32.
  // Throws naming the head if a value is positive or NaN.
  std::vector<float> head_log_decays(int64_t heads) const;

 private:
  struct Impl;
  explicit LinearVariant(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

// The kernels a linear variant runs, built ahead of time through the JIT's caches (no GPU
// needed when `arch` is named): the forward module (chunkwise forward and the step) and the
// backward module, for inputs of `dtype` ("bf16" / "fp16"), head dims dk, dv (64 or 128) and
// gates of `gate_dtype` ("float32", "bf16", "fp16"; unused without gates); with a feature map
// also its module (templates/linear/gla_feature_map.cuh).
std::vector<CompiledKernel> compile_linear_kernels(const LinearVariant& v, std::string_view arch,
                                                   std::string_view dtype, int dk, int dv,
                                                   std::string_view gate_dtype = "float32");

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
  DType gate_dtype = DType::F32;  // the backward's `ref` rounds dg to it (g's type)
  // `ref` without its roundings: the chunkwise algorithm itself, for tests against `gold`.
  bool exact_ref = false;
  // Applied to q and k as the kernels do (phi in float64, rounded to dtype for gold and ref alike
  // unless exact_ref); the backward's dq and dk are then chained through phi' (ref rounds them
  // to dtype).
  std::optional<FeatureMap> feature_map;
};

struct LinearReferenceResult {
  std::vector<double> gold_out, ref_out;      // [B, H, T, DV]
  std::vector<double> gold_state, ref_state;  // [B, H, DK, DV]
};

// Throws flexc::Error for inconsistent sizes or a positive / NaN gate. Multi-threaded.
LinearReferenceResult reference_linear_attention(const LinearReferenceProblem& p);

// The backward's oracle: the gradients of sum(out * dout) + sum(final_state * dstate). `gold`
// differentiates the recurrence in float64; `ref` is linear_attention_backward's chunkwise
// computation (templates/linear/gla_backward.cuh) in float64, rounded where it rounds (its
// operands, A and dA, the chunk states and state gradients to the input type, the gradients to
// their types) unless exact_ref. dout [B, H, T, DV]; dstate [B, H, DK, DV] or empty.
struct LinearGradientValues {
  std::vector<double> dq, dk, dv;  // q's, k's, v's shapes (k and v summed over the heads sharing them)
  std::vector<double> dg;          // g's shape; empty without gates
  std::vector<double> dh0;         // [B, H, DK, DV]: the initial state's (zeros when it is unset)
};
struct LinearReferenceGradients {
  LinearGradientValues gold, ref;
};
// Throws flexc::Error for inconsistent sizes or a positive / NaN gate. Multi-threaded.
LinearReferenceGradients reference_linear_attention_backward(const LinearReferenceProblem& p,
                                                             std::span<const float> dout,
                                                             std::span<const float> dstate);
// The rule of attention's gradients (flexc/reference.h) for each of dq, dk, dv, dg (when the
// reference has it) and dh0 (when `dh0` is not empty): rmse(kernel, gold) <= 1.5 rmse(ref,
// gold) + 2^-16 rms(gold) + 1e-6, no non-finite value. The kernel's values contiguous, in the
// reference's shapes.
BackwardAccuracy check_linear_gradients(const LinearReferenceGradients& r,
                                        std::span<const float> dq, std::span<const float> dk,
                                        std::span<const float> dv, std::span<const float> dg,
                                        std::span<const float> dh0);

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
