// Diagnostics in the style of clang: "origin:line:col: error: message", the source line, a caret
// under the offending range, and an optional hint.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "dsl/ir.h"

namespace flexc::dsl {

enum class Severity { Error, Warning, Note };

struct Diagnostic {
  Severity severity = Severity::Error;
  SrcRange range;        // into the source the diagnostic was raised against
  std::string message;   // "unknown name 'q_id'"
  std::string hint;      // "did you mean 'q_idx'?" (may be empty)
};

struct LineCol {
  uint32_t line = 1, col = 1;  // 1-based; col counts bytes
};
LineCol line_col(std::string_view source, uint32_t offset);

// Renders one diagnostic:
//   score_mod:1:9: error: unknown name 'q_id'
//     score + q_id
//             ^~~~
//   hint: did you mean 'q_idx'?
std::string render(const Diagnostic& d, std::string_view source, std::string_view origin);
std::string render_all(const std::vector<Diagnostic>& ds, std::string_view source,
                       std::string_view origin);

// Thrown by the front end. what() is the full rendered text of every diagnostic.
class DslError : public std::runtime_error {
 public:
  DslError(std::vector<Diagnostic> diags, std::string source, std::string origin);
  const std::vector<Diagnostic>& diagnostics() const { return diags_; }
  const std::string& source() const { return source_; }
  const std::string& origin() const { return origin_; }

 private:
  std::vector<Diagnostic> diags_;
  std::string source_, origin_;
};

// Closest candidate by edit distance, or empty when none is close enough to suggest. Bounded work
// on any input: names longer than kMaxSuggestedName characters get no suggestion, only the first
// kMaxSuggestionCandidates candidates are compared, and each comparison stops once the distance
// is past what could be suggested.
inline constexpr size_t kMaxSuggestedName = 64;
inline constexpr size_t kMaxSuggestionCandidates = 1000;
std::string closest_name(std::string_view name, const std::vector<std::string>& candidates);

}  // namespace flexc::dsl
