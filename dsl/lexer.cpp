#include "dsl/lexer.h"

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <cmath>
#include <fmt/format.h>
#include <limits>

namespace flexc::dsl {

namespace {

bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_ident_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool is_ident_char(char c) { return is_ident_start(c) || is_digit(c); }
bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

struct Spelling {
  std::string_view text;
  Tok kind;
};
constexpr Spelling kKeywords[] = {
    {"let", Tok::Let}, {"true", Tok::True}, {"false", Tok::False}, {"inf", Tok::Inf},
    {"nan", Tok::Nan}, {"and", Tok::And},   {"or", Tok::Or},       {"not", Tok::Not},
};

// Longest spellings first so that "<<" wins over "<".
constexpr Spelling kPuncts[] = {
    {"**", Tok::StarStar}, {"//", Tok::SlashSlash}, {"<<", Tok::Shl},   {">>", Tok::Shr},
    {"<=", Tok::Le},       {">=", Tok::Ge},         {"==", Tok::EqEq},  {"!=", Tok::NotEq},
    {"&&", Tok::AmpAmp},   {"||", Tok::PipePipe},   {"(", Tok::LParen}, {")", Tok::RParen},
    {"[", Tok::LBracket},  {"]", Tok::RBracket},    {",", Tok::Comma},  {";", Tok::Semicolon},
    {"=", Tok::Assign},    {"?", Tok::Question},    {":", Tok::Colon},  {"+", Tok::Plus},
    {"-", Tok::Minus},     {"*", Tok::Star},        {"/", Tok::Slash},  {"%", Tok::Percent},
    {"<", Tok::Lt},        {">", Tok::Gt},          {"&", Tok::Amp},    {"^", Tok::Caret},
    {"|", Tok::Pipe},      {"!", Tok::Bang},        {"~", Tok::Tilde},
};

SrcRange range_of(size_t begin, size_t end) {
  return {static_cast<uint32_t>(begin), static_cast<uint32_t>(end)};
}

// A character no token starts with: reported with its code point, or its byte when it is not
// UTF-8. Returns the message and advances `i` past it.
std::string bad_character(std::string_view s, size_t& i) {
  uint32_t cp = 0;
  const size_t n = decode_utf8(s, i, cp);
  if (n == 0) return fmt::format("invalid byte 0x{:02X} (the source is not UTF-8)",
                                 static_cast<unsigned char>(s[i++]));
  i += n;
  if (cp >= 0x21 && cp < 0x7F) return fmt::format("invalid character '{}'", static_cast<char>(cp));
  if (cp < 0x80) return fmt::format("invalid character U+{:04X}", cp);
  return fmt::format("invalid character U+{:04X}: only ASCII is allowed outside comments", cp);
}

// True when the decimal literal `text` (digits, '.', an optional exponent) is below 1 in
// magnitude: its leading nonzero digit stands right of the decimal point once the exponent is
// applied. Tells an underflow from an overflow when the literal is out of a double's range.
bool below_one(std::string_view text) {
  const size_t e = text.find_first_of("eE");
  const std::string_view mantissa = text.substr(0, e);
  int64_t exponent = 0;
  if (e != std::string_view::npos) {
    size_t i = e + 1;
    const bool negative = i < text.size() && text[i] == '-';
    if (i < text.size() && (text[i] == '-' || text[i] == '+')) ++i;
    for (; i < text.size(); ++i) exponent = std::min<int64_t>(exponent * 10 + (text[i] - '0'), int64_t{1} << 40);
    if (negative) exponent = -exponent;
  }
  const size_t dot = std::min(mantissa.find('.'), mantissa.size());
  const size_t lead = mantissa.find_first_not_of("0.");
  if (lead == std::string_view::npos) return true;  // zero
  const int64_t lead_power = lead < dot ? static_cast<int64_t>(dot - lead - 1)
                                        : -static_cast<int64_t>(lead - dot);
  return lead_power + exponent < 0;
}

class Lexer {
 public:
  Lexer(std::string_view src, std::vector<Diagnostic>& diags) : s_(src), diags_(diags) {}

  std::vector<Token> run() {
    std::vector<Token> out;
    size_t last_end = 0;
    while (true) {
      skip_space_and_comments();
      if (i_ >= s_.size()) break;
      Token t;
      if (next(t)) {
        last_end = t.range.end;
        out.push_back(t);
      }
    }
    Token end;
    end.range = range_of(last_end, last_end);
    out.push_back(end);
    return out;
  }

 private:
  void skip_space_and_comments() {
    while (i_ < s_.size()) {
      if (is_space(s_[i_])) {
        ++i_;
      } else if (const size_t n = line_break_length(s_, i_)) {  // NEL, U+2028, U+2029
        i_ += n;
      } else if (s_[i_] == '#') {
        while (i_ < s_.size() && line_break_length(s_, i_) == 0) ++i_;
      } else {
        break;
      }
    }
  }

  void error(size_t begin, size_t end, std::string message, std::string hint = {}) {
    diags_.push_back({Severity::Error, range_of(begin, end), std::move(message), std::move(hint)});
  }

  // Lexes one token at i_; false when the text there was bad (and reported).
  bool next(Token& t) {
    const size_t begin = i_;
    const char c = s_[i_];
    if (is_ident_start(c)) {
      while (i_ < s_.size() && is_ident_char(s_[i_])) ++i_;
      t.kind = Tok::Ident;
      const std::string_view text = s_.substr(begin, i_ - begin);
      for (const Spelling& k : kKeywords)
        if (k.text == text) t.kind = k.kind;
      t.range = range_of(begin, i_);
      return true;
    }
    if (is_digit(c) || (c == '.' && i_ + 1 < s_.size() && is_digit(s_[i_ + 1])))
      return number(t);
    for (const Spelling& p : kPuncts)
      if (s_.substr(i_, p.text.size()) == p.text) {
        i_ += p.text.size();
        t.kind = p.kind;
        t.range = range_of(begin, i_);
        return true;
      }
    // A run of bad characters is one error, named after its first character.
    std::string message = bad_character(s_, i_);
    while (i_ < s_.size() && !starts_token(i_)) bad_character(s_, i_);
    error(begin, i_, std::move(message));
    return false;
  }

  bool starts_token(size_t i) const {
    const char c = s_[i];
    if (is_space(c) || c == '#' || is_ident_char(c) || c == '.') return true;
    for (const Spelling& p : kPuncts)
      if (p.text[0] == c) return true;
    return false;
  }

  bool number(Token& t) {
    const size_t begin = i_;
    bool is_float = false;
    while (i_ < s_.size() && is_digit(s_[i_])) ++i_;
    if (i_ < s_.size() && s_[i_] == '.') {
      is_float = true;
      ++i_;
      while (i_ < s_.size() && is_digit(s_[i_])) ++i_;
    }
    if (i_ < s_.size() && (s_[i_] == 'e' || s_[i_] == 'E')) {
      size_t j = i_ + 1;
      if (j < s_.size() && (s_[j] == '+' || s_[j] == '-')) ++j;
      if (j < s_.size() && is_digit(s_[j])) {
        is_float = true;
        i_ = j;
        while (i_ < s_.size() && is_digit(s_[i_])) ++i_;
      }
    }
    const size_t digits_end = i_;
    // Letters, digits or dots glued to a number make it invalid ("1.0f", "0x1F", "1e", "1.2.3").
    while (i_ < s_.size() && (is_ident_char(s_[i_]) || s_[i_] == '.')) ++i_;
    const std::string_view text = s_.substr(begin, i_ - begin);
    if (i_ != digits_end) {
      std::string hint;
      const std::string_view suffix = s_.substr(digits_end, i_ - digits_end);
      if (suffix == "f" || suffix == "F") hint = fmt::format("write {} (literals need no suffix)", s_.substr(begin, digits_end - begin));
      else if (text.size() > 1 && text[0] == '0' && (text[1] == 'x' || text[1] == 'X' || text[1] == 'b' || text[1] == 'B')) hint = "only decimal numbers are supported";
      else if (suffix[0] == 'e' || suffix[0] == 'E') hint = "an exponent needs digits, as in 1e-3";
      error(begin, i_, fmt::format("invalid number '{}'", clip(text)), std::move(hint));
      return false;
    }
    t.range = range_of(begin, i_);
    if (!is_float) {
      if (text.size() > 1 && text[0] == '0') {
        const size_t nz = text.find_first_not_of('0');
        error(begin, i_, fmt::format("invalid number '{}': leading zeros are not allowed", clip(text)),
              fmt::format("write {}", nz == std::string_view::npos ? "0" : clip(text.substr(nz))));
        return false;
      }
      constexpr uint64_t kSaturate = uint64_t{1} << 32;
      uint64_t v = 0;
      for (char d : text) v = std::min<uint64_t>(kSaturate, v * 10 + static_cast<uint64_t>(d - '0'));
      t.kind = Tok::Int;
      t.ival = v;
      return true;
    }
    double v = 0;
    auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    // Underflow (1e-400, or 0.000...1 with 400 zeros) is the value zero, as in float32 anyway.
    if (ec == std::errc::result_out_of_range && below_one(text)) {
      v = 0;
      ec = std::errc();
    }
    if (ec != std::errc() || ptr != text.data() + text.size() ||
        !std::isfinite(static_cast<float>(v))) {  // rounds to a finite float32 (3.4028235e38 does)
      error(begin, i_, fmt::format("float literal '{}' is out of range", clip(text)),
            "kernels compute in float32: literals must lie within +-3.4e38 (write inf for infinity)");
      return false;
    }
    t.kind = Tok::Float;
    t.fval = v;
    return true;
  }

  std::string_view s_;
  std::vector<Diagnostic>& diags_;
  size_t i_ = 0;
};

}  // namespace

size_t decode_utf8(std::string_view s, size_t i, uint32_t& cp) {
  const auto c = static_cast<unsigned char>(s[i]);
  size_t n;
  if (c < 0x80) n = 1, cp = c;
  else if (c >= 0xC2 && c <= 0xDF) n = 2, cp = c & 0x1F;
  else if (c >= 0xE0 && c <= 0xEF) n = 3, cp = c & 0x0F;
  else if (c >= 0xF0 && c <= 0xF4) n = 4, cp = c & 0x07;
  else return 0;
  if (i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    const auto cc = static_cast<unsigned char>(s[i + k]);
    if ((cc & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (cc & 0x3F);
  }
  // Overlong forms, surrogates and values past U+10FFFF are not valid UTF-8.
  if ((n == 3 && cp < 0x800) || (n == 4 && (cp < 0x10000 || cp > 0x10FFFF)) ||
      (cp >= 0xD800 && cp <= 0xDFFF))
    return 0;
  return n;
}

size_t line_break_length(std::string_view s, size_t i) {
  if (i >= s.size()) return 0;
  switch (s[i]) {
    case '\n': case '\v': case '\f': return 1;
    case '\r': return i + 1 < s.size() && s[i + 1] == '\n' ? 2 : 1;
    case '\xC2': return s.substr(i, 2) == "\xC2\x85" ? 2 : 0;
    case '\xE2': return s.substr(i, 3) == "\xE2\x80\xA8" || s.substr(i, 3) == "\xE2\x80\xA9" ? 3 : 0;
    default: return 0;
  }
}

std::vector<Token> lex(std::string_view source, std::vector<Diagnostic>& diags) {
  return Lexer(source, diags).run();
}

bool is_keyword(std::string_view word) {
  for (const Spelling& k : kKeywords)
    if (k.text == word) return true;
  return false;
}

std::string clip(std::string_view text) {
  constexpr size_t kMax = 40;
  if (text.size() <= kMax) return std::string(text);
  return std::string(text.substr(0, kMax - 3)) + "...";
}

std::string describe(const Token& t, std::string_view source) {
  if (t.kind == Tok::End) return "the end of the input";
  return fmt::format("'{}'", clip(source.substr(t.range.begin, t.range.end - t.range.begin)));
}

}  // namespace flexc::dsl
