#include "cache.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <openssl/evp.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <system_error>

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
  return s;
}

// ---- file format

namespace {

constexpr char kMagic[8] = {'F', 'L', 'E', 'X', 'C', 'J', 'I', 'T'};
constexpr uint32_t kFormat = 1;

struct Header {
  char magic[8];
  uint32_t format;
  uint32_t header_bytes;
  char key[64];
  uint64_t payload_bytes;
  unsigned char checksum[32];  // SHA-256 of the payload
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

std::string raw_sha256(std::string_view data) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned n = 0;
  EVP_Digest(data.data(), data.size(), md, &n, EVP_sha256(), nullptr);
  return std::string(reinterpret_cast<const char*>(md), n);
}

std::optional<std::string> read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  if (!f) return std::nullopt;
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
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
  if (h.format != kFormat || h.header_bytes != sizeof h)
    return fail(fmt::format("cache format {} (this flexc reads {})", h.format, kFormat));
  if (std::string_view(h.key, sizeof h.key) != key) return fail("it holds another key");
  std::string_view payload = file.substr(sizeof h);
  if (payload.size() != h.payload_bytes)
    return fail(
        fmt::format("payload of {} bytes, the header says {}", payload.size(), h.payload_bytes));
  if (raw_sha256(payload) != std::string_view(reinterpret_cast<const char*>(h.checksum), 32))
    return fail("checksum mismatch");
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
  fs::create_directories(s_.dir, ec);
  if (ec) {
    warn(fmt::format("cannot create the cache directory {} ({}); the disk cache is off",
                     s_.dir.string(), ec.message()));
    s_.disk = false;
  }
}

fs::path DiskCache::path_of(std::string_view key) const {
  return s_.dir / fmt::format("{}.bin", key);
}

std::optional<CacheEntry> DiskCache::load(std::string_view key) const {
  if (!s_.disk) return std::nullopt;
  const fs::path p = path_of(key);
  const std::optional<std::string> file = read_file(p);
  if (!file) return std::nullopt;
  std::string why;
  std::optional<CacheEntry> e = parse(*file, key, why);
  if (!e) {
    warn(fmt::format("dropping cache file {}: {}; compiling again", p.string(), why));
    std::error_code ec;
    fs::remove(p, ec);
    return std::nullopt;
  }
  utimensat(AT_FDCWD, p.c_str(), nullptr, 0);  // LRU: now is its last use (the kernel's clock)
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
  std::memcpy(h.checksum, raw_sha256(payload).data(), sizeof h.checksum);

  static std::atomic<uint64_t> counter{0};
  const fs::path final_path = path_of(key);
  const fs::path tmp = s_.dir / fmt::format("{}.tmp.{}.{}", key, getpid(), counter++);
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(&h), sizeof h);
    f.write(payload.data(), static_cast<std::streamsize>(payload.size()));
    f.close();
    if (!f) {
      warn(fmt::format("cannot write the cache file {}; the kernel is not cached", tmp.string()));
      std::error_code ec;
      fs::remove(tmp, ec);
      return;
    }
  }
  std::error_code ec;
  fs::rename(tmp, final_path, ec);
  if (ec) {
    warn(fmt::format("cannot rename {} to {} ({}); the kernel is not cached", tmp.string(),
                     final_path.string(), ec.message()));
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
  const int fd = open(p.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return Lock(-1);  // e.g. a read-only cache: compiles may then repeat, nothing worse
  while (flock(fd, LOCK_EX) != 0 && errno == EINTR) {
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
    it.bytes = de.file_size(ec);
    it.last_used = de.last_write_time(ec);
    std::string why;
    if (const auto file = read_file(p))
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
      if (de.path().extension() == ".bin") total += de.file_size(ec);
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
  for (const fs::path& p : doomed) fs::remove(p, ec);
  return n;
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
  for (const fs::directory_entry& de : fs::directory_iterator(s_.dir, ec)) {
    if (de.path().extension() != ".bin") continue;
    File f{de.path(), de.file_size(ec), de.last_write_time(ec)};
    total += f.bytes;
    if (de.path().stem() != keep) files.push_back(std::move(f));
  }
  if (total <= s_.max_bytes) return;
  std::sort(files.begin(), files.end(),
            [](const File& a, const File& b) { return a.mtime < b.mtime; });
  for (const File& f : files) {
    if (total <= s_.max_bytes) break;
    if (fs::remove(f.path, ec)) total -= f.bytes;
    fs::path lock = f.path;
    fs::remove(lock.replace_extension(".lock"), ec);
  }
}

}  // namespace flexc::jit
