#include "dsl/diagnostics.h"

#include <algorithm>
#include <cctype>
#include <fmt/format.h>

#include "dsl/lexer.h"

namespace flexc::dsl {

LineCol line_col(std::string_view source, uint32_t offset) {
  const size_t end = std::min<size_t>(offset, source.size());
  LineCol lc;
  size_t line_start = 0;
  for (size_t i = 0; i < end;) {
    const size_t n = line_break_length(source, i);
    if (n == 0) {
      ++i;
    } else if (i + n <= end) {
      ++lc.line;
      line_start = i += n;
    } else {
      break;  // the offset points inside a CR LF or a multi-byte terminator: still this line
    }
  }
  lc.col = static_cast<uint32_t>(end - line_start + 1);
  return lc;
}

namespace {

// One displayed character of a source line: its bytes and whether it is shown as is.
struct Glyph {
  size_t begin, end;
  bool printable;
};

// Splits a line into glyphs: a tab, a printable ASCII byte or a valid UTF-8 sequence shows as
// itself (one column; wide characters are not measured); anything else shows as '?'.
std::vector<Glyph> glyphs(std::string_view line) {
  std::vector<Glyph> out;
  for (size_t i = 0; i < line.size();) {
    const auto c = static_cast<unsigned char>(line[i]);
    if (c < 0x80) {
      out.push_back({i, i + 1, c == '\t' || (c >= 0x20 && c < 0x7F)});
      ++i;
      continue;
    }
    uint32_t cp = 0;
    const size_t n = decode_utf8(line, i, cp);
    out.push_back({i, i + std::max<size_t>(n, 1), n != 0});
    i += std::max<size_t>(n, 1);
  }
  return out;
}

// Lines longer than this many glyphs are shown as a window around the caret.
constexpr size_t kMaxShownGlyphs = 100;
constexpr size_t kContextBefore = 40;

std::string_view severity_name(Severity s) {
  switch (s) {
    case Severity::Error: return "error";
    case Severity::Warning: return "warning";
    case Severity::Note: return "note";
  }
  return "error";
}

}  // namespace

std::string render(const Diagnostic& d, std::string_view source, std::string_view origin) {
  const uint32_t begin = std::min<uint32_t>(d.range.begin, static_cast<uint32_t>(source.size()));
  const LineCol lc = line_col(source, begin);
  std::string out;
  if (!origin.empty()) out += fmt::format("{}:", origin);
  out += fmt::format("{}:{}: {}: {}\n", lc.line, lc.col, severity_name(d.severity), d.message);

  const size_t line_start = begin - (lc.col - 1);
  size_t line_end = line_start;
  while (line_end < source.size() && line_break_length(source, line_end) == 0) ++line_end;
  line_end = std::max<size_t>(line_end, begin);  // `begin` inside a CR LF: show the line up to it
  const std::string_view line = source.substr(line_start, line_end - line_start);
  const size_t caret_begin = begin - line_start;
  const size_t caret_end =
      std::clamp<size_t>(std::max(d.range.end, begin), begin, line_end) - line_start;

  const std::vector<Glyph> gs = glyphs(line);
  // First glyph at or after the caret (gs.size() when the caret is at the end of the line).
  size_t g_caret = 0;
  while (g_caret < gs.size() && gs[g_caret].end <= caret_begin) ++g_caret;
  size_t g_first = 0, g_last = gs.size();
  if (gs.size() > kMaxShownGlyphs) {
    g_first = g_caret > kContextBefore ? g_caret - kContextBefore : 0;
    g_last = std::min(gs.size(), g_first + kMaxShownGlyphs);
  }
  std::string text = "  ", marks = "  ";
  if (g_first > 0) {
    text += "...";
    marks += "   ";
  }
  for (size_t i = g_first; i < g_last; ++i) {
    const Glyph& g = gs[i];
    text += g.printable ? line.substr(g.begin, g.end - g.begin) : "?";
    const bool tab = line[g.begin] == '\t';
    if (g.end <= caret_begin) marks += tab ? '\t' : ' ';
    else if (g.begin < caret_end || i == g_caret) marks += i == g_caret ? '^' : '~';
  }
  if (g_last < gs.size()) text += "...";
  if (g_caret >= g_last) marks += '^';  // the caret is past the last shown glyph
  out += text + "\n" + marks;
  if (!d.hint.empty()) out += fmt::format("\nhint: {}", d.hint);
  return out;
}

std::string render_all(const std::vector<Diagnostic>& ds, std::string_view source,
                       std::string_view origin) {
  std::string out;
  for (const Diagnostic& d : ds) {
    if (!out.empty()) out += '\n';
    out += render(d, source, origin);
  }
  return out;
}

DslError::DslError(std::vector<Diagnostic> diags, std::string source, std::string origin)
    : std::runtime_error(render_all(diags, source, origin)),
      diags_(std::move(diags)),
      source_(std::move(source)),
      origin_(std::move(origin)) {}

namespace {

// Optimal string alignment distance (Levenshtein plus adjacent transpositions), ignoring case;
// any value above `cutoff` is returned as cutoff + 1 (a row whose minimum passes it ends the work).
size_t edit_distance(std::string_view a, std::string_view b, size_t cutoff) {
  auto lower = [](char c) { return static_cast<char>(std::tolower(static_cast<unsigned char>(c))); };
  std::vector<size_t> prev2(b.size() + 1), prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    size_t row_min = cur[0];
    for (size_t j = 1; j <= b.size(); ++j) {
      const bool same = lower(a[i - 1]) == lower(b[j - 1]);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (same ? 0 : 1)});
      if (i > 1 && j > 1 && lower(a[i - 1]) == lower(b[j - 2]) &&
          lower(a[i - 2]) == lower(b[j - 1]))
        cur[j] = std::min(cur[j], prev2[j - 2] + 1);
      row_min = std::min(row_min, cur[j]);
    }
    // A transposition reads two rows back, so two rows past the cutoff end it.
    if (row_min > cutoff && *std::min_element(prev.begin(), prev.end()) > cutoff) return cutoff + 1;
    std::swap(prev2, prev);
    std::swap(prev, cur);
  }
  return std::min(prev[b.size()], cutoff + 1);
}

}  // namespace

std::string closest_name(std::string_view name, const std::vector<std::string>& candidates) {
  if (name.size() > kMaxSuggestedName) return {};
  // Close enough: a third of the name may be wrong, and at least one character must be right.
  const size_t limit = std::max<size_t>(1, name.size() / 3);
  std::string best;
  size_t best_distance = limit + 1;
  const size_t n = std::min(candidates.size(), kMaxSuggestionCandidates);
  for (size_t i = 0; i < n; ++i) {
    const std::string& c = candidates[i];
    const size_t gap = c.size() > name.size() ? c.size() - name.size() : name.size() - c.size();
    if (c == name || gap > limit) continue;
    const size_t dist = edit_distance(name, c, best_distance - 1);
    if (dist < best_distance && dist < std::max(name.size(), c.size())) {
      best = c;
      best_distance = dist;
    }
  }
  return best;
}

}  // namespace flexc::dsl
