// Random 16-bit test tensors, shared by the attention tests: values exact in bf16 / fp16, drawn
// from the replayable generator of test_random.h.
#pragma once

#include <algorithm>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "flexc/device.h"
#include "flexc/npy.h"
#include "flexc/tensor.h"
#include "flexc/variant.h"
#include "test_random.h"

namespace flexc::testing {

inline float round16(DType d, float x) {
  return d == DType::BF16 ? bf16_to_float(float_to_bf16(x)) : fp16_to_float(float_to_fp16(x));
}

// Values as 16-bit `d` on the device (at least 16 bytes: an empty tensor still has an address),
// and back.
inline flexc::DeviceBuffer upload16(DType d, const std::vector<float>& x) {
  std::vector<uint16_t> bits(std::max<size_t>(x.size(), 8), 0);
  for (size_t i = 0; i < x.size(); ++i)
    bits[i] = d == DType::BF16 ? float_to_bf16(x[i]) : float_to_fp16(x[i]);
  flexc::DeviceBuffer buf(bits.size() * 2);
  buf.upload(bits.data(), bits.size() * 2);
  return buf;
}
inline std::vector<float> download16(DType d, const flexc::DeviceBuffer& buf, size_t n) {
  const std::vector<uint16_t> bits = buf.to_vector<uint16_t>(n);
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = d == DType::BF16 ? bf16_to_float(bits[i]) : fp16_to_float(bits[i]);
  return out;
}

// n normal values (standard deviation sd), each rounded to `d`.
inline std::vector<float> normal(size_t n, DType d, float sd = 1.f) {
  std::normal_distribution<float> nd(0.f, sd);
  std::vector<float> v(n);
  for (float& x : v) x = round16(d, nd(rng()));
  return v;
}

// Rows [r0, r0 + n) of every (batch, head) of a [B, H, L, d] tensor, as a [B, H, n, d] one.
template <class T>
std::vector<T> rows_of(const std::vector<T>& x, int64_t BH, int64_t L, int64_t d, int64_t r0,
                       int64_t n) {
  std::vector<T> out;
  out.reserve(BH * n * d);
  for (int64_t bh = 0; bh < BH; ++bh)
    out.insert(out.end(), x.begin() + (bh * L + r0) * d, x.begin() + (bh * L + r0 + n) * d);
  return out;
}

// The shape of case i of variant vi in a catalogue sweep over `lens`: dtypes and head dims 64 /
// 128 alternate, q lengths walk `lens` and kv lengths a rotation of it (equal once per variant),
// GQA 1 and 4, B 2 where Q_LEN * KV_LEN is small.
struct SweepShape {
  DType dtype = DType::BF16;
  int64_t B = 1, Hq = 1, Hkv = 1, Lq = 1, Lkv = 1, D = 64;
};
inline SweepShape sweep_shape(size_t vi, size_t i, std::span<const int64_t> lens) {
  SweepShape s;
  s.dtype = (i + vi) % 2 ? DType::F16 : DType::BF16;
  s.D = (i / 2 + vi) % 2 ? 128 : 64;
  s.Lq = lens[i];
  s.Lkv = lens[(i + vi) % lens.size()];
  s.Hkv = 2;
  s.Hq = i % 2 ? 8 : 2;
  s.B = s.Lq * s.Lkv < 200000 ? 2 : 1;
  return s;
}

// Random contents for a declared capture: small ints (so that masks comparing them are true and
// false), normal floats, random bools.
inline npy::Array random_capture(const CaptureSpec& c, int64_t B, int64_t H, int64_t Lq, int64_t Lkv) {
  npy::Array a;
  a.dtype = parse_dtype(c.dtype);
  for (const std::string& d : c.dims)
    a.shape.push_back(d == "B" ? B : d == "H" ? H : d == "Q_LEN" ? Lq : d == "KV_LEN" ? Lkv
                                                                          : std::stoll(d));
  const int64_t n = a.numel();
  a.bytes.resize(n * dtype_size(a.dtype));
  std::uniform_int_distribution<int32_t> small(0, 3);
  std::normal_distribution<float> nd(0.f, 0.5f);
  for (int64_t i = 0; i < n; ++i) {
    std::byte* at = a.bytes.data() + i * dtype_size(a.dtype);
    if (a.dtype == DType::I32) {
      const int32_t x = small(rng());
      std::memcpy(at, &x, 4);
    } else if (a.dtype == DType::F32) {
      const float x = nd(rng());
      std::memcpy(at, &x, 4);
    } else if (a.dtype == DType::Bool) {
      *at = std::byte(small(rng()) & 1);
    } else {
      const uint16_t x = a.dtype == DType::BF16 ? float_to_bf16(nd(rng())) : float_to_fp16(nd(rng()));
      std::memcpy(at, &x, 2);
    }
  }
  return a;
}

}  // namespace flexc::testing
