// Bounded time and memory on hostile input: every input-dependent algorithm has a stated limit
// (docs/reliability.md), and input past it is a clear error, quickly. The inputs here once took
// 6 to 70 seconds, or ended in std::bad_alloc; each must now finish well under a second.
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "dsl/diagnostics.h"
#include "dsl/frontend.h"
#include "flexc/blockmask.h"
#include "flexc/variant.h"
#include "variant_impl.h"

namespace fs = std::filesystem;
using flexc::Variant;

namespace {

// Generous against a slow CI machine; the unbounded versions of these took seconds to minutes.
constexpr double kBoundSeconds = 2.0;

template <class F>
double seconds(F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The message `f` throws flexc::Error with, and how long it took; "" when it did not throw.
template <class F>
std::string error_within_bound(F&& f) {
  std::string message;
  const double s = seconds([&] {
    try {
      f();
    } catch (const flexc::Error& e) {
      message = e.what();
    }
  });
  INFO(message.substr(0, 300));
  CHECK(s < kBoundSeconds);
  return message;
}

std::string json_error(const std::string& json) {
  return error_within_bound([&] { Variant::from_json(json, "t.json"); });
}

std::string mask_terms(const char* op, size_t n, const std::string& term) {
  std::string items;
  for (size_t i = 0; i < n; ++i) items += (i ? ", " : "") + fmt::format(fmt::runtime(term), i);
  return fmt::format(R"({{"name": "t", "mask_mod": {{"{}": [{}]}}}})", op, items);
}

// A fresh directory for files the test makes, removed at the end.
struct TempDir {
  fs::path path = fs::temp_directory_path() / fmt::format("flexc_limits_{}", getpid());
  TempDir() { fs::create_directories(path); }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

flexc::dsl::Mod parse_score(std::string_view src, const flexc::dsl::Decls& decls = {}) {
  return flexc::dsl::parse_mod(flexc::dsl::ModKind::Score, src, decls, "score_mod");
}
std::string score_text(std::string_view src) {
  const flexc::dsl::Mod m = parse_score(src);
  return flexc::dsl::to_text(m.graph, m.graph.root, {});
}

}  // namespace

TEST_CASE("every line terminator ends a comment, and diagnostics count lines alike", "[limits]") {
  for (const char* nl : {"\n", "\r", "\r\n", "\v", "\f", "\xC2\x85", "\xE2\x80\xA8", "\xE2\x80\xA9"}) {
    INFO(fmt::format("terminator bytes {}", std::string_view(nl).size()));
    CHECK(score_text(fmt::format("score # a comment{}* 2.5", nl)) == "score * 2.5");
    try {
      parse_score(fmt::format("score{}+ q_idz", nl));
      FAIL("an unknown name was accepted");
    } catch (const flexc::dsl::DslError& e) {
      CHECK_THAT(e.what(), Catch::StartsWith("score_mod:2:3: error: unknown name 'q_idz'"));
    }
  }
}

TEST_CASE("float literals that underflow are zero however they are written", "[limits]") {
  const std::string zeros(330, '0');
  CHECK(score_text("score + 1e-330") == "score + 0.0");
  CHECK(score_text("score + 0." + zeros + "1") == "score + 0.0");
  CHECK(score_text("score + 0." + zeros + "1e300") == score_text("score + 1e-31"));
  CHECK(score_text("score + 1" + zeros + ".0e-320") == score_text("score + 1e10"));
  for (const std::string& big : {"1" + zeros + ".0", std::string("1e400"), "0." + zeros + "1e700"}) {
    INFO(big.substr(0, 20));
    try {
      parse_score("score + " + big);
      FAIL("an overflowing literal was accepted");
    } catch (const flexc::dsl::DslError& e) {
      CHECK_THAT(e.what(), Catch::Contains("is out of range"));
      CHECK_THAT(e.what(), Catch::StartsWith("score_mod:1:9:"));
    }
  }
}

TEST_CASE("suggestions are bounded: long near-miss names and many candidates", "[limits]") {
  // Eight captures with 3000-character names, and twenty unknown names one letter off each:
  // full edit distances took 70 s.
  flexc::dsl::Decls decls;
  const std::string base(3000, 'n');
  for (int i = 0; i < 8; ++i)
    decls.captures.push_back({fmt::format("{}_{}", base, i), flexc::dsl::DType::F32,
                              {{flexc::dsl::Dim::Fixed, 4}}});
  std::string src = "score";
  for (int i = 0; i < 20; ++i) src += fmt::format(" + {}_x{}[0]", base, i);
  const std::string message = error_within_bound([&] {
    try {
      parse_score(src, decls);
    } catch (const flexc::dsl::DslError& e) {
      throw flexc::Error(e.what());
    }
  });
  CHECK_THAT(message, Catch::StartsWith("score_mod:1:9: error: unknown captured tensor"));

  std::vector<std::string> many;
  for (int i = 0; i < 200000; ++i) many.push_back(fmt::format("name_{:06}", i));
  many.push_back("window");
  std::string best = "unset";
  CHECK(seconds([&] { best = flexc::dsl::closest_name("name_00001", many); }) < kBoundSeconds);
  CHECK(best == "name_000001");
  // Only the first kMaxSuggestionCandidates are compared; names past the length cap get none.
  CHECK(flexc::dsl::closest_name("windwo", many).empty());
  CHECK(flexc::dsl::closest_name(std::string(100, 'a'), {std::string(99, 'a')}).empty());
  CHECK(flexc::dsl::closest_name("windwo", {"window", "width"}) == "window");
}

TEST_CASE("JSON configs: NUL bytes, numbers out of range, line:col and path", "[limits]") {
  CHECK(json_error(std::string(R"({"name":"t"})") + '\0' + "garbage") ==
        "t.json:1:13: invalid JSON: a NUL byte (a config is text)");
  CHECK(json_error(std::string("{\"name\":\n\"t\"\0}", 14)) ==
        "t.json:2:4: invalid JSON: a NUL byte (a config is text)");
  CHECK(json_error(R"({"name": "t", "description": 1e400})") ==
        "t.json:1:30: description: invalid JSON: number overflow parsing '1e400'");
  CHECK(json_error("{\"name\": \"t\", \"captures\": [{\"name\": \"x\", \"dtype\": \"float32\",\n"
                   "  \"shape\": [4, -1e999]}]}") ==
        "t.json:2:16: captures[0].shape[1]: invalid JSON: number overflow parsing '-1e999'");
  // "1e400" inside a string is not the number.
  CHECK(json_error(R"({"name": "t", "score_mod": "score", "description": "1e400", "x": 1e400})")
            .starts_with("t.json:1:66: x: invalid JSON"));
}

TEST_CASE("mask_mod combinations: a term limit, and linear work below it", "[limits]") {
  const size_t n = flexc::detail::kMaxMaskTerms;
  // One term per list element plus the list's object: n - 1 elements is n terms.
  CHECK(json_error(mask_terms("or", n, "\"q_idx - kv_idx != {}\"")) ==
        fmt::format("t.json: mask_mod.or[{}]: the mask_mod has more than {} terms (expressions, "
                    "\"@name\" references, and / or / not objects); combine fewer, or write one "
                    "expression",
                    n - 1, n));
  CHECK(json_error(mask_terms("or", 80000, "\"@causal\"")).find("more than") != std::string::npos);
  // At the limit: loads, quickly (a pairwise fold of 4000 terms took 6.7 s, 20000 over 300 s).
  Variant v = Variant::from_catalogue("noop");
  CHECK(seconds([&] {
          v = Variant::from_json(mask_terms("or", n - 1, "\"q_idx - kv_idx != {}\""), "t.json");
        }) < kBoundSeconds);
  CHECK(v.mask_mod_text().ends_with(fmt::format("|| q_idx - kv_idx != {}", n - 2)));
  CHECK(seconds([&] {
          v = Variant::from_json(
              mask_terms("and", n / 2 - 1, R"({{"not": "q_idx == kv_idx + {}"}})"), "t.json");
        }) < kBoundSeconds);
  CHECK(seconds([&] {
          v = Variant::from_json(mask_terms("or", n - 1, "\"@sliding_window\""), "t.json");
        }) < kBoundSeconds);
  CHECK(v.mask_mod_text() == Variant::from_catalogue("sliding_window").mask_mod_text());
  // Conflicts still name the term that brought them.
  CHECK(json_error(R"({"name": "t", "params": [{"name": "window", "type": "float", "default": 1}],
                       "mask_mod": {"or": ["true", "@sliding_window"]}})") ==
        "t.json: mask_mod.or[1]: conflicting declarations of \"window\": a runtime float param "
        "(default 1) and a runtime int param (default 1024)");
  // JSON nesting is bounded before any recursion: 20000 nested "not"s.
  std::string deep = "\"true\"";
  for (int i = 0; i < 20000; ++i) deep = "{\"not\": " + deep + "}";
  CHECK_THAT(json_error(R"({"name": "t", "mask_mod": )" + deep + "}"),
             Catch::Contains("JSON nested more than 32 levels deep"));
}

TEST_CASE("config files: size checked before reading, only regular files", "[limits]") {
  TempDir dir;
  const auto file_error = [](const fs::path& p) {
    return error_within_bound([&] { Variant::from_json_file(p); });
  };
  CHECK(file_error("/dev/zero") ==
        "cannot read variant config /dev/zero: it is not a regular file (a device, FIFO or "
        "socket)");
  const fs::path fifo = dir.path / "fifo.json";
  REQUIRE(mkfifo(fifo.c_str(), 0600) == 0);
  CHECK(file_error(fifo) == fmt::format("cannot read variant config {}: it is not a regular file "
                                        "(a device, FIFO or socket)",
                                        fifo.string()));
  CHECK(file_error(dir.path) ==
        fmt::format("cannot read variant config {}: it is a directory", dir.path.string()));
  CHECK(file_error(dir.path / "missing.json") ==
        fmt::format("cannot read variant config {}: No such file or directory",
                    (dir.path / "missing.json").string()));
  const fs::path big = dir.path / "big.json";
  std::ofstream(big) << std::string(2 << 20, ' ');
  CHECK(file_error(big) == fmt::format("cannot read variant config {}: it holds 2 MiB, over the "
                                       "limit of 1 MiB",
                                       big.string()));
}

TEST_CASE("BlockMask memory is estimated before allocating, against a limit", "[limits]") {
  const Variant causal = Variant::from_catalogue("causal");
  flexc::BlockMaskOptions o;
  o.q_tile = o.kv_tile = 1;
  o.device = flexc::BuildDevice::Cpu;
  CHECK(error_within_bound([&] { flexc::create_block_mask(causal, 1, 1, 100000, 100000, o); }) ==
        "create_block_mask for 'causal': 1 groups x 100000 x 100000 tiles need 158.3 GiB of "
        "lists; the limit is 4 GiB (BlockMaskOptions::max_bytes); use larger tiles");
  // The limit is the caller's to set: 32 x 32 tiles take 17,920 bytes.
  o.q_tile = o.kv_tile = 128;
  o.max_bytes = 16 << 10;
  CHECK_THAT(error_within_bound([&] { flexc::create_block_mask(causal, 1, 1, 4096, 4096, o); }),
             Catch::EndsWith("need 17.5 KiB of lists; the limit is 16 KiB "
                             "(BlockMaskOptions::max_bytes); use larger tiles"));
  o.max_bytes = 17920;
  CHECK(flexc::create_block_mask(causal, 1, 1, 4096, 4096, o).count(flexc::TileKind::Full) ==
        31 * 32 / 2);
}
