// The inputs of `flexc run` (attention and linear attention): host arrays as the kernels see
// them (rounded to their 16-bit type), read from .npy or drawn at random, and device copies.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "flexc/device.h"
#include "flexc/tensor.h"

namespace flexc::cli {

// An input on the host: the values the kernel sees (rounded to its dtype) and their 16-bit
// encoding.
struct Input {
  std::vector<int64_t> shape;
  std::vector<float> values;
  std::vector<uint16_t> bits;
};

Input encode(std::vector<int64_t> shape, std::vector<float> values, DType dtype);
// The .npy given as --`name`, of as many dims as `dims` names ("[B, H, SEQ, D]"); an empty path
// is an error naming what else supplies it (`instead`, e.g. "--random B,H,HK,T,DK").
Input read_input(const std::string& path, const char* name, DType dtype, std::string_view dims,
                 std::string_view instead);
// Normal random values.
Input random_input(std::vector<int64_t> shape, std::mt19937_64& rng, DType dtype);

// q, k and v: drawn in `shapes` (q's, k's, v's) when `random` is set, else read from the paths
// (`instead` names the --random form in messages). Both, or neither, is an error.
struct Qkv {
  Input q, k, v;
};
Qkv qkv_inputs(const std::string& random, const std::vector<std::vector<int64_t>>& shapes,
               const std::string& q, const std::string& k, const std::string& v,
               std::mt19937_64& rng, DType dtype, std::string_view instead);

std::vector<float> download_16bit(const flexc::DeviceBuffer& b, size_t n, DType dtype);
flexc::DeviceBuffer upload(const void* data, size_t bytes);

}  // namespace flexc::cli
