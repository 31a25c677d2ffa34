// NumPy .npy files (format versions 1-3, C order, little-endian), for `flexc run` and tests.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string_view>
#include <vector>

#include "flexc/tensor.h"

namespace flexc::npy {

struct Array {
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  std::vector<std::byte> bytes;  // numel * dtype_size(dtype), C order

  int64_t numel() const;
  TensorView view() const;  // a contiguous host view of `bytes`
  // The values as float32 (F32, BF16, F16 only).
  std::vector<float> to_float() const;
  // This array in another element type: only the same type, or float32 to bf16 / fp16 (rounded
  // to nearest even; NumPy has no bf16). Throws flexc::Error naming `what` for any other pair.
  Array as(DType to, std::string_view what) const;
};

// The largest .npy file read (a regular file: devices and FIFOs are refused before reading).
inline constexpr uint64_t kMaxFileBytes = uint64_t{16} << 30;

// dtypes read: <f4, <f2, <i4, |b1 as they are; <f8 as float32 and <i8 as int32 (values checked).
// Throws flexc::Error naming the file for anything else (Fortran order, big-endian, truncation,
// a header that lacks a key or garbles it, negative or non-numeric sizes).
Array read(const std::filesystem::path& path);

// Writes float32, fp16, int32 or bool arrays (NumPy has no bf16). Throws flexc::Error on I/O
// errors.
void write(const std::filesystem::path& path, const Array& a);
Array from_float(std::vector<int64_t> shape, std::span<const float> values);

}  // namespace flexc::npy
