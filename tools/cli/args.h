// Argument parsing every `flexc` subcommand shares: decimal numbers with clear range messages,
// NAME=VALUE options given at most once per NAME, bounded host allocations, and user text made
// safe to print. Errors are flexc::Error naming the option.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "flexc/variant.h"

namespace flexc::cli {

inline constexpr int64_t kMaxInt32 = std::numeric_limits<int32_t>::max();
// The most host memory one array the CLI generates (random inputs, document ids) may take.
inline constexpr uint64_t kMaxGeneratedBytes = uint64_t{4} << 30;

// A decimal integer in [lo, hi] (digits only, a '-' where lo < 0: no "0x10", "1e3", "+5" or
// spaces). Throws "<what>: ..." with the limits in words.
int64_t parse_int(std::string_view text, std::string_view what, int64_t lo = 1,
                  int64_t hi = kMaxInt32);
// A finite decimal number ("1.5", "-2", "3e-2"; no "inf", "nan" or hex).
double parse_number(std::string_view text, std::string_view what);
// The same rules as CLI11 checks on an option's text.
CLI::Validator int_range(int64_t lo, int64_t hi = kMaxInt32);
CLI::Validator decimal_number();

// `--precision fast|exact`: overrides the float math the variants' configs ask for (empty: keep
// it). The commands that load variants take it; load_variant applies it.
void add_precision_option(CLI::App* cmd, std::string& precision);
Variant load_variant(std::string_view config, const std::string& precision);

// "231.3 KiB", "4.0 GiB", "17 B".
std::string human_bytes(uint64_t bytes);

// NAME=VALUE items by NAME; a NAME given twice is an error ("--param window given twice").
std::map<std::string, std::string> assignments(const std::vector<std::string>& items,
                                               std::string_view option);

// The product of `dims` (each >= 0) times `element_bytes`, refused past kMaxGeneratedBytes before
// anything is allocated: "<what>: [2147483647, 16384] int32 values would take 128 TiB; ...".
uint64_t checked_bytes(const std::vector<int64_t>& dims, uint64_t element_bytes,
                       std::string_view what);

// `text` with control characters and invalid UTF-8 shown as escapes (\n, \x1b, ...), so a
// config's description cannot move the cursor, recolour or rewrite the terminal.
std::string printable(std::string_view text);

}  // namespace flexc::cli
