// Tokens of the mod language. Internal to the front end (dsl/frontend.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "dsl/diagnostics.h"

namespace flexc::dsl {

enum class Tok : uint8_t {
  End,  // end of input; its range is empty, just after the last token
  Ident, Int, Float,
  // keywords
  Let, True, False, Inf, Nan, And, Or, Not,
  // punctuation and operators
  LParen, RParen, LBracket, RBracket, Comma, Semicolon, Assign, Question, Colon,
  Plus, Minus, Star, StarStar, Slash, SlashSlash, Percent, Shl, Shr,
  Lt, Le, Gt, Ge, EqEq, NotEq, Amp, Caret, Pipe, AmpAmp, PipePipe, Bang, Tilde,
};

struct Token {
  Tok kind = Tok::End;
  SrcRange range;
  uint64_t ival = 0;  // Int: the value, saturated at 2^32 (range checks happen in the parser)
  double fval = 0;    // Float: the value
};

// Splits `source` into tokens ending with Tok::End. Whitespace and `#` line comments are
// skipped. Bad tokens are reported into `diags` (runs of bad characters as one diagnostic) and
// left out of the result.
std::vector<Token> lex(std::string_view source, std::vector<Diagnostic>& diags);

// True for the words the lexer reserves: let, true, false, inf, nan, and, or, not.
bool is_keyword(std::string_view word);

// How a token is named in messages: "')'", "'let'", "the end of the input", "number '12'".
std::string describe(const Token& t, std::string_view source);

// Decodes the UTF-8 character at s[i] into `cp`; returns its length in bytes, or 0 when s[i]
// starts no valid character (a stray byte, an overlong form, a surrogate).
size_t decode_utf8(std::string_view s, size_t i, uint32_t& cp);

// The length in bytes of the line terminator at s[i], 0 when there is none. Every terminator
// Unicode names ends a line (and a `#` comment): LF, VT, FF, CR, CR LF, NEL, U+2028, U+2029, so
// that no editor shows as a new line what flexc reads as part of a comment.
size_t line_break_length(std::string_view s, size_t i);

// Shortens user text quoted in messages (names can be as long as the source).
std::string clip(std::string_view text);

}  // namespace flexc::dsl
