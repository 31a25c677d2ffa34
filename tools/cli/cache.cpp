// `flexc cache dir|list|stats|clear`: the JIT's disk cache of compiled kernels.
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

#include "cli/args.h"
#include "cli/command.h"
#include "flexc/jit.h"

namespace flexc::cli {
namespace {

std::string age(std::chrono::system_clock::time_point t) {
  const auto s =
      std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now() - t)
          .count();
  if (s < 120) return fmt::format("{} s ago", s);
  if (s < 7200) return fmt::format("{} min ago", s / 60);
  if (s < 172800) return fmt::format("{} h ago", s / 3600);
  return fmt::format("{} days ago", s / 86400);
}

void run(const std::string& what) {
  const KernelCacheInfo c = kernel_cache_info();
  const std::string off = c.enabled ? "" : " (disk cache disabled)";
  if (what == "dir") {
    fmt::print("{}{}\n", c.dir, off);
  } else if (what == "list") {
    for (const KernelCacheEntry& it : kernel_cache_entries())
      fmt::print("{}  {:>10}  {:>14}  {}\n", it.key.substr(0, 16), human_bytes(it.bytes),
                 age(it.last_used),
                 it.description.empty() ? "(unreadable: dropped on next use)" : it.description);
  } else if (what == "stats") {
    fmt::print(
        "directory: {}{}\nentries:   {}\nsize:      {} of {} ({:.1f}%)\n"
        "temporary: {} file{} ({}; from writes in progress or killed processes; removed once "
        "{} min old)\nlocks:     {} file{} (removed once unused for {} min)\n",
        c.dir, off, c.entries, human_bytes(c.bytes), human_bytes(c.max_bytes),
        c.max_bytes ? 100.0 * static_cast<double>(c.bytes) / static_cast<double>(c.max_bytes)
                    : 0.0,
        c.temp_files, c.temp_files == 1 ? "" : "s", human_bytes(c.temp_bytes),
        c.stale_seconds / 60, c.lock_files, c.lock_files == 1 ? "" : "s", c.stale_seconds / 60);
  } else {
    const size_t n = clear_kernel_cache();
    fmt::print("removed {} entr{} from {}{}\n", n, n == 1 ? "y" : "ies", c.dir, off);
  }
}

const Register reg{
    "cache", [](CLI::App& app) {
      CLI::App* c = app.add_subcommand(
          "cache",
          "The cache of compiled kernels: FLEXC_CACHE_DIR, else $XDG_CACHE_HOME/flexc or "
          "~/.cache/flexc; FLEXC_CACHE_MAX_BYTES, FLEXC_CACHE_LOCK_TIMEOUT (s), "
          "FLEXC_DISABLE_DISK_CACHE=1");
      c->require_subcommand(1);
      const std::pair<const char*, const char*> subs[] = {
          {"dir", "print the cache directory"},
          {"list", "list the cached kernels, most recently used first"},
          {"stats", "print the number of entries, their size and the limit, temporary and lock files"},
          {"clear", "remove every cached kernel"}};
      for (const auto& [name, help] : subs) {
        const std::string what = name;
        c->add_subcommand(name, help)->callback([what] { run(what); });
      }
    }};

}  // namespace
}  // namespace flexc::cli
