// `--capture NAME=doc:... | docs:N`: document ids for mask captures (cli/mask_captures.h).
#include "cli/mask_captures.h"

#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <numeric>

#include "cli/args.h"
#include "flexc/error.h"

namespace flexc::cli {
namespace {

// Document ids along the last dim of a capture, repeated over its leading dims:
//   doc:S1,S2,...  documents start at token 0, S1, S2, ... (ascending)
//   docs:N         N documents of (nearly) equal length
std::vector<int32_t> document_ids(const std::string& name, const std::string& spec,
                                  const std::vector<int64_t>& shape) {
  const int64_t n = shape.back();
  std::vector<int64_t> starts{0};
  if (spec.starts_with("docs:")) {
    const int64_t k = parse_int(spec.substr(5), "--capture " + name + "=docs:N", 1, n);
    for (int64_t i = 1; i < k; ++i) starts.push_back(i * n / k);
  } else {
    std::string_view rest = std::string_view(spec).substr(4);
    while (!rest.empty()) {
      const size_t comma = rest.find(',');
      const int64_t s = parse_int(rest.substr(0, comma), "--capture " + name + "=doc:...", 0, n);
      if (s < starts.back())
        throw Error(fmt::format("--capture {}: document starts must ascend ({} after {})", name, s,
                                starts.back()));
      if (s > 0) starts.push_back(s);
      rest = comma == std::string_view::npos ? "" : rest.substr(comma + 1);
    }
  }
  std::vector<int32_t> ids(n);
  size_t doc = 0;
  for (int64_t t = 0; t < n; ++t) {
    while (doc + 1 < starts.size() && starts[doc + 1] <= t) ++doc;
    ids[t] = int32_t(doc);
  }
  const int64_t rows =
      std::accumulate(shape.begin(), shape.end() - 1, int64_t(1), std::multiplies<>());
  std::vector<int32_t> all;
  all.reserve(rows * n);
  for (int64_t r = 0; r < rows; ++r) all.insert(all.end(), ids.begin(), ids.end());
  return all;
}

}  // namespace

MaskCaptures document_captures(const Variant& v, const std::vector<std::string>& items,
                               int64_t batch, int64_t heads, int64_t q_len, int64_t kv_len) {
  MaskCaptures out;
  for (const auto& [name, spec] : assignments(items, "--capture")) {
    const auto& specs = v.captures();
    auto it = std::find_if(specs.begin(), specs.end(), [&](auto& s) { return s.name == name; });
    if (it == specs.end())
      throw Error(fmt::format("--capture {}: the variant declares no such capture", name));
    if (!spec.starts_with("doc:") && !spec.starts_with("docs:"))
      throw Error(
          fmt::format("--capture {}: expected doc:S1,S2,... or docs:N, got '{}'", name, spec));
    if (it->dtype != "int32")
      throw Error(fmt::format("--capture {}: document ids need an int32 capture, it is {}", name,
                              it->dtype));
    std::vector<int64_t> shape;
    for (const std::string& d : it->dims)
      shape.push_back(d == "B"        ? batch
                      : d == "H"      ? heads
                      : d == "Q_LEN"  ? q_len
                      : d == "KV_LEN" ? kv_len
                                      : parse_int(d, "capture dim"));
    checked_bytes(shape, 4, "--capture " + name);  // before building it
    out.ids.push_back(document_ids(name, spec, shape));
    out.captures[name] = CaptureData{out.ids.back().data(), nullptr, shape, {}};
  }
  for (const std::string& c : v.mask_deps().captures)
    if (!out.captures.contains(c))
      throw Error(
          fmt::format("mask_mod reads capture '{}': pass --capture {}=doc:S1,S2,... or "
                      "--capture {}=docs:N",
                      c, c, c));
  return out;
}

}  // namespace flexc::cli
