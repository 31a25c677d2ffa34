#include "cli/args.h"

#include <fmt/format.h>

#include <charconv>
#include <cmath>

#include "flexc/error.h"

namespace flexc::cli {

namespace {

// "2147483647 (2^31 - 1)" for the usual limits, the number alone otherwise.
std::string limit_text(int64_t v) {
  if (v == kMaxInt32) return "2147483647 (2^31 - 1)";
  return std::to_string(v);
}

// Empty when `text` is a valid integer in [lo, hi]; the problem otherwise.
std::string int_problem(std::string_view text, int64_t lo, int64_t hi, int64_t& value) {
  const bool negative = text.starts_with('-') && lo < 0;
  const std::string_view digits = negative ? text.substr(1) : text;
  if (digits.empty() || digits.find_first_not_of("0123456789") != std::string_view::npos)
    return fmt::format("'{}' is not a decimal integer", text);
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec == std::errc::result_out_of_range || (ec == std::errc() && value > hi))
    return negative && ec != std::errc()
               ? fmt::format("'{}' is too small (at least {})", text, limit_text(lo))
               : fmt::format("'{}' is too large (at most {})", text, limit_text(hi));
  if (value < lo) return fmt::format("{} is too small (at least {})", text, limit_text(lo));
  return {};
}

}  // namespace

void add_precision_option(CLI::App* cmd, std::string& precision) {
  cmd->add_option("--precision", precision,
                  "score_mod float math: fast (approximate instructions, the default), exact "
                  "(IEEE float32) or approx (fast with tanh.approx); overrides the configs' "
                  "\"precision\"")
      ->check(CLI::IsMember({"fast", "exact", "approx"}));
}

Variant load_variant(std::string_view config, const std::string& precision) {
  const Variant v = Variant::load(config);
  return precision.empty() ? v : v.with_precision(parse_precision(precision, "--precision"));
}

std::string human_bytes(uint64_t n) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1024 && u < 6) v /= 1024, ++u;
  return u == 0 ? fmt::format("{} B", n) : fmt::format("{:.1f} {}", v, units[u]);
}

int64_t parse_int(std::string_view text, std::string_view what, int64_t lo, int64_t hi) {
  int64_t v = 0;
  if (const std::string p = int_problem(text, lo, hi, v); !p.empty())
    throw Error(fmt::format("{}: {}", what, p));
  return v;
}

double parse_number(std::string_view text, std::string_view what) {
  double v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size() || !std::isfinite(v) ||
      text.find_first_of("xXpP") != std::string_view::npos)
    throw Error(fmt::format("{}: '{}' is not a finite decimal number", what, text));
  return v;
}

CLI::Validator decimal_number() {
  return CLI::Validator(
      [](std::string& text) {
        try {
          parse_number(text, "");
        } catch (const Error&) {
          return fmt::format("'{}' is not a finite decimal number", text);
        }
        return std::string();
      },
      "NUMBER");
}

CLI::Validator int_range(int64_t lo, int64_t hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) {
        int64_t v = 0;
        return int_problem(text, lo, hi, v);
      },
      fmt::format("INT in [{}, {}]", lo, hi));
}

std::map<std::string, std::string> assignments(const std::vector<std::string>& items,
                                               std::string_view option) {
  std::map<std::string, std::string> out;
  for (const std::string& s : items) {
    const size_t eq = s.find('=');
    if (eq == std::string::npos || eq == 0)
      throw Error(fmt::format("{} '{}': expected NAME=VALUE", option, printable(s)));
    if (!out.emplace(s.substr(0, eq), s.substr(eq + 1)).second)
      throw Error(fmt::format("{} {} given twice", option, printable(s.substr(0, eq))));
  }
  return out;
}

uint64_t checked_bytes(const std::vector<int64_t>& dims, uint64_t element_bytes,
                       std::string_view what) {
  unsigned __int128 total = element_bytes;
  for (int64_t d : dims) total *= static_cast<uint64_t>(std::max<int64_t>(d, 0));
  if (total > kMaxGeneratedBytes) {
    const std::string size = total >> 64 ? "more than 16 EiB"
                                         : human_bytes(static_cast<uint64_t>(total));
    throw Error(fmt::format("{}: [{}] values of {} bytes would take {}; the command line makes "
                            "arrays of at most {}",
                            what, fmt::join(dims, ", "), element_bytes, size,
                            human_bytes(kMaxGeneratedBytes)));
  }
  return static_cast<uint64_t>(total);
}

std::string printable(std::string_view text) {
  std::string out;
  for (size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    // Length of a valid UTF-8 sequence at i (0: not one), and whether it is a C1 control.
    size_t n = c < 0x80 ? 1 : c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3
                          : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
    for (size_t k = 1; k < n; ++k)
      if (i + k >= text.size() || (static_cast<unsigned char>(text[i + k]) & 0xC0) != 0x80) n = 0;
    const bool c1 = n == 2 && c == 0xC2 && static_cast<unsigned char>(text[i + 1]) < 0xA0;
    if (n == 1 && c >= 0x20 && c != 0x7F) {
      out += static_cast<char>(c);
    } else if (n > 1 && !c1) {
      out.append(text.substr(i, n));
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else {
      out += fmt::format("\\x{:02x}", c);
      n = 1;
    }
    i += std::max<size_t>(n, 1);
  }
  return out;
}

}  // namespace flexc::cli
