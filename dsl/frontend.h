// Text -> checked Mod. The lexer, parser and checker live behind this one call.
#pragma once

#include <string_view>

#include "dsl/diagnostics.h"
#include "dsl/ir.h"

namespace flexc::dsl {

// Hard limits: input past them is an error with a clear message, never a stack overflow.
struct Limits {
  size_t max_source_bytes = 64 * 1024;
  // Nesting of parentheses / operators / calls, and the depth of the IR (so a long chain
  // `a + b + ...` counts too: the printer and other passes recurse on it).
  int max_depth = 256;
  size_t max_nodes = 20000;     // IR nodes after checking
  // Size of the expression with every let inlined (what to_text prints): lets that reuse each
  // other can double it per line.
  size_t max_expanded_nodes = 100000;
  size_t max_errors = 20;       // errors reported before giving up
};

// Parses and checks one mod. `kind` fixes the result type (Score: float, Mask: bool) and which
// inputs are visible (`score` only in a score_mod). Names resolve, in order, to: let bindings,
// built-in inputs, declared params (const ones are folded to constants), declared captures
// (must be indexed), built-in functions. Throws DslError carrying every error found.
Mod parse_mod(ModKind kind, std::string_view source, const Decls& decls, std::string origin,
              const Limits& limits = {});

// True for identifiers the language reserves (inputs, built-in functions, literals like `inf`,
// `let`): a declaration may not use them as a name.
bool is_reserved_name(std::string_view name);
// True for [A-Za-z_][A-Za-z0-9_]*.
bool is_identifier(std::string_view name);

}  // namespace flexc::dsl
