// A variant's call arguments (runtime params and captured tensors by name) checked against its
// declarations and put in slot order, for the attention kernels (src/attention.cpp) and the CPU
// reference (src/reference.cpp).
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "jit/abi.h"
#include "flexc/tensor.h"
#include "variant_impl.h"

namespace flexc::detail {

// What capture dims named B, H, Q_LEN, KV_LEN mean in this call (H: the number of query heads,
// as the mods' `h` is a query head).
struct CallDims {
  int64_t B = 1, H = 1, q_len = 0, kv_len = 0;
};

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
