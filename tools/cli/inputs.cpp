// The inputs of `flexc run` (inputs.h).
#include "cli/inputs.h"

#include <fmt/format.h>

#include <algorithm>

#include "flexc/error.h"
#include "flexc/npy.h"

namespace flexc::cli {

Input encode(std::vector<int64_t> shape, std::vector<float> values, DType dtype) {
  Input in{std::move(shape), std::move(values), {}};
  in.bits.resize(in.values.size());
  for (size_t i = 0; i < in.values.size(); ++i) {
    in.bits[i] = dtype == DType::BF16 ? float_to_bf16(in.values[i]) : float_to_fp16(in.values[i]);
    in.values[i] = dtype == DType::BF16 ? bf16_to_float(in.bits[i]) : fp16_to_float(in.bits[i]);
  }
  return in;
}

Input read_input(const std::string& path, const char* name, DType dtype, std::string_view dims,
                 std::string_view instead) {
  if (path.empty())
    throw Error(fmt::format("--{} FILE.npy is required (or {})", name, instead));
  const npy::Array a = npy::read(path);
  const size_t rank = size_t(std::count(dims.begin(), dims.end(), ',')) + 1;
  if (a.shape.size() != rank)
    throw Error(fmt::format("--{} {}: expected a {} array, got rank {}", name, path, dims,
                            a.shape.size()));
  return encode(a.shape, a.as(DType::F32, fmt::format("--{} {}", name, path)).to_float(), dtype);
}

Input random_input(std::vector<int64_t> shape, std::mt19937_64& rng, DType dtype) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> v(n);
  for (float& x : v) x = nd(rng);
  return encode(std::move(shape), std::move(v), dtype);
}

Qkv qkv_inputs(const std::string& random, const std::vector<std::vector<int64_t>>& shapes,
               const std::string& q, const std::string& k, const std::string& v,
               std::mt19937_64& rng, DType dtype, std::string_view instead) {
  if (!random.empty()) {
    if (!q.empty() || !k.empty() || !v.empty())
      throw Error("--random generates q, k and v: give it or --q/--k/--v, not both");
    Qkv out;
    out.q = random_input(shapes[0], rng, dtype);
    out.k = random_input(shapes[1], rng, dtype);
    out.v = random_input(shapes[2], rng, dtype);
    return out;
  }
  constexpr std::string_view dims = "[B, H, SEQ, D]";
  return {read_input(q, "q", dtype, dims, instead), read_input(k, "k", dtype, dims, instead),
          read_input(v, "v", dtype, dims, instead)};
}

std::vector<float> download_16bit(const flexc::DeviceBuffer& b, size_t n, DType dtype) {
  const std::vector<uint16_t> bits = b.to_vector<uint16_t>(n);
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i)
    out[i] = dtype == DType::BF16 ? bf16_to_float(bits[i]) : fp16_to_float(bits[i]);
  return out;
}

flexc::DeviceBuffer upload(const void* data, size_t bytes) {
  flexc::DeviceBuffer b(std::max<size_t>(bytes, 16));
  b.upload(data, bytes);
  return b;
}

}  // namespace flexc::cli
