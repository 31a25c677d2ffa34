#include "cache.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <openssl/evp.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <system_error>
#include <thread>

#include "flexc/error.h"

namespace flexc::jit {

namespace fs = std::filesystem;

// ---- SHA-256

KeyHasher::KeyHasher() : ctx_(EVP_MD_CTX_new()) {
  if (!ctx_ || EVP_DigestInit_ex(static_cast<EVP_MD_CTX*>(ctx_), EVP_sha256(), nullptr) != 1)
    throw Error("OpenSSL could not start a SHA-256 hash");
}

KeyHasher::~KeyHasher() { EVP_MD_CTX_free(static_cast<EVP_MD_CTX*>(ctx_)); }

void KeyHasher::add(std::string_view label, std::string_view data) {
  const std::string head = fmt::format("{}:{}:", label, data.size());
  auto* c = static_cast<EVP_MD_CTX*>(ctx_);
  EVP_DigestUpdate(c, head.data(), head.size());
  EVP_DigestUpdate(c, data.data(), data.size());
}

std::string KeyHasher::hex() {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned n = 0;
  EVP_DigestFinal_ex(static_cast<EVP_MD_CTX*>(ctx_), md, &n);
  std::string s;
  for (unsigned i = 0; i < n; ++i) s += fmt::format("{:02x}", md[i]);
  return s;
}

std::string cache_key(std::string_view flexc_version, std::string_view nvrtc, std::string_view arch,
                      std::span<const std::string> options, const Unit& unit) {
  KeyHasher h;
  h.add("flexc", flexc_version);
  h.add("nvrtc", nvrtc);
  h.add("arch", arch);
  for (const std::string& o : options) h.add("option", o);
  h.add("main", unit.main.name);
  h.add("main-text", unit.main.text);
  for (const SourceFile& f : unit.headers) {
    h.add("header", f.name);
    h.add("header-text", f.text);
  }
  return h.hex();
}

// ---- settings

static uint64_t parse_size(std::string_view v) {
  uint64_t n = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
  const std::string_view suffix(end, static_cast<size_t>(v.data() + v.size() - end));
  int shift = suffix.empty()      ? 0
              : suffix.size() > 1 ? -1
              : suffix[0] == 'K'  ? 10
              : suffix[0] == 'M'  ? 20
              : suffix[0] == 'G'  ? 30
                                  : -1;
  if (ec != std::errc() || shift < 0 || n > (UINT64_MAX >> shift))
    throw Error(
        fmt::format("FLEXC_CACHE_MAX_BYTES='{}' is not a size (a number, optionally "
                    "followed by K, M or G)",
                    v));
  return n << shift;
}

CacheSettings CacheSettings::from_env() {
  CacheSettings s;
  if (const char* d = std::getenv("FLEXC_CACHE_DIR"); d && *d)
    s.dir = d;
  else if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x)
    s.dir = fs::path(x) / "flexc";
  else if (const char* h = std::getenv("HOME"); h && *h)
    s.dir = fs::path(h) / ".cache" / "flexc";
  else
    s.disk = false;  // nowhere to put it
  if (const char* off = std::getenv("FLEXC_DISABLE_DISK_CACHE");
      off && *off && std::strcmp(off, "0"))
    s.disk = false;
  if (const char* m = std::getenv("FLEXC_CACHE_MAX_BYTES"); m && *m) s.max_bytes = parse_size(m);
  if (const char* t = std::getenv("FLEXC_CACHE_LOCK_TIMEOUT"); t && *t) {
    double v = -1;
    const std::string_view text(t);
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (ec != std::errc() || end != text.data() + text.size() || !(v >= 0 && v <= 86400))
      throw Error(fmt::format("FLEXC_CACHE_LOCK_TIMEOUT='{}' is not a number of seconds from 0 "
                              "to 86400",
                              text));
    s.lock_timeout_s = v;
  }
  return s;
}

// ---- file format

namespace {

constexpr char kMagic[8] = {'F', 'L', 'E', 'X', 'C', 'J', 'I', 'T'};
// Format 2: the checksum covers the header (so the key) as well as the payload.
constexpr uint32_t kFormat = 2;

struct Header {
  char magic[8];
  uint32_t format;
  uint32_t header_bytes;
  char key[64];
  uint64_t payload_bytes;
  unsigned char checksum[32];  // SHA-256 of this header (with this field zero) and the payload
};
static_assert(sizeof(Header) == 120);

void warn(const std::string& msg) { std::fprintf(stderr, "flexc: warning: %s\n", msg.c_str()); }

void put_field(std::string& out, std::string_view s) {
  const uint64_t n = s.size();
  out.append(reinterpret_cast<const char*>(&n), sizeof n);
  out.append(s);
}

bool get_field(std::string_view& in, std::string& out) {
  uint64_t n = 0;
  if (in.size() < sizeof n) return false;
  std::memcpy(&n, in.data(), sizeof n);
  in.remove_prefix(sizeof n);
  if (n > in.size()) return false;
  out.assign(in.substr(0, n));
  in.remove_prefix(n);
  return true;
}

std::string checksum_of(Header h, std::string_view payload) {
  std::memset(h.checksum, 0, sizeof h.checksum);
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned n = 0;
  EVP_MD_CTX* c = EVP_MD_CTX_new();
  EVP_DigestInit_ex(c, EVP_sha256(), nullptr);
  EVP_DigestUpdate(c, &h, sizeof h);
  EVP_DigestUpdate(c, payload.data(), payload.size());
  EVP_DigestFinal_ex(c, md, &n);
  EVP_MD_CTX_free(c);
  return std::string(reinterpret_cast<const char*>(md), n);
}

// Why a file or directory must not be trusted with code: another user owns it or can write it.
// Empty when it is this user's alone.
std::string untrusted(const struct stat& st) {
  if (st.st_uid != geteuid())
    return fmt::format("it belongs to another user (uid {})", st.st_uid);
  if (st.st_mode & (S_IWGRP | S_IWOTH))
    return fmt::format("other users can write it (mode {:04o})", st.st_mode & 07777);
  return {};
}

// A cache file's bytes, read without following a symlink, only when it is a regular file of this
// user's of a kernel's size at most. nullopt with `why` empty: no such file.
std::optional<std::string> read_entry(const fs::path& p, std::string& why) {
  why.clear();
  const int fd = open(p.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return std::nullopt;
    why = errno == ELOOP ? "it is a symbolic link" : errno == EISDIR ? "it is a directory"
                                                                      : std::strerror(errno);
    return std::nullopt;
  }
  struct Closer {
    int fd;
    ~Closer() { close(fd); }
  } closer{fd};
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    why = std::strerror(errno);
    return std::nullopt;
  }
  if (S_ISDIR(st.st_mode)) why = "it is a directory";
  else if (!S_ISREG(st.st_mode)) why = "it is not a regular file";
  else if (static_cast<uint64_t>(st.st_size) > kMaxCacheEntryBytes)
    why = fmt::format("it is {} bytes, more than any kernel ({} at most)", st.st_size,
                      kMaxCacheEntryBytes);
  else why = untrusted(st);
  if (!why.empty()) return std::nullopt;
  std::string data(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  while (got < data.size()) {
    const ssize_t r = read(fd, data.data() + got, data.size() - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    got += static_cast<size_t>(r);
  }
  data.resize(got);
  return data;
}

// Removes a bad cache file, or says why it stays (a directory with contents).
std::string remove_bad(const fs::path& p) {
  std::error_code ec;
  if (fs::remove(p, ec) || !fs::exists(fs::symlink_status(p, ec))) return "removed";
  return "it cannot be removed, so it is bypassed (flexc cache clear removes it)";
}

// Parses a cache file; on failure returns nullopt and says why.
std::optional<CacheEntry> parse(std::string_view file, std::string_view key, std::string& why) {
  const auto fail = [&](std::string reason) {
    why = std::move(reason);
    return std::nullopt;
  };
  Header h;
  if (file.size() < sizeof h)
    return fail(file.size() >= sizeof kMagic && std::memcmp(file.data(), kMagic, sizeof kMagic) == 0
                    ? "truncated header"
                    : "not a flexc cache file");
  std::memcpy(&h, file.data(), sizeof h);
  if (std::memcmp(h.magic, kMagic, sizeof kMagic) != 0) return fail("not a flexc cache file");
  if (h.format != kFormat)
    return fail(fmt::format("written in cache format {}; this flexc reads format {}", h.format,
                            kFormat));
  if (h.header_bytes != sizeof h)
    return fail(fmt::format("damaged header (it gives its size as {} bytes, not {})",
                            h.header_bytes, sizeof h));
  if (std::string_view(h.key, sizeof h.key) != key)
    return fail("it holds another key (or its key is damaged)");
  std::string_view payload = file.substr(sizeof h);
  if (payload.size() != h.payload_bytes)
    return fail(
        fmt::format("payload of {} bytes, the header says {}", payload.size(), h.payload_bytes));
  if (checksum_of(h, payload) != std::string_view(reinterpret_cast<const char*>(h.checksum), 32))
    return fail("checksum mismatch (a damaged header or payload)");
  CacheEntry e;
  if (!get_field(payload, e.description) || !get_field(payload, e.cubin) ||
      !get_field(payload, e.ptx) || !payload.empty())
    return fail("malformed payload");
  return std::optional<CacheEntry>(std::move(e));
}

bool valid_key(std::string_view key) {
  return key.size() == 64 && std::all_of(key.begin(), key.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

}  // namespace

// ---- DiskCache

DiskCache::DiskCache(CacheSettings settings) : s_(std::move(settings)) {
  if (!s_.disk) return;
  std::error_code ec;
  if (s_.dir.has_parent_path()) fs::create_directories(s_.dir.parent_path(), ec);
  struct stat st {};
  if (mkdir(s_.dir.c_str(), 0700) != 0 && errno != EEXIST) {
    warn(fmt::format("cannot create the cache directory {} ({}); the disk cache is off",
                     s_.dir.string(), std::strerror(errno)));
    s_.disk = false;
  } else if (stat(s_.dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    warn(fmt::format("the cache directory {} is not a directory; the disk cache is off",
                     s_.dir.string()));
    s_.disk = false;
  } else if (const std::string why = untrusted(st); !why.empty()) {
    warn(fmt::format("not using the cache directory {}: {}, and kernels loaded from it would run "
                     "their code; compiling in memory (chmod 700 it, or set FLEXC_CACHE_DIR)",
                     s_.dir.string(), why));
    s_.disk = false;
  }
}

fs::path DiskCache::path_of(std::string_view key) const {
  return s_.dir / fmt::format("{}.bin", key);
}

std::optional<CacheEntry> DiskCache::load(std::string_view key) const {
  if (!s_.disk) return std::nullopt;
  const fs::path p = path_of(key);
  std::string why;
  std::optional<CacheEntry> e;
  if (const std::optional<std::string> file = read_entry(p, why)) e = parse(*file, key, why);
  if (!e) {
    if (!why.empty())
      warn(fmt::format("dropping cache file {}: {}; {}; compiling again", p.string(), why,
                       remove_bad(p)));
    return std::nullopt;
  }
  utimensat(AT_FDCWD, p.c_str(), nullptr, AT_SYMLINK_NOFOLLOW);  // LRU: now is its last use
  return e;
}

void DiskCache::store(std::string_view key, const CacheEntry& entry) const {
  if (!s_.disk) return;
  std::string payload;
  put_field(payload, entry.description);
  put_field(payload, entry.cubin);
  put_field(payload, entry.ptx);
  Header h{};
  std::memcpy(h.magic, kMagic, sizeof kMagic);
  h.format = kFormat;
  h.header_bytes = sizeof h;
  std::memcpy(h.key, key.data(), std::min(key.size(), sizeof h.key));
  h.payload_bytes = payload.size();
  std::memcpy(h.checksum, checksum_of(h, payload).data(), sizeof h.checksum);

  static std::atomic<uint64_t> counter{0};
  const fs::path final_path = path_of(key);
  const fs::path tmp = s_.dir / fmt::format("{}.tmp.{}.{}", key, getpid(), counter++);
  {
    // Private and new: nobody else can have opened or replaced it.
    const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    bool ok = fd >= 0;
    for (std::string_view part : {std::string_view(reinterpret_cast<const char*>(&h), sizeof h),
                                  std::string_view(payload)})
      for (size_t done = 0; ok && done < part.size();) {
        const ssize_t w = write(fd, part.data() + done, part.size() - done);
        if (w < 0 && errno == EINTR) continue;
        ok = w > 0;
        done += ok ? static_cast<size_t>(w) : 0;
      }
    if (fd >= 0 && close(fd) != 0) ok = false;
    if (!ok) {
      warn(fmt::format("cannot write the cache file {} ({}); the kernel is not cached",
                       tmp.string(), std::strerror(errno)));
      std::error_code ec;
      fs::remove(tmp, ec);
      return;
    }
  }
  std::error_code ec;
  fs::rename(tmp, final_path, ec);
  if (ec) {
    warn(fmt::format("cannot rename {} to {} ({}); the kernel is not cached{}", tmp.string(),
                     final_path.string(), ec.message(),
                     fs::is_directory(fs::symlink_status(final_path)) ? " (flexc cache clear removes "
                                                                        "the directory)"
                                                                      : ""));
    fs::remove(tmp, ec);
    return;
  }
  evict(key);
}

DiskCache::Lock::~Lock() {
  if (fd_ >= 0) close(fd_);  // closing releases the flock
}

DiskCache::Lock DiskCache::lock(std::string_view key) const {
  if (!s_.disk) return Lock(-1);
  const fs::path p = s_.dir / fmt::format("{}.lock", key);
  const int fd = open(p.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return Lock(-1);  // e.g. a read-only cache: compiles may then repeat, nothing worse
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::duration<double>(s_.lock_timeout_s);
  auto pause = std::chrono::milliseconds(1);
  while (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    if (errno == EINTR) continue;
    if (errno != EWOULDBLOCK || Clock::now() >= deadline) {
      if (errno == EWOULDBLOCK)
        warn(fmt::format("another process has held {} for {} s (stopped, or compiling slowly); "
                         "compiling without waiting for it",
                         p.string(), s_.lock_timeout_s));
      close(fd);
      return Lock(-1);
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(50));
  }
  return Lock(fd);
}

std::vector<DiskCache::Item> DiskCache::list() const {
  std::vector<Item> items;
  if (!s_.disk) return items;
  std::error_code ec;
  for (const fs::directory_entry& de : fs::directory_iterator(s_.dir, ec)) {
    const fs::path& p = de.path();
    if (p.extension() != ".bin" || !valid_key(p.stem().string())) continue;
    Item it;
    it.key = p.stem().string();
    it.bytes = de.is_regular_file(ec) ? de.file_size(ec) : 0;  // not a directory's -1
    it.last_used = de.last_write_time(ec);
    std::string why;
    if (const auto file = read_entry(p, why))
      if (const auto e = parse(*file, it.key, why)) it.description = e->description;
    items.push_back(std::move(it));
  }
  std::sort(items.begin(), items.end(),
            [](const Item& a, const Item& b) { return a.last_used > b.last_used; });
  return items;
}

uint64_t DiskCache::total_bytes() const {
  uint64_t total = 0;
  std::error_code ec;
  if (s_.disk)
    for (const fs::directory_entry& de : fs::directory_iterator(s_.dir, ec))
      if (de.path().extension() == ".bin" && de.is_regular_file(ec)) total += de.file_size(ec);
  return total;
}

size_t DiskCache::clear() const {
  size_t n = 0;
  std::error_code ec;
  if (!s_.disk) return 0;
  std::vector<fs::path> doomed;
  for (const fs::directory_entry& de : fs::directory_iterator(s_.dir, ec)) {
    const std::string name = de.path().filename().string();
    if (name.size() < 64 || !valid_key(std::string_view(name).substr(0, 64))) continue;
    const std::string_view rest = std::string_view(name).substr(64);
    if (rest == ".bin") ++n;
    if (rest == ".bin" || rest == ".lock" || rest.starts_with(".tmp.")) doomed.push_back(de.path());
  }
  for (const fs::path& p : doomed) fs::remove_all(p, ec);  // a directory in an entry's place too
  return n;
}

DiskCache::Leftovers DiskCache::leftovers() const {
  Leftovers l;
  std::error_code ec;
  if (!s_.disk) return l;
  for (const fs::directory_entry& de : fs::directory_iterator(s_.dir, ec)) {
    const std::string name = de.path().filename().string();
    if (name.size() < 64 || !valid_key(std::string_view(name).substr(0, 64))) continue;
    const std::string_view rest = std::string_view(name).substr(64);
    if (rest.starts_with(".tmp.")) {
      ++l.temp_files;
      l.temp_bytes += de.is_regular_file(ec) ? de.file_size(ec) : 0;
    } else if (rest == ".lock") {
      ++l.lock_files;
    }
  }
  return l;
}

void DiskCache::evict(std::string_view keep) const {
  if (!s_.disk) return;
  struct File {
    fs::path path;
    uint64_t bytes;
    fs::file_time_type mtime;
  };
  std::vector<File> files;
  uint64_t total = 0;
  std::error_code ec;
  const auto stale = fs::file_time_type::clock::now() - std::chrono::seconds(kStaleSeconds);
  for (const fs::directory_entry& de : fs::directory_iterator(s_.dir, ec)) {
    const std::string name = de.path().filename().string();
    if (name.size() < 64 || !valid_key(std::string_view(name).substr(0, 64))) continue;
    const std::string_view rest = std::string_view(name).substr(64);
    const fs::file_time_type mtime = de.last_write_time(ec);
    if (rest.starts_with(".tmp.")) {
      // A write takes milliseconds: an old temporary file is a killed process's.
      if (mtime < stale) fs::remove(de.path(), ec);
    } else if (rest == ".lock") {
      // Unlinking a lock file can at worst let two processes compile one key at once (each
      // renames a whole file into place), so one nobody holds is removed once it is old.
      const int fd = open(de.path().c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC);
      if (fd >= 0 && mtime < stale && flock(fd, LOCK_EX | LOCK_NB) == 0) fs::remove(de.path(), ec);
      if (fd >= 0) close(fd);
    } else if (rest == ".bin" && de.is_regular_file(ec)) {
      File f{de.path(), de.file_size(ec), mtime};
      total += f.bytes;
      if (std::string_view(name).substr(0, 64) != keep) files.push_back(std::move(f));
    }
  }
  if (total <= s_.max_bytes) return;
  std::sort(files.begin(), files.end(),
            [](const File& a, const File& b) { return a.mtime < b.mtime; });
  for (const File& f : files) {
    if (total <= s_.max_bytes) break;
    if (fs::remove(f.path, ec)) total -= f.bytes;
  }
}

}  // namespace flexc::jit
