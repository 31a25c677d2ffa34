#include "flexc/tensor.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <fmt/format.h>

#include "flexc/error.h"

namespace flexc {

namespace {
constexpr DType kAll[] = {DType::BF16, DType::F16, DType::F32, DType::I32, DType::Bool};
}

std::string_view dtype_name(DType d) {
  switch (d) {
    case DType::BF16: return "bf16";
    case DType::F16: return "fp16";
    case DType::F32: return "float32";
    case DType::I32: return "int32";
    case DType::Bool: return "bool";
  }
  return "?";
}

size_t dtype_size(DType d) {
  switch (d) {
    case DType::BF16:
    case DType::F16: return 2;
    case DType::F32:
    case DType::I32: return 4;
    case DType::Bool: return 1;
  }
  return 0;
}

DType parse_dtype(std::string_view name) {
  std::string names;
  for (DType d : kAll) {
    if (dtype_name(d) == name) return d;
    names += fmt::format("{}{}", names.empty() ? "" : ", ", dtype_name(d));
  }
  throw Error(fmt::format("unknown dtype '{}' (one of {})", name, names));
}

uint16_t float_to_bf16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

float bf16_to_float(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

uint16_t float_to_fp16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);     // NaN
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);    // rounds to inf
  if (a < 0x38800000u) {  // below the smallest normal half: round to a multiple of 2^-24
    const float scaled = std::bit_cast<float>(a) * 16777216.0f;  // exact
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(scaled)));
  }
  // Normal: rebias the exponent and round the 23-bit mantissa to 10 bits, nearest even.
  const uint32_t r = a - 0x38000000u;
  return static_cast<uint16_t>(sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13));
}

float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {  // zero or subnormal: m * 2^-24, exact in float
    const float f = static_cast<float>(m) * 5.9604644775390625e-8f;
    return std::bit_cast<float>(std::bit_cast<uint32_t>(f) | sign);
  }
  if (e == 31) return std::bit_cast<float>(sign | 0x7f800000u | (m << 13));
  return std::bit_cast<float>(sign | ((e + 112) << 23) | (m << 13));
}

TensorView TensorView::contiguous(const void* data, DType dtype, std::vector<int64_t> shape) {
  return TensorView{const_cast<void*>(data), dtype, std::move(shape), {}};
}

int64_t TensorView::stride(size_t dim) const {
  if (!strides.empty()) return strides.at(dim);
  int64_t s = 1;
  for (size_t i = dim + 1; i < shape.size(); ++i) s *= shape[i];
  return s;
}

TensorView TensorView::narrow(size_t dim, int64_t start, int64_t length) const {
  if (dim >= shape.size() || start < 0 || length < 0 || start > shape[dim] - length)
    throw Error(fmt::format("TensorView::narrow: dim {} elements [{}, {} + {}) are outside {}",
                            dim, start, start, length, describe()));
  TensorView v = *this;
  v.strides.clear();
  for (size_t i = 0; i < shape.size(); ++i) v.strides.push_back(stride(i));
  v.data = static_cast<char*>(data) + start * stride(dim) * int64_t(dtype_size(dtype));
  v.shape[dim] = length;
  return v;
}

int64_t TensorView::numel() const {
  // A zero dim empties the tensor even where the other dims' product would overflow.
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) return 0;
  int64_t n = 1;
  for (int64_t d : shape)
    if (__builtin_mul_overflow(n, d, &n))
      throw Error(fmt::format("TensorView {} [{}]: element count overflows int64",
                              dtype_name(dtype), fmt::join(shape, ", ")));
  return n;
}

std::string TensorView::describe() const {
  std::vector<int64_t> st;
  for (size_t i = 0; i < shape.size(); ++i) st.push_back(stride(i));
  return fmt::format("{} [{}] strides [{}]", dtype_name(dtype), fmt::join(shape, ", "),
                     fmt::join(st, ", "));
}

}  // namespace flexc
