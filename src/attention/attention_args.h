// A variant's call arguments (runtime params and captured tensors by name) checked against its
// declarations and put in slot order, for the attention kernels (src/attention/attention.cpp) and
// the CPU reference (src/reference/reference.cpp).
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "flexc/tensor.h"
#include "jit/abi.h"
#include "variant_impl.h"

namespace flexc::detail {

// What capture dims named B, H, Q_LEN, KV_LEN mean in this call (H: the number of query heads,
// as the mods' `h` is a query head).
struct CallDims {
  int64_t B = 1, H = 1, q_len = 0, kv_len = 0;
};

// Where a call's rows sit in their sequence (AttentionOptions, BackwardOptions, BlockMaskOptions
// and ReferenceProblem take the same four fields): query row i at q_offset + i, key row j at
// kv_offset + j; the mods see the sequence's lengths seq_q_len and seq_kv_len.
struct Positions {
  int64_t q_offset = 0, kv_offset = 0, seq_q_len = 0, seq_kv_len = 0;
  // Whether a kernel must be built to read them (jit::KernelConfig::positions) for q_len queries
  // and kv_len keys: keys not from 0, lengths other than the rows' ends, or queries not from 0
  // where `q_offset_free` is false (the backward kernels; the forward ones read q_offset anyway).
  bool need_kernel(int64_t q_len, int64_t kv_len, bool q_offset_free) const {
    return kv_offset != 0 || seq_q_len != q_offset + q_len || seq_kv_len != kv_len ||
           (!q_offset_free && q_offset != 0);
  }
};

// The positions of a call with q_len queries and kv_len keys: a sequence length of 0 becomes
// offset + rows. Throws flexc::Error "<what>: ..." naming the field unless the offsets are >= 0,
// each sequence length holds its rows (seq_q_len >= q_offset + q_len) and is at most `max_len`
// (int32 positions; the attention kernels keep 256 of headroom: a tile's last row is computed).
Positions resolve_positions(std::string_view what, int64_t q_len, int64_t kv_len, int64_t q_offset,
                            int64_t kv_offset, int64_t seq_q_len, int64_t seq_kv_len,
                            int64_t max_len);

// Runtime param values by slot: the given ones (by name), defaults for the rest. Throws
// flexc::Error "<what>: ..." for an unknown or const name and for a non-integer int value.
std::vector<double> resolve_params(const VariantImpl& v,
                                   const std::map<std::string, double, std::less<>>& by_name,
                                   std::string_view what);

// Captures by slot, each checked against its declaration (dtype, rank, dims, strides >= 0). Every
// capture a mod reads is required; a slot no mod reads and nobody passed stays null. Throws
// flexc::Error "<what>: capture 'name' ..." and names unknown captures with a suggestion.
std::vector<const TensorView*> resolve_captures(
    const VariantImpl& v, const std::map<std::string, TensorView, std::less<>>& by_name,
    const CallDims& dims, std::string_view what);

// Throws flexc::Error "<what>: '<variant>' declares no capture '<name>'" (with a suggestion)
// unless `v` declares a capture `name`.
void check_capture_name(const VariantImpl& v, std::string_view name, std::string_view what);

// Checks one capture against its declaration: dtype, shape (its dims resolved by `dims`),
// strides (one per dim, none negative), dims within int32, and `t.data` aligned to its elements
// (`data_name` names that pointer in the message). Throws flexc::Error "<what>: capture '...' ...".
void check_capture(const dsl::CaptureDecl& d, const TensorView& t, const CallDims& dims,
                   std::string_view what, std::string_view data_name = "data");

// The kernels' argument block: captures (device views) and runtime params by slot.
FlexcArgs kernel_args(const VariantImpl& v, std::span<const double> params,
                      std::span<const TensorView* const> captures);

dsl::DType to_dsl(DType d);
DType from_dsl(dsl::DType d);

}  // namespace flexc::detail
