// The CPU reference for flexc::attention: float64 math through the DSL interpreter (the oracle),
// and the tolerance rule kernels are checked with (docs/attention.md).
//
// Two results per row: `gold` is exact float64 attention on the kernel's (rounded) inputs; `ref`
// is the same computation with the kernel's rounding points (scores rounded to float32, P rounded
// to the kernel's dtype before P.V, the output rounded to it, LSE rounded to float32). rmse(ref,
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
  // The kernel's inputs widened to float, contiguous: q [B, Hq, Q_LEN, D], k and v
  // [B, Hkv, KV_LEN, D].
  std::span<const float> q, k, v;
  int64_t batch = 1, q_heads = 1, kv_heads = 1, q_len = 0, kv_len = 0, head_dim = 0;
  std::optional<double> scale;  // default 1 / sqrt(D)
  // Host tensors for the variant's captures and runtime params, as flexc::attention takes them.
  std::map<std::string, TensorView, std::less<>> captures;
  std::map<std::string, double, std::less<>> params;
  DType dtype = DType::BF16;  // the kernel's dtype: where `ref` rounds
  // Rows to compute, each (b * Hq + h) * Q_LEN + q_idx; empty: every row.
  std::vector<int64_t> rows;
};

struct ReferenceResult {
  std::vector<int64_t> rows;                 // the rows computed, in order
  std::vector<double> gold_out, ref_out;     // rows.size() x D
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

// The tolerance rule. `out`: the kernel's output for r.rows, rows.size() x D; `lse`: one value per
// row, or empty to check the output only.
Accuracy check_accuracy(const ReferenceResult& r, std::span<const float> out,
                        std::span<const float> lse);

}  // namespace flexc
