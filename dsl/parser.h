// The syntax tree of a mod, with source ranges. Internal to the front end (dsl/frontend.cpp).
//
// Nodes are stored in creation order, which puts every node after its children: the checker
// walks the vector front to back, with no recursion however deep the expression.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "dsl/diagnostics.h"
#include "dsl/ir.h"
#include "dsl/lexer.h"

namespace flexc::dsl {

enum class Syntax : uint8_t {
  Int,      // `ival` (a negated literal `-5` is one node with ival -5)
  Float,    // `fval` (also `inf`, `nan`, and their negations)
  Bool,     // `ival` 0 or 1
  Name,     // `name`
  Unary,    // `op`: Neg, Not, BitNot; children: operand
  Binary,   // `op`; children: lhs, rhs
  Select,   // `c ? a : b`; children: c, a, b
  Call,     // `name(args...)`; children: the arguments
  Index,    // `name[idx...]`; children: the indices
};

struct SyntaxNode {
  Syntax kind = Syntax::Int;
  Op op = Op::Const;
  SrcRange range;     // the whole expression
  SrcRange op_range;  // the operator token, or the name for Name / Call / Index
  std::string_view name;
  int64_t ival = 0;
  double fval = 0;
  uint32_t first_child = 0, num_children = 0;  // into SyntaxTree::children
  bool parenthesized = false;                  // written in parentheses (range includes them)
};

struct LetBinding {
  std::string_view name;
  SrcRange name_range;
  uint32_t value = 0;  // node index of the bound expression
};

struct SyntaxTree {
  std::vector<SyntaxNode> nodes;
  std::vector<uint32_t> children;
  std::vector<LetBinding> lets;  // in source order
  uint32_t result = 0;           // node index of the final expression

  std::span<const uint32_t> children_of(const SyntaxNode& n) const {
    return std::span(children).subspan(n.first_child, n.num_children);
  }
};

// Parses tokens from lex(). Syntax errors go into `diags`; after one, parsing resumes at the
// next `;` so that errors in later statements are found too. `max_depth` bounds the nesting
// (and the parser's recursion); `max_errors` stops early. The tree is usable only when no error
// was added.
SyntaxTree parse(std::string_view source, const std::vector<Token>& tokens, int max_depth,
                 size_t max_errors, std::vector<Diagnostic>& diags);

}  // namespace flexc::dsl
