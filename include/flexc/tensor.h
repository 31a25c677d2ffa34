// flexc::TensorView: a strided view of memory flexc reads or writes (device memory for kernels,
// host memory for the CPU reference and .npy files). It owns nothing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace flexc {

// Element types, named as variant configs name them ("bf16", "fp16", "float32", "int32",
// "bool"; bool is one byte, nonzero = true).
enum class DType : uint8_t { BF16, F16, F32, I32, Bool };

std::string_view dtype_name(DType d);
size_t dtype_size(DType d);
// Throws flexc::Error naming the accepted names.
DType parse_dtype(std::string_view name);

// 16-bit floats as raw bits, rounded to nearest even (NaN stays NaN).
uint16_t float_to_bf16(float f);
float bf16_to_float(uint16_t h);
uint16_t float_to_fp16(float f);
float fp16_to_float(uint16_t h);

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;  // in elements, one per dim; empty: contiguous (row-major)

  // A contiguous view; `data` may point at const memory the callee only reads.
  static TensorView contiguous(const void* data, DType dtype, std::vector<int64_t> shape);

  size_t rank() const { return shape.size(); }
  int64_t stride(size_t dim) const;  // resolves empty strides
  // Elements [start, start + length) of dimension `dim`, the others whole: the same memory, with
  // explicit strides (torch.narrow). Throws flexc::Error naming the view when out of range.
  TensorView narrow(size_t dim, int64_t start, int64_t length) const;
  // Throws flexc::Error naming the tensor's dtype and shape when the count overflows int64.
  int64_t numel() const;
  // "bf16 [2, 8, 1024, 128] strides [1048576, 131072, 128, 1]"
  std::string describe() const;
};

// Device memory for a call's temporaries (the backward's row sums and dq accumulator, decode's
// split partials), from the caller's allocator: flexc asks for `bytes` for work enqueued on the
// call's stream and never frees it; the allocator keeps it valid until that work is done (a
// framework's stream-ordered caching allocator may take it back as soon as the call returns).
// It must return memory on the current device aligned to 256 bytes, or throw. Unset: flexc's own
// stream-ordered pool.
using WorkspaceAllocator = std::function<void*(size_t bytes)>;

}  // namespace flexc
