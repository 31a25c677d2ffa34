#include "splice.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "embedded.h"
#include "flexc/error.h"

namespace flexc::jit {

namespace fs = std::filesystem;

std::optional<std::string> template_text(std::string_view name) {
  if (const char* dir = std::getenv("FLEXC_TEMPLATE_DIR"); dir && *dir) {
    // The file of that name in the directory or its folders (templates/ as it is in the tree).
    std::error_code ec;
    for (fs::recursive_directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
      if (it->path().filename() != name || !it->is_regular_file(ec)) continue;
      std::ifstream f(it->path(), std::ios::binary);
      if (f)
        return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
    }
  }
  for (const detail::EmbeddedFile& e : detail::embedded_files())
    if (e.kind == "template" && e.name == name) return std::string(e.text);
  return std::nullopt;
}

std::vector<std::string> template_names() {
  std::vector<std::string> names;
  for (const detail::EmbeddedFile& e : detail::embedded_files())
    if (e.kind == "template") names.emplace_back(e.name);
  std::sort(names.begin(), names.end());
  return names;
}

namespace {

// The target of a `#include "name"` line, or empty.
std::string_view quoted_include(std::string_view line) {
  size_t i = line.find_first_not_of(" \t");
  if (i == std::string_view::npos || line[i] != '#') return {};
  i = line.find_first_not_of(" \t", i + 1);
  if (i == std::string_view::npos || line.substr(i, 7) != "include") return {};
  i = line.find_first_not_of(" \t", i + 7);
  if (i == std::string_view::npos || line[i] != '"') return {};
  const size_t end = line.find('"', i + 1);
  return end == std::string_view::npos ? std::string_view{} : line.substr(i + 1, end - i - 1);
}

template <class Fn>
void for_each_line(std::string_view text, Fn fn) {
  size_t lineno = 1;
  while (!text.empty()) {
    const size_t nl = text.find('\n');
    fn(text.substr(0, nl), lineno++);
    if (nl == std::string_view::npos) break;
    text.remove_prefix(nl + 1);
  }
}

bool is_pragma_once(std::string_view line) {
  const size_t i = line.find_first_not_of(" \t");
  return i != std::string_view::npos && line.substr(i).starts_with("#pragma once");
}

}  // namespace

Unit splice(std::string_view template_name, std::string variant_header) {
  std::optional<std::string> main = template_text(template_name);
  if (!main) {
    std::string known;
    for (const std::string& n : template_names()) known += (known.empty() ? "" : ", ") + n;
    throw Error(fmt::format("unknown kernel template '{}' (templates: {})", template_name, known));
  }
  Unit u{{std::string(template_name), std::move(*main)}, {}};
  std::map<std::string, std::string, std::less<>> headers;
  std::vector<std::string> todo{u.main.text};
  while (!todo.empty()) {
    const std::string text = std::move(todo.back());
    todo.pop_back();
    for_each_line(text, [&](std::string_view line, size_t) {
      const std::string_view inc = quoted_include(line);
      if (inc.empty() || headers.contains(inc)) return;
      std::optional<std::string> h =
          inc == kVariantHeader ? std::optional<std::string>(variant_header) : template_text(inc);
      if (!h) return;
      todo.push_back(*h);
      headers.emplace(std::string(inc), std::move(*h));
    });
  }
  for (auto& [name, text] : headers) u.headers.push_back({name, std::move(text)});
  return u;
}

std::string flatten(const Unit& unit) {
  std::map<std::string_view, std::string_view> headers;
  for (const SourceFile& h : unit.headers) headers.emplace(h.name, h.text);
  std::set<std::string_view> done;
  std::string out =
      fmt::format("// {} spliced by flexc: one self-contained translation unit.\n", unit.main.name);
  const auto emit = [&](const auto& self, std::string_view name, std::string_view text) -> void {
    out += fmt::format("#line 1 \"{}\"\n", name);
    for_each_line(text, [&](std::string_view line, size_t lineno) {
      const std::string_view inc = quoted_include(line);
      const auto it = headers.find(inc);
      if (is_pragma_once(line) || (it != headers.end() && done.contains(inc))) {
        out += '\n';
        return;
      }
      if (it == headers.end()) {
        out.append(line);
        out += '\n';
        return;
      }
      done.insert(inc);
      self(self, it->first, it->second);
      out += fmt::format("#line {} \"{}\"\n", lineno + 1, name);
    });
  };
  emit(emit, unit.main.name, unit.main.text);
  return out;
}

}  // namespace flexc::jit
