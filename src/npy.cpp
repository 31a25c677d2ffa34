// .npy read / write: the format of numpy.lib.format (a magic string, a version, a Python dict
// literal header padded to 64 bytes, then the raw little-endian data).
#include "flexc/npy.h"

#include <algorithm>
#include <bit>
#include <charconv>
#include <cstring>
#include <fmt/format.h>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>

#include "file_read.h"
#include "flexc/error.h"

static_assert(std::endian::native == std::endian::little, "flexc reads .npy data in place");

namespace flexc::npy {

namespace {

constexpr char kMagic[] = "\x93NUMPY";

[[noreturn]] void fail(const std::filesystem::path& path, const std::string& msg) {
  throw Error(fmt::format("{}: {}", path.string(), msg));
}

// The value of `key` in the header dict: the text after "'key':" up to the next top-level ','
// or '}' (a shape tuple's commas are inside parentheses).
std::string header_value(const std::string& header, std::string_view key) {
  const std::string k = fmt::format("'{}'", key);
  size_t at = header.find(k);
  if (at == std::string::npos) return {};
  at = header.find(':', at + k.size());
  if (at == std::string::npos) return {};
  size_t end = ++at;
  for (int depth = 0; end < header.size(); ++end) {
    const char c = header[end];
    if (c == '(') ++depth;
    if (c == ')') --depth;
    if (depth == 0 && (c == ',' || c == '}')) break;
  }
  std::string v = header.substr(at, end - at);
  const size_t b = v.find_first_not_of(" "), e = v.find_last_not_of(" ");
  return b == std::string::npos ? std::string() : v.substr(b, e - b + 1);
}

struct Descr {
  const char* text;
  DType dtype;
  size_t file_size;  // bytes per element in the file
};
constexpr Descr kDescrs[] = {{"'<f4'", DType::F32, 4}, {"'<f2'", DType::F16, 2},
                             {"'<i4'", DType::I32, 4}, {"'|b1'", DType::Bool, 1},
                             {"'<f8'", DType::F32, 8}, {"'<i8'", DType::I32, 8}};

const char* descr_of(DType d) {
  switch (d) {
    case DType::F32: return "<f4";
    case DType::F16: return "<f2";
    case DType::I32: return "<i4";
    case DType::Bool: return "|b1";
    case DType::BF16: break;
  }
  return nullptr;
}

}  // namespace

int64_t Array::numel() const {
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) return 0;
  int64_t n = 1;
  for (int64_t d : shape)
    if (__builtin_mul_overflow(n, d, &n))
      throw Error(fmt::format("npy::Array: shape of {} dims overflows int64", shape.size()));
  return n;
}

TensorView Array::view() const { return TensorView::contiguous(bytes.data(), dtype, shape); }

std::vector<float> Array::to_float() const {
  const int64_t n = numel();
  std::vector<float> out(n);
  for (int64_t i = 0; i < n; ++i) {
    uint16_t h = 0;
    switch (dtype) {
      case DType::F32: std::memcpy(&out[i], bytes.data() + 4 * i, 4); break;
      case DType::BF16:
        std::memcpy(&h, bytes.data() + 2 * i, 2);
        out[i] = bf16_to_float(h);
        break;
      case DType::F16:
        std::memcpy(&h, bytes.data() + 2 * i, 2);
        out[i] = fp16_to_float(h);
        break;
      default: throw Error(fmt::format("a {} array has no float values", dtype_name(dtype)));
    }
  }
  return out;
}

Array Array::as(DType to, std::string_view what) const {
  if (to == dtype) return *this;
  if (dtype != DType::F32 || (to != DType::BF16 && to != DType::F16))
    throw Error(fmt::format("{}: expected {} values, got {}{}", what, dtype_name(to),
                            dtype_name(dtype),
                            to == DType::BF16 || to == DType::F16 ? " (float32 is converted)" : ""));
  Array out{to, shape, std::vector<std::byte>(numel() * 2)};
  const std::vector<float> f = to_float();
  for (size_t i = 0; i < f.size(); ++i) {
    const uint16_t h = to == DType::BF16 ? float_to_bf16(f[i]) : float_to_fp16(f[i]);
    std::memcpy(out.bytes.data() + 2 * i, &h, 2);
  }
  return out;
}

Array read(const std::filesystem::path& path) {
  const std::string file = detail::read_regular_file(path, kMaxFileBytes, ".npy file");
  if (file.size() < 10 || file.compare(0, 6, kMagic, 6) != 0) fail(path, "not a .npy file");
  const int major = static_cast<unsigned char>(file[6]);
  if (major < 1 || major > 3) fail(path, fmt::format("unsupported .npy version {}", major));
  const size_t len_bytes = major == 1 ? 2 : 4;
  if (file.size() < 8 + len_bytes) fail(path, "truncated header");
  size_t header_len = 0;
  for (size_t i = 0; i < len_bytes; ++i)
    header_len |= static_cast<size_t>(static_cast<unsigned char>(file[8 + i])) << (8 * i);
  const size_t data_at = 8 + len_bytes + header_len;
  if (file.size() < data_at)
    fail(path, fmt::format("truncated header: it says {} bytes, the file has {} after it",
                           header_len, file.size() - 8 - len_bytes));
  const std::string header = file.substr(8 + len_bytes, header_len);
  const auto value = [&](std::string_view key) {
    std::string v = header_value(header, key);
    if (v.empty()) fail(path, fmt::format("the header has no '{}'", key));
    return v;
  };

  const std::string descr = value("descr");
  const Descr* dd = nullptr;
  for (const Descr& d : kDescrs)
    if (descr == d.text) dd = &d;
  if (!dd)
    fail(path, fmt::format("dtype {} is not supported (<f4, <f2, <f8, <i4, <i8, |b1)", descr));
  const std::string order = value("fortran_order");
  if (order == "True") fail(path, "Fortran-order arrays are not supported (save a C-order copy)");
  if (order != "False") fail(path, fmt::format("fortran_order is {}, not True or False", order));
  const std::string shape_text = value("shape");
  if (shape_text.size() < 2 || shape_text.front() != '(' || shape_text.back() != ')')
    fail(path, fmt::format("bad shape {}: expected a tuple of sizes", shape_text));
  Array a;
  a.dtype = dd->dtype;
  for (size_t at = 1; at + 1 < shape_text.size();) {
    const size_t comma = shape_text.find(',', at);
    std::string_view item = std::string_view(shape_text).substr(
        at, std::min(comma, shape_text.size() - 1) - at);
    const size_t b = item.find_first_not_of(' '), e = item.find_last_not_of(' ');
    if (b != std::string_view::npos) {
      item = item.substr(b, e - b + 1);
      int64_t d = -1;
      const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), d);
      if (ec != std::errc() || end != item.data() + item.size())
        fail(path, fmt::format("bad shape {}: '{}' is not a size", shape_text, item));
      if (d < 0) fail(path, fmt::format("bad shape {}: negative size {}", shape_text, d));
      a.shape.push_back(d);
    } else if (comma != std::string::npos && !(a.shape.size() == 1 && comma + 2 == shape_text.size())) {
      fail(path, fmt::format("bad shape {}: an empty size", shape_text));
    }
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  // Count in checked arithmetic against what the file holds: a corrupt shape must not wrap the
  // byte count (and pass the size check) or ask for an allocation that cannot be made.
  const size_t have = file.size() - data_at;
  const bool empty = std::find(a.shape.begin(), a.shape.end(), 0) != a.shape.end();
  int64_t n = empty ? 0 : 1;
  for (int64_t d : a.shape)
    if (!empty &&
        (__builtin_mul_overflow(n, d, &n) || static_cast<uint64_t>(n) > have / dd->file_size))
      fail(path, fmt::format("truncated: shape {} needs more than the {} bytes of data the file has",
                             shape_text, have));
  const char* data = file.data() + data_at;
  a.bytes.resize(n * dtype_size(a.dtype));
  if (dd->file_size == dtype_size(a.dtype)) {
    std::memcpy(a.bytes.data(), data, a.bytes.size());
  } else if (a.dtype == DType::F32) {  // <f8
    for (int64_t i = 0; i < n; ++i) {
      double x;
      std::memcpy(&x, data + 8 * i, 8);
      const float f = static_cast<float>(x);
      std::memcpy(a.bytes.data() + 4 * i, &f, 4);
    }
  } else {  // <i8
    for (int64_t i = 0; i < n; ++i) {
      int64_t x;
      std::memcpy(&x, data + 8 * i, 8);
      if (x < std::numeric_limits<int32_t>::min() || x > std::numeric_limits<int32_t>::max())
        fail(path, fmt::format("element {} = {} does not fit int32", i, x));
      const int32_t y = static_cast<int32_t>(x);
      std::memcpy(a.bytes.data() + 4 * i, &y, 4);
    }
  }
  return a;
}

void write(const std::filesystem::path& path, const Array& a) {
  const char* descr = descr_of(a.dtype);
  if (!descr) fail(path, fmt::format("{} cannot be stored in a .npy file", dtype_name(a.dtype)));
  if (a.bytes.size() != static_cast<size_t>(a.numel()) * dtype_size(a.dtype))
    fail(path, "the array's bytes do not match its shape");
  std::string shape = "(";
  for (int64_t d : a.shape) shape += fmt::format("{}, ", d);
  if (a.shape.size() > 1) shape.resize(shape.size() - 2);
  if (a.shape.size() == 1) shape.pop_back();
  shape += ")";
  std::string header =
      fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': {}, }}", descr, shape);
  // Magic (6) + version (2) + length (2) + header + '\n', padded to a multiple of 64.
  header.append(63 - (10 + header.size()) % 64, ' ');
  header += '\n';
  if (header.size() > 65535) fail(path, "shape too long for a version 1.0 header");
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) fail(path, "cannot create");
  out.write(kMagic, 6);
  const char version[2] = {1, 0};
  out.write(version, 2);
  const char len[2] = {static_cast<char>(header.size() & 0xff), static_cast<char>(header.size() >> 8)};
  out.write(len, 2);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(reinterpret_cast<const char*>(a.bytes.data()),
            static_cast<std::streamsize>(a.bytes.size()));
  if (!out) fail(path, "write failed");
}

Array from_float(std::vector<int64_t> shape, std::span<const float> values) {
  Array a{DType::F32, std::move(shape), {}};
  if (static_cast<int64_t>(values.size()) != a.numel())
    throw Error(fmt::format("npy::from_float: {} values for shape of {} elements", values.size(),
                            a.numel()));
  a.bytes.resize(values.size_bytes());
  std::memcpy(a.bytes.data(), values.data(), values.size_bytes());
  return a;
}

}  // namespace flexc::npy
