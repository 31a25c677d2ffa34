#include "attention/attention_args.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "dsl/analysis.h"
#include "dsl/diagnostics.h"
#include "flexc/error.h"

namespace flexc::detail {

namespace {

std::string suggestion(std::string_view name, const std::vector<std::string>& names) {
  const std::string near = dsl::closest_name(name, names);
  return near.empty() ? "" : fmt::format(" (did you mean '{}'?)", near);
}

int64_t resolve_dim(const dsl::Dim& d, const CallDims& c) {
  switch (d.kind) {
    case dsl::Dim::Fixed:
      return d.extent;
    case dsl::Dim::B:
      return c.B;
    case dsl::Dim::H:
      return c.H;
    case dsl::Dim::QLen:
      return c.q_len;
    case dsl::Dim::KvLen:
      return c.kv_len;
  }
  return 0;
}

}  // namespace

dsl::DType to_dsl(DType d) {
  switch (d) {
    case DType::BF16:
      return dsl::DType::BF16;
    case DType::F16:
      return dsl::DType::F16;
    case DType::F32:
      return dsl::DType::F32;
    case DType::I32:
      return dsl::DType::I32;
    case DType::Bool:
      return dsl::DType::Bool;
  }
  return dsl::DType::F32;
}

DType from_dsl(dsl::DType d) {
  switch (d) {
    case dsl::DType::BF16:
      return DType::BF16;
    case dsl::DType::F16:
      return DType::F16;
    case dsl::DType::F32:
      return DType::F32;
    case dsl::DType::I32:
      return DType::I32;
    case dsl::DType::Bool:
      return DType::Bool;
  }
  return DType::F32;
}

Positions resolve_positions(std::string_view what, int64_t q_len, int64_t kv_len, int64_t q_offset,
                            int64_t kv_offset, int64_t seq_q_len, int64_t seq_kv_len,
                            int64_t max_len) {
  const int64_t kMax = max_len;
  Positions pos{q_offset, kv_offset, seq_q_len, seq_kv_len};
  const struct {
    const char *offset_name, *len_name, *rows_name;
    int64_t offset, rows;
    int64_t& seq;
  } sides[] = {{"q_offset", "seq_q_len", "Q_LEN", q_offset, q_len, pos.seq_q_len},
               {"kv_offset", "seq_kv_len", "KV_LEN", kv_offset, kv_len, pos.seq_kv_len}};
  for (const auto& s : sides) {
    if (s.offset < 0 || s.offset > kMax)
      throw Error(fmt::format("{}: {} = {} must be >= 0 and at most {}", what, s.offset_name,
                              s.offset, kMax));
    const int64_t end = s.offset + s.rows;  // both below 2^31: no overflow
    if (s.seq == 0) s.seq = end;
    if (s.seq < end || s.seq > kMax)
      throw Error(fmt::format("{}: {} = {} must hold {} + {} = {} (and be at most {}); 0 means {}",
                              what, s.len_name, s.seq, s.offset_name, s.rows_name, end, kMax, end));
  }
  return pos;
}

std::vector<double> resolve_params(const VariantImpl& v,
                                   const std::map<std::string, double, std::less<>>& by_name,
                                   std::string_view what) {
  const auto& decls = v.decls.params;
  std::vector<double> values(decls.size());
  for (size_t i = 0; i < decls.size(); ++i) values[i] = decls[i].default_value;
  std::vector<std::string> names;
  for (const auto& d : decls) names.push_back(d.name);
  for (const auto& [name, value] : by_name) {
    auto it = std::find(names.begin(), names.end(), name);
    if (it == names.end())
      throw Error(fmt::format("{}: '{}' declares no param '{}'{}", what, v.name, name,
                              suggestion(name, names)));
    const dsl::ParamDecl& d = decls[it - names.begin()];
    if (d.is_const)
      throw Error(fmt::format("{}: param '{}' is const (folded into the code); it cannot be set",
                              what, name));
    if (d.type == dsl::Type::Int &&
        (value != std::floor(value) || std::abs(value) > std::numeric_limits<int32_t>::max()))
      throw Error(fmt::format("{}: param '{}' is an int32; got {}", what, name, value));
    if (!std::isfinite(value))
      throw Error(fmt::format("{}: param '{}' = {} is not finite", what, name, value));
    values[it - names.begin()] = value;
  }
  return values;
}

void check_capture_name(const VariantImpl& v, std::string_view name, std::string_view what) {
  std::vector<std::string> names;
  for (const auto& d : v.decls.captures) names.push_back(d.name);
  if (std::find(names.begin(), names.end(), name) == names.end())
    throw Error(fmt::format("{}: '{}' declares no capture '{}'{}", what, v.name, name,
                            suggestion(name, names)));
}

void check_capture(const dsl::CaptureDecl& d, const TensorView& t, const CallDims& dims,
                   std::string_view what, std::string_view data_name) {
  const std::string arg = fmt::format("{}: capture '{}'", what, d.name);
  if (to_dsl(t.dtype) != d.dtype)
    throw Error(fmt::format("{} is {}; its declaration says {}", arg, dtype_name(t.dtype),
                            dsl::dtype_name(d.dtype)));
  // A misaligned capture faults on the device and poisons the context.
  if (reinterpret_cast<uintptr_t>(t.data) % dtype_size(t.dtype) != 0)
    throw Error(fmt::format("{}: {} is not aligned to its {}-byte elements", arg, data_name,
                            dtype_size(t.dtype)));
  std::vector<int64_t> want;
  std::vector<std::string> dim_names;
  for (const dsl::Dim& dim : d.dims) {
    want.push_back(resolve_dim(dim, dims));
    dim_names.push_back(dsl::dim_name(dim));
  }
  if (t.shape != want)
    throw Error(fmt::format("{} has shape [{}]; its declaration [{}] needs [{}]", arg,
                            fmt::join(t.shape, ", "), fmt::join(dim_names, ", "),
                            fmt::join(want, ", ")));
  if (!t.strides.empty() && t.strides.size() != t.shape.size())
    throw Error(fmt::format("{}: {} strides for rank {}", arg, t.strides.size(), t.rank()));
  for (int64_t s : t.strides)
    if (s < 0) throw Error(fmt::format("{}: negative stride {}", arg, s));
  for (int64_t n : t.shape)
    if (n > std::numeric_limits<int32_t>::max())
      throw Error(fmt::format("{}: dimension {} exceeds int32", arg, n));
}

std::vector<const TensorView*> resolve_captures(
    const VariantImpl& v, const std::map<std::string, TensorView, std::less<>>& by_name,
    const CallDims& dims, std::string_view what) {
  for (const auto& [name, view] : by_name) check_capture_name(v, name, what);
  const auto& decls = v.decls.captures;
  std::vector<bool> read(decls.size());
  for (const dsl::Mod* m : {&v.score, &v.mask})
    for (uint16_t slot : dsl::dependencies(m->graph, m->graph.root).captures) read[slot] = true;

  std::vector<const TensorView*> out(decls.size(), nullptr);
  for (size_t slot = 0; slot < decls.size(); ++slot) {
    const dsl::CaptureDecl& d = decls[slot];
    auto it = by_name.find(d.name);
    if (it == by_name.end()) {
      if (read[slot])
        throw Error(
            fmt::format("{}: '{}' reads capture '{}': pass it in captures", what, v.name, d.name));
      continue;
    }
    const TensorView& t = it->second;
    if (t.data == nullptr) throw Error(fmt::format("{}: capture '{}' has no data", what, d.name));
    check_capture(d, t, dims, what);
    out[slot] = &t;
  }
  return out;
}

FlexcArgs kernel_args(const VariantImpl& v, std::span<const double> params,
                      std::span<const TensorView* const> captures) {
  FlexcArgs a{};
  for (size_t slot = 0; slot < captures.size(); ++slot) {
    const TensorView* t = captures[slot];
    if (t == nullptr) continue;
    FlexcCapture& c = a.captures[slot];
    c.data = t->data;
    for (size_t d = 0; d < 4; ++d) {
      c.shape[d] = d < t->rank() ? static_cast<int>(t->shape[d]) : 1;
      c.stride[d] = d < t->rank() ? t->stride(d) : 0;
    }
  }
  for (size_t slot = 0; slot < params.size(); ++slot) {
    const dsl::ParamDecl& d = v.decls.params[slot];
    if (d.is_const) continue;  // runtime params come first: slot < FLEXC_MAX_PARAMS
    if (d.type == dsl::Type::Int)
      a.iparam[slot] = static_cast<int>(params[slot]);
    else
      a.fparam[slot] = static_cast<float>(params[slot]);
  }
  return a;
}

}  // namespace flexc::detail
