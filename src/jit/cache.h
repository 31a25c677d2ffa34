// The JIT's disk cache of compiled kernels, and its SHA-256 keys.
//
// One file per key, `<dir>/<key>.bin`: a header (magic, format version, key, payload size, and a
// SHA-256 over the header and the payload) and the payload. Files are written to a private
// temporary name and renamed, so a reader sees a whole file or none; a truncated, corrupt,
// foreign or non-regular file is reported on stderr, removed (or, if it cannot be, bypassed) and
// recompiled. `<dir>/<key>.lock` serialises compiles of one key across processes, with a timeout
// after which a process compiles on its own. Hits refresh the file's mtime; past the size limit
// the least recently used files go first, and stale temporary and lock files are removed.
//
// Trust: the directory is created 0700; a directory or an entry that another user owns or can
// write is never loaded from (a warning, then the kernel is compiled in memory), so a shared
// cache location cannot put someone else's code into your kernels.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "splice.h"

namespace flexc::jit {

// Incremental SHA-256 (OpenSSL EVP). Each add() is length-prefixed and labelled, so that no two
// different sequences of inputs hash alike.
class KeyHasher {
 public:
  KeyHasher();
  ~KeyHasher();
  KeyHasher(const KeyHasher&) = delete;
  KeyHasher& operator=(const KeyHasher&) = delete;
  void add(std::string_view label, std::string_view data);
  std::string hex();  // finishes the hash: 64 lowercase hex digits

 private:
  void* ctx_;
};

// The cache key: SHA-256 over everything that changes the binary and nothing else: flexc's
// version, NVRTC's identity, the target arch, every option, and every file NVRTC sees (names and
// contents, the generated flexc_variant.cuh among them).
std::string cache_key(std::string_view flexc_version, std::string_view nvrtc, std::string_view arch,
                      std::span<const std::string> options, const Unit& unit);

struct CacheSettings {
  std::filesystem::path dir;
  bool disk = true;
  uint64_t max_bytes = uint64_t{2} << 30;
  // How long a process waits for another one's compile of the same key before compiling on its
  // own (a cold compile takes about a second; a stopped process would otherwise block forever).
  double lock_timeout_s = 30;

  // FLEXC_CACHE_DIR, else $XDG_CACHE_HOME/flexc, else ~/.cache/flexc; FLEXC_DISABLE_DISK_CACHE=1
  // turns the disk cache off; FLEXC_CACHE_MAX_BYTES (a number, optionally with K, M or G) sets
  // the limit; FLEXC_CACHE_LOCK_TIMEOUT (seconds) the lock wait. Throws flexc::Error for a
  // malformed value.
  static CacheSettings from_env();
};

// A cache file larger than this is not a kernel: it is refused before it is read.
inline constexpr uint64_t kMaxCacheEntryBytes = uint64_t{256} << 20;

// What one cache file holds.
struct CacheEntry {
  std::string description;  // "alibi: mods_eval.cuh sm_90", for `flexc cache list`
  std::string cubin, ptx;
};

class DiskCache {
 public:
  // Creates the directory (0700); when that fails, or the directory is another user's or
  // writable by others, the cache warns once and stays disabled.
  explicit DiskCache(CacheSettings settings);
  const CacheSettings& settings() const { return s_; }
  bool enabled() const { return s_.disk; }

  // The entry for `key`, or nullopt (missing; or bad, foreign or untrusted: then warned about and
  // removed, or bypassed when it cannot be removed).
  std::optional<CacheEntry> load(std::string_view key) const;
  // Writes atomically, then evicts down to the size limit. Failures are warnings.
  void store(std::string_view key, const CacheEntry& entry) const;

  // An exclusive lock on one key, across threads and processes; released on destruction. After
  // settings().lock_timeout_s without it, a warning and no lock (the caller compiles anyway).
  class Lock {
   public:
    explicit Lock(int fd) : fd_(fd) {}
    ~Lock();
    Lock(const Lock&) = delete;
    Lock& operator=(const Lock&) = delete;

   private:
    int fd_;
  };
  Lock lock(std::string_view key) const;

  struct Item {
    std::string key;
    uint64_t bytes = 0;
    std::filesystem::file_time_type last_used;
    std::string description;  // empty when the file is not a valid entry
  };
  std::vector<Item> list() const;  // most recently used first
  uint64_t total_bytes() const;    // of the entries
  // What the directory holds besides entries: temporary files of writes in progress (or of
  // processes killed while writing) and lock files.
  struct Leftovers {
    size_t temp_files = 0, lock_files = 0;
    uint64_t temp_bytes = 0;
  };
  Leftovers leftovers() const;
  size_t clear() const;  // removes every entry, lock and temporary file; returns entries
  // Removes least recently used entries down to the size limit (never `keep`), temporary files
  // older than kStaleSeconds and lock files nobody holds that are that old.
  void evict(std::string_view keep = {}) const;
  static constexpr int kStaleSeconds = 600;

  std::filesystem::path path_of(std::string_view key) const;

 private:
  CacheSettings s_;
};

}  // namespace flexc::jit
