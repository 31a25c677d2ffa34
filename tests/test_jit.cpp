// The JIT runtime: cache keys, the memory and disk caches (hits, corruption, locking, eviction),
// NVRTC errors mapped back to their source, every kernel template with every catalogue variant,
// and (with a GPU) the generated hooks evaluated on the device against the interpreter.
#include <fmt/format.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include "dsl/analysis.h"
#include "dsl/emit_cuda.h"
#include "flexc/device.h"
#include "flexc/error.h"
#include "flexc/jit.h"
#include "flexc/variant.h"
#include "jit/abi.h"
#include "jit/cache.h"
#include "jit/compiler.h"
#include "jit/jit.h"
#include "jit/kernels.h"
#include "jit/nvrtc_api.h"
#include "jit/splice.h"
#include "random_expr.h"
#include "test_random.h"
#include "variant_impl.h"

extern char** environ;

using namespace flexc;
using namespace flexc::jit;
namespace fs = std::filesystem;

namespace {

using flexc::testing::rng;

// Sets (or, with nullptr, unsets) an environment variable for the scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value)
      setenv(name, value, 1);
    else
      unsetenv(name);
  }
  ~ScopedEnv() {
    if (old_)
      setenv(name_, old_->c_str(), 1);
    else
      unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / fmt::format("flexc_jit_{}_{:x}", getpid(), rng()());
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

// A private, empty cache for one test: FLEXC_CACHE_DIR points into a temporary directory.
struct FreshCache {
  TempDir dir;
  ScopedEnv env{"FLEXC_CACHE_DIR", dir.path.c_str()};
  ScopedEnv on{"FLEXC_DISABLE_DISK_CACHE", nullptr};
  FreshCache() { reset_cache(); }
  ~FreshCache() { reset_cache(); }
  std::vector<fs::path> entries() const {
    std::vector<fs::path> out;
    for (const auto& e : fs::directory_iterator(dir.path))
      if (e.path().extension() == ".bin") out.push_back(e.path());
    return out;
  }
};

// A variant nobody compiled before in this cache: a random constant in its score_mod.
Variant fresh_variant() {
  return Variant::from_strings(fmt::format("score * {} + float(q_idx - kv_idx)",
                                           std::uniform_int_distribution<int>(2, 1 << 20)(rng())),
                               "kv_idx <= q_idx");
}

KernelSpec eval_spec(std::string arch = "sm_80") { return mods_eval_spec({std::move(arch)}); }

// Captures stderr while alive.
class StderrCapture {
 public:
  StderrCapture() : file_(std::tmpfile()) {
    std::fflush(stderr);
    saved_ = dup(2);
    dup2(fileno(file_), 2);
  }
  ~StderrCapture() {
    restore();
    std::fclose(file_);
  }
  std::string text() {
    restore();
    std::rewind(file_);
    std::string s;
    for (int c; (c = std::fgetc(file_)) != EOF;) s += static_cast<char>(c);
    return s;
  }

 private:
  void restore() {
    if (saved_ < 0) return;
    std::fflush(stderr);
    dup2(saved_, 2);
    close(saved_);
    saved_ = -1;
  }
  FILE* file_;
  int saved_ = -1;
};

std::string read_all(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

void write_all(const fs::path& p, std::string_view s) {
  std::ofstream(p, std::ios::binary | std::ios::trunc)
      .write(s.data(), static_cast<std::streamsize>(s.size()));
}

}  // namespace

// ---- keys

TEST_CASE("the cache key changes with every input and with nothing else", "[jit]") {
  const Unit base{{"k.cuh", "main text"}, {{"a.cuh", "header a"}, {kVariantHeader.data(), "gen"}}};
  const std::vector<std::string> opts = {"--gpu-architecture=sm_90", "-DX=1"};
  const auto key = [&](auto&& tweak) {
    std::string flexc = "0.1.0", nvrtc = "nvrtc 13.0 lib (1 bytes)", arch = "sm_90";
    std::vector<std::string> o = opts;
    Unit u = base;
    tweak(flexc, nvrtc, arch, o, u);
    return cache_key(flexc, nvrtc, arch, o, u);
  };
  const auto same = [](auto&...) {};
  const std::string k0 = key(same);
  CHECK(k0.size() == 64);
  CHECK(key(same) == k0);
  std::set<std::string> keys{k0};
  const std::vector<std::function<void(std::string&, std::string&, std::string&,
                                       std::vector<std::string>&, Unit&)>>
      tweaks = {
          [](auto& f, auto&, auto&, auto&, auto&) { f = "0.1.1"; },
          [](auto&, auto& n, auto&, auto&, auto&) { n = "nvrtc 13.0 lib (2 bytes)"; },
          [](auto&, auto&, auto& a, auto&, auto&) { a = "sm_80"; },
          [](auto&, auto&, auto&, auto& o, auto&) { o[1] = "-DX=2"; },
          [](auto&, auto&, auto&, auto& o, auto&) { o.push_back("-lineinfo"); },
          [](auto&, auto&, auto&, auto& o, auto&) { std::swap(o[0], o[1]); },
          [](auto&, auto&, auto&, auto&, auto& u) { u.main.name = "j.cuh"; },
          [](auto&, auto&, auto&, auto&, auto& u) { u.main.text += " "; },
          [](auto&, auto&, auto&, auto&, auto& u) { u.headers[0].name = "b.cuh"; },
          [](auto&, auto&, auto&, auto&, auto& u) { u.headers[0].text = "header A"; },
          [](auto&, auto&, auto&, auto&, auto& u) { u.headers[1].text += "\n"; },
          [](auto&, auto&, auto&, auto&, auto& u) {
            u.headers.push_back({"c.cuh", ""});
          },
          // Moving text between fields must not collide.
          [](auto&, auto&, auto&, auto&, auto& u) {
            u.main.text = "main tex";
            u.headers[0].text = "theader a";
          },
      };
  for (const auto& t : tweaks) CHECK(keys.insert(key(t)).second);
}

TEST_CASE("compile keys are stable and follow variant, template, headers, defines, arch", "[jit]") {
  FreshCache cache;
  ScopedEnv no_lineinfo("FLEXC_LINEINFO", nullptr);
  ScopedEnv no_dir("FLEXC_TEMPLATE_DIR", nullptr);
  const Variant v =
      Variant::from_strings("score * 2.0 + p", "kv_idx <= q_idx", {}, {{"p", "float", 1.0, false}});
  const std::string k = compile(v, eval_spec()).key;
  reset_cache();
  CHECK(compile(v, eval_spec()).key == k);  // no pointer, time or counter leaks into the key

  std::set<std::string> keys{k};
  const auto differs = [&](const Variant& var, const KernelSpec& s) {
    return keys.insert(compile(var, s).key).second;
  };
  CHECK(differs(
      Variant::from_strings("score * 3.0 + p", "kv_idx <= q_idx", {}, {{"p", "float", 1.0, false}}),
      eval_spec()));
  CHECK(differs(v, eval_spec("sm_90")));
  KernelSpec with_define = eval_spec();
  with_define.defines.push_back({"FLEXC_UNUSED", "1"});
  CHECK(differs(v, with_define));
  {
    ScopedEnv li("FLEXC_LINEINFO", "1");
    reset_cache();
    CHECK(differs(v, eval_spec()));
  }
  // A runtime param's value is a kernel argument: a new default compiles nothing new.
  CHECK(compile(Variant::from_strings("score * 2.0 + p", "kv_idx <= q_idx", {},
                                      {{"p", "float", 7.0, false}}),
                eval_spec())
            .key == k);
  // The entry name does not change the binary.
  KernelSpec other_entry = eval_spec();
  other_entry.entry = "something_else";
  CHECK(compile(v, other_entry).key == k);

  // Template and header contents, through FLEXC_TEMPLATE_DIR.
  TempDir tdir;
  ScopedEnv td("FLEXC_TEMPLATE_DIR", tdir.path.c_str());
  for (const char* file : {"mods_eval.cuh", "flexc_hooks.cuh"}) {
    write_all(tdir.path / file, *template_text(file) + "\n// edited\n");
    reset_cache();
    CHECK(differs(v, eval_spec()));
    fs::remove(tdir.path / file);
  }
  // A template in a folder of the directory (templates/ as in the tree), included by its name.
  fs::create_directories(tdir.path / "tile");
  write_all(tdir.path / "tile" / "flexc_hooks.cuh", *template_text("flexc_hooks.cuh") + "\n// x\n");
  reset_cache();
  CHECK(differs(v, eval_spec()));
  fs::remove_all(tdir.path / "tile");
  reset_cache();
  CHECK(compile(v, eval_spec()).key == k);
}

// ---- memory and disk cache

TEST_CASE("cache hits and misses, in memory and on disk", "[jit]") {
  FreshCache cache;
  const Variant v = fresh_variant();
  const CacheCounters c0 = cache_counters();

  const Compiled first = compile(v, eval_spec());
  CHECK_FALSE(first.from_cache);
  CHECK(first.compile_seconds > 0);
  CHECK(first.cubin.size() > 0);
  CHECK(first.ptx.find(".entry flexc_mods_eval") != std::string::npos);
  CHECK(cache_counters().compiles == c0.compiles + 1);
  CHECK(cache.entries().size() == 1);

  const Compiled mem = compile(v, eval_spec());
  CHECK(mem.from_cache);
  CHECK_FALSE(mem.from_disk);
  CHECK(mem.cubin == first.cubin);
  CHECK(cache_counters().memory_hits == c0.memory_hits + 1);

  reset_cache();  // a new process, as far as the cache can tell
  const Compiled disk = compile(v, eval_spec());
  CHECK(disk.from_disk);
  CHECK(disk.cubin == first.cubin);
  CHECK(disk.ptx == first.ptx);
  CHECK(disk.compile_seconds == 0);
  CHECK(cache_counters().disk_hits == c0.disk_hits + 1);
  CHECK(cache_counters().compiles == c0.compiles + 1);

  {
    ScopedEnv off("FLEXC_DISABLE_DISK_CACHE", "1");
    reset_cache();
    CHECK_FALSE(compile(v, eval_spec()).from_cache);
    CHECK(cache_counters().compiles == c0.compiles + 2);
  }
  reset_cache();
  CHECK_FALSE(compile(v, eval_spec(), {.use_cache = false}).from_cache);
  CHECK(cache_counters().compiles == c0.compiles + 3);
  CHECK(compile(v, eval_spec()).from_disk);
}

TEST_CASE("the public JIT API: templates, ahead-of-time compiles, the disk cache", "[jit]") {
  std::set<std::string> all, sm80, sm90;
  for (const flexc::KernelInfo& k : flexc::kernel_templates()) all.insert(k.name);
  for (const flexc::KernelInfo& k : flexc::kernel_templates("sm_80")) sm80.insert(k.name);
  for (const flexc::KernelInfo& k : flexc::kernel_templates("sm_90")) sm90.insert(k.name);
  CHECK(all.size() == known_kernels().size());
  CHECK(all.count("attention_bwd_sm90"));
  CHECK_FALSE(sm80.count("attention_bwd_sm90"));
  CHECK(sm90.count("attention_bwd_sm90"));
  CHECK(sm80.count("attention_fwd"));

  FreshCache cache;
  const Variant v = fresh_variant();
  const flexc::KernelBuild builds[] = {{"mods_eval", "sm_80"},
                                       {"attention_fwd_sm90", "sm_90", "fp16", 64}};
  const std::vector<flexc::CompiledKernel> out = flexc::compile_kernels(v, builds);
  REQUIRE(out.size() == 2);
  CHECK(out[0].arch == "sm_80");
  CHECK(out[1].arch == "sm_90a");  // the Hopper kernel builds for the arch-specific target
  for (const flexc::CompiledKernel& c : out) {
    CHECK(c.origin == flexc::CompiledKernel::Origin::Compiled);
    CHECK(c.cubin.size() > 0);
    CHECK(c.source.find("struct FlexcVariant") != std::string::npos);
  }
  CHECK(out[1].ptx.find("wgmma.mma_async") != std::string::npos);
  CHECK(flexc::compile_kernels(v, builds)[0].origin ==
        flexc::CompiledKernel::Origin::MemoryCache);
  CHECK(flexc::compile_kernels(v, builds, false)[0].origin ==
        flexc::CompiledKernel::Origin::Compiled);
  flexc::clear_kernel_memory_cache();  // the next compile reads the disk
  CHECK(flexc::compile_kernels(v, builds)[1].origin == flexc::CompiledKernel::Origin::DiskCache);
  const flexc::KernelBuild unknown[] = {{"attention_nope", "sm_90"}};
  CHECK_THROWS_WITH(flexc::compile_kernels(v, unknown),
                    Catch::Contains("unknown kernel 'attention_nope'") &&
                        Catch::Contains("attention_fwd"));

  const flexc::KernelCacheInfo info = flexc::kernel_cache_info();
  CHECK(info.dir == cache.dir.path.string());
  CHECK(info.enabled);
  CHECK(info.entries == 2);
  CHECK(info.bytes > out[0].cubin.size());
  const std::vector<flexc::KernelCacheEntry> entries = flexc::kernel_cache_entries();
  REQUIRE(entries.size() == 2);
  const bool listed = entries[0].description.find("mods_eval.cuh") != std::string::npos ||
                      entries[1].description.find("mods_eval.cuh") != std::string::npos;
  CHECK(listed);
  const auto age = std::chrono::system_clock::now() - entries[0].last_used;
  CHECK(age < std::chrono::minutes(5));
  CHECK(flexc::clear_kernel_cache() == 2);
  CHECK(flexc::kernel_cache_info().entries == 0);

  // The Hopper forward's wide kv tiles (what flexc::attention runs at D 192 without staged
  // loads): 112 keys per tile, a build of its own; only that kernel, at the head dims that have
  // them.
  const Variant plain = Variant::from_strings(
      fmt::format("score * {}", std::uniform_int_distribution<int>(2, 1 << 20)(rng())),
      "kv_idx <= q_idx");
  flexc::KernelBuild wide{"attention_fwd_sm90", "sm_90a", "bf16", 192};
  const flexc::CompiledKernel narrow = flexc::compile_kernels(plain, std::span(&wide, 1))[0];
  wide.wide_kv = true;
  const flexc::CompiledKernel w = flexc::compile_kernels(plain, std::span(&wide, 1))[0];
  CHECK(w.key != narrow.key);
  CHECK(w.ptx.find("m64n112k16") != std::string::npos);
  CHECK(narrow.ptx.find("m64n112k16") == std::string::npos);
  const flexc::KernelBuild bad[] = {
      {"attention_fwd", "sm_90", "bf16", 128, 0, false, false, false, true},
      {"attention_fwd_sm90", "sm_90", "bf16", 64, 0, false, false, false, true}};
  CHECK_THROWS_WITH(flexc::compile_kernels(v, std::span(&bad[0], 1)),
                    "kernel 'attention_fwd': wide_kv is attention_fwd_sm90's alone");
  CHECK_THROWS_WITH(flexc::compile_kernels(v, std::span(&bad[1], 1)),
                    Catch::Contains("no wide kv tiles for head dims 64 / 64"));
}

TEST_CASE("truncated, corrupt and foreign cache files are dropped and recompiled", "[jit]") {
  FreshCache cache;
  const Variant v = fresh_variant();
  const Compiled good = compile(v, eval_spec());
  const fs::path file = cache.entries().at(0);
  const std::string bytes = read_all(file);
  REQUIRE(bytes.size() > 200);

  struct Damage {
    const char* what;
    std::string content;
    const char* reason;
  };
  std::string flipped_payload = bytes, flipped_key = bytes, other_format = bytes;
  flipped_payload[bytes.size() / 2] ^= 0x10;
  flipped_key[20] = flipped_key[20] == 'a' ? 'b' : 'a';
  other_format[8] = 99;
  std::string noise(300, '\0');
  for (char& c : noise) c = static_cast<char>(rng()());
  const std::vector<Damage> damages = {
      {"truncated payload", bytes.substr(0, bytes.size() - 100), "payload of"},
      {"truncated header", bytes.substr(0, 50), "truncated header"},
      {"empty", "", "not a flexc cache file"},
      {"flipped payload byte", flipped_payload, "checksum mismatch"},
      {"another key", flipped_key, "another key"},
      {"another format", other_format, "written in cache format 99"},
      {"foreign text", "#!/bin/sh\necho this is not a cubin\n", "not a flexc cache file"},
      {"random bytes", noise, "not a flexc cache file"},
  };
  for (const Damage& d : damages) {
    INFO(d.what);
    write_all(file, d.content);
    reset_cache();
    const CacheCounters before = cache_counters();
    StderrCapture err;
    const Compiled again = compile(v, eval_spec());
    const std::string warning = err.text();
    CHECK_FALSE(again.from_cache);
    CHECK(cache_counters().compiles == before.compiles + 1);
    CHECK(again.cubin == good.cubin);
    CHECK(warning.find("flexc: warning: dropping cache file " + file.string()) !=
          std::string::npos);
    CHECK(warning.find(d.reason) != std::string::npos);
    CHECK(read_all(file) == bytes);  // rewritten whole
  }
}

TEST_CASE("cache damage a hostile user can do is bypassed with a warning and the right cubin",
          "[jit]") {
  FreshCache cache;
  const Variant v = fresh_variant(), w = fresh_variant();
  const Compiled good = compile(v, eval_spec());
  const Compiled other = compile(w, eval_spec());
  const fs::path file = cache.dir.path / (good.key + ".bin");
  const fs::path other_file = cache.dir.path / (other.key + ".bin");
  const std::string bytes = read_all(file);
  // Recompiles v with a cold in-memory cache; returns the warning.
  const auto again = [&](const char* what) {
    INFO(what);
    reset_cache();
    StderrCapture err;
    const Compiled c = compile(v, eval_spec());
    CHECK_FALSE(c.from_cache);
    CHECK(c.cubin == good.cubin);
    return err.text();
  };
  const auto clean = [&] {
    std::error_code ec;
    fs::remove_all(file, ec);
  };

  clean();
  fs::create_symlink("/dev/zero", file);
  CHECK_THAT(again("a link to /dev/zero"), Catch::Contains(": it is a symbolic link; removed"));
  CHECK(read_all(file) == bytes);

  clean();
  REQUIRE(mkfifo(file.c_str(), 0600) == 0);
  CHECK_THAT(again("a FIFO"), Catch::Contains(": it is not a regular file; removed"));

  clean();
  fs::create_directories(file / "inside");
  CHECK_THAT(again("a directory with contents"),
             Catch::Contains("it is a directory; it cannot be removed, so it is bypassed"));
  CHECK_THAT(again("still there"), Catch::Contains("the kernel is not cached"));
  {  // a directory in an entry's place counts as no bytes, not as a wrapped -1
    const DiskCache dc(CacheSettings::from_env());
    CHECK(dc.total_bytes() < (uint64_t{1} << 30));
    for (const DiskCache::Item& it : dc.list()) CHECK(it.bytes < (uint64_t{1} << 30));
  }
  CHECK(DiskCache(CacheSettings::from_env()).clear() == 2);  // both entries: the directory too
  CHECK_FALSE(fs::exists(file));
  reset_cache();
  compile(v, eval_spec());
  compile(w, eval_spec());

  // Another entry copied over this one with its key patched (the checksum covers the key).
  std::string forged = read_all(other_file);
  REQUIRE(forged.size() > 80);
  forged.replace(16, 64, good.key);
  write_all(file, forged);
  CHECK_THAT(again("a patched copy of another entry"), Catch::Contains("checksum mismatch"));
  CHECK(read_all(file) == bytes);

  // A damaged header says what is wrong with it.
  std::string damaged = bytes;
  damaged[12] = 7;  // header_bytes
  write_all(file, damaged);
  CHECK_THAT(again("header size"), Catch::Contains("damaged header (it gives its size as 7 bytes"));

  // Untrusted: an entry others can write is not loaded; neither is a shared directory.
  fs::permissions(file, fs::perms::group_write, fs::perm_options::add);
  CHECK_THAT(again("a group-writable entry"),
             Catch::Contains("other users can write it (mode 0620); removed"));
  CHECK((fs::status(file).permissions() & fs::perms::all) ==
        (fs::perms::owner_read | fs::perms::owner_write));  // rewritten private
  fs::permissions(cache.dir.path, fs::perms::all);
  reset_cache();
  {
    StderrCapture err;
    CHECK_FALSE(compile(v, eval_spec()).from_disk);
    CHECK_THAT(err.text(), Catch::Contains("other users can write it (mode 0777)"));
  }
  fs::permissions(cache.dir.path, fs::perms::owner_all);
}

TEST_CASE("a held lock delays a compile only up to the timeout, and leftovers are cleaned", "[jit]") {
  FreshCache cache;
  ScopedEnv t("FLEXC_CACHE_LOCK_TIMEOUT", "0.3");
  const Variant v = fresh_variant();
  const std::string key = compile(v, eval_spec()).key;
  fs::remove(cache.dir.path / (key + ".bin"));
  // flock locks belong to an open file description: a second open() here is "another process".
  const int fd = open((cache.dir.path / (key + ".lock")).c_str(), O_RDWR);
  REQUIRE(fd >= 0);
  REQUIRE(flock(fd, LOCK_EX) == 0);
  reset_cache();
  {
    StderrCapture err;
    const auto t0 = std::chrono::steady_clock::now();
    CHECK_FALSE(compile(v, eval_spec()).from_cache);
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20));
    CHECK_THAT(err.text(), Catch::Contains("compiling without waiting for it"));
  }
  close(fd);

  // A killed writer's temporary file and an unused lock file, both old, are counted, then evicted.
  const DiskCache dc(CacheSettings::from_env());
  const fs::path tmp = cache.dir.path / (key + ".tmp.99999.0");
  write_all(tmp, std::string(1000, 'x'));
  const auto old = fs::file_time_type::clock::now() - std::chrono::hours(1);
  fs::last_write_time(tmp, old);
  fs::last_write_time(cache.dir.path / (key + ".lock"), old);
  DiskCache::Leftovers l = dc.leftovers();
  CHECK(l.temp_files == 1);
  CHECK(l.temp_bytes == 1000);
  CHECK(l.lock_files == 1);
  dc.evict();
  l = dc.leftovers();
  CHECK(l.temp_files == 0);
  CHECK(l.lock_files == 0);
  CHECK(dc.list().size() == 1);  // the entry stays
  {
    ScopedEnv bad("FLEXC_CACHE_LOCK_TIMEOUT", "soon");
    CHECK_THROWS_WITH(CacheSettings::from_env(), Catch::Contains("FLEXC_CACHE_LOCK_TIMEOUT='soon'"));
  }
}

TEST_CASE("one key compiles once across threads, several keys at once", "[jit]") {
  FreshCache cache;
  const Variant v = fresh_variant();
  const CacheCounters c0 = cache_counters();
  std::vector<std::string> keys(8);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < keys.size(); ++i)
    threads.emplace_back([&, i] { keys[i] = compile(v, eval_spec()).key; });
  for (std::thread& t : threads) t.join();
  CHECK(std::set<std::string>(keys.begin(), keys.end()).size() == 1);
  CHECK(cache_counters().compiles == c0.compiles + 1);
  CHECK(cache_counters().memory_hits == c0.memory_hits + 7);

  const Variant w = fresh_variant();
  const std::vector<KernelSpec> specs = {eval_spec("sm_80"), eval_spec("sm_86"), eval_spec("sm_90"),
                                         eval_spec("sm_80")};
  const std::vector<Compiled> all = compile_all(w, specs);
  REQUIRE(all.size() == 4);
  CHECK(all[0].key == all[3].key);
  CHECK(std::set<std::string>{all[0].key, all[1].key, all[2].key}.size() == 3);
  CHECK(cache_counters().compiles == c0.compiles + 4);
  CHECK(cache.entries().size() == 4);

  // A failure is reported, after the other compiles finished.
  const std::vector<KernelSpec> bad = {eval_spec("sm_80"), eval_spec("sm_1")};
  CHECK_THROWS_WITH(compile_all(w, bad), Catch::Contains("cannot compile for 'sm_1'"));
}

// The child side of the next test: compiles one fixed key and reports how it got it.
TEST_CASE("jit child: compile one key", "[.jit_child]") {
  const char* out = std::getenv("FLEXC_JIT_CHILD_OUT");
  if (!out) return;  // run by hand: nothing to report to
  const Variant v = Variant::from_strings(std::getenv("FLEXC_JIT_CHILD_SCORE"), "kv_idx <= q_idx");
  const Compiled c = compile(v, eval_spec());
  std::ofstream(out) << (c.from_disk    ? "disk"
                         : c.from_cache ? "memory"
                                        : "compiled")
                     << " " << c.key << "\n";
  REQUIRE(!c.cubin.empty());
}

TEST_CASE("eight processes asking for one key compile it once", "[jit]") {
  FreshCache cache;
  const std::string score = fmt::format("score * {} - float(kv_idx)",
                                        std::uniform_int_distribution<int>(2, 1 << 20)(rng()));
  ScopedEnv s("FLEXC_JIT_CHILD_SCORE", score.c_str());
  constexpr int kProcs = 8;
  std::vector<pid_t> pids;
  std::vector<fs::path> outs;
  for (int i = 0; i < kProcs; ++i) {
    outs.push_back(cache.dir.path / fmt::format("child{}.txt", i));
    const std::string out_var = "FLEXC_JIT_CHILD_OUT=" + outs.back().string();
    std::vector<char*> envp;
    for (char** e = environ; *e; ++e) envp.push_back(*e);
    envp.push_back(const_cast<char*>(out_var.c_str()));
    envp.push_back(nullptr);
    char arg0[] = "test_jit", arg1[] = "jit child: compile one key";
    char* argv[] = {arg0, arg1, nullptr};
    pid_t pid = 0;
    REQUIRE(posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv, envp.data()) == 0);
    pids.push_back(pid);
  }
  for (pid_t pid : pids) {
    int status = 0;
    REQUIRE(waitpid(pid, &status, 0) == pid);
    CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 0));
  }
  std::map<std::string, int> how;
  std::set<std::string> keys;
  for (const fs::path& p : outs) {
    std::string h, k;
    std::ifstream(p) >> h >> k;
    ++how[h];
    keys.insert(k);
  }
  CHECK(how["compiled"] == 1);
  CHECK(how["disk"] == kProcs - 1);
  CHECK(keys.size() == 1);
  CHECK(cache.entries().size() == 1);
}

TEST_CASE("least recently used entries are evicted past the size limit", "[jit]") {
  TempDir dir;
  const std::string blob(1000, 'x');
  DiskCache dc({dir.path, true, 3500});
  const auto key = [](int i) { return fmt::format("{:064x}", i + 1); };
  const auto t0 = fs::file_time_type::clock::now() - std::chrono::hours(1);
  for (int i = 0; i < 3; ++i) {
    dc.store(key(i), {"entry", blob, ""});
    fs::last_write_time(dc.path_of(key(i)), t0 + std::chrono::minutes(i));
  }
  CHECK(dc.list().size() == 3);
  REQUIRE(dc.load(key(0)));  // a hit makes entry 0 the most recently used
  dc.store(key(3), {"entry", blob, ""});
  std::set<std::string> left;
  for (const DiskCache::Item& it : dc.list()) left.insert(it.key);
  CHECK(left == std::set<std::string>{key(0), key(2), key(3)});
  CHECK(dc.total_bytes() <= 3500);
  CHECK(dc.list().front().description == "entry");
  CHECK(dc.clear() == 3);
  CHECK(dc.list().empty());
}

TEST_CASE("cache settings come from the environment", "[jit]") {
  ScopedEnv a("FLEXC_CACHE_DIR", nullptr), b("XDG_CACHE_HOME", "/x/cache"), c("HOME", "/home/u"),
      d("FLEXC_DISABLE_DISK_CACHE", nullptr), e("FLEXC_CACHE_MAX_BYTES", nullptr);
  CHECK(CacheSettings::from_env().dir == "/x/cache/flexc");
  CHECK(CacheSettings::from_env().disk);
  {
    ScopedEnv x("XDG_CACHE_HOME", nullptr);
    CHECK(CacheSettings::from_env().dir == "/home/u/.cache/flexc");
  }
  {
    ScopedEnv x("FLEXC_CACHE_DIR", "/tmp/here");
    CHECK(CacheSettings::from_env().dir == "/tmp/here");
  }
  {
    ScopedEnv x("FLEXC_DISABLE_DISK_CACHE", "1");
    CHECK_FALSE(CacheSettings::from_env().disk);
  }
  for (auto [text, bytes] :
       {std::pair{"12345", 12345ull}, {"10K", 10240ull}, {"3M", 3ull << 20}, {"2G", 2ull << 30}}) {
    ScopedEnv x("FLEXC_CACHE_MAX_BYTES", text);
    CHECK(CacheSettings::from_env().max_bytes == bytes);
  }
  for (const char* bad : {"12Q", "-5", "K", "1.5G", "99999999999999999999"}) {
    ScopedEnv x("FLEXC_CACHE_MAX_BYTES", bad);
    CHECK_THROWS_WITH(CacheSettings::from_env(), Catch::Contains("FLEXC_CACHE_MAX_BYTES"));
  }
}

// ---- errors

TEST_CASE("NVRTC errors map back to the user's expression or the template line", "[jit]") {
  dsl::Mod score;
  score.kind = dsl::ModKind::Score;
  score.source = "let d = q_idx - kv_idx;\nscore + float(d // 3)";
  score.origin = "alibi.json: score_mod";
  const std::string header =
      "// generated\n"
      "struct FlexcVariant {\n"
      "    const int t5 = flexc_floordiv(t4, 3);  // @score_mod:38:44\n"
      "    const int t6 = flexc_sub(q_idx, kv_idx);\n"
      "};\n";
  const ErrorContext ctx{"compiling the flexc mods_eval kernel for variant 'alibi' (sm_90)", header,
                         &score, nullptr};
  const std::string log =
      "flexc_variant.cuh(3): error: identifier \"flexc_floordiv\" is undefined\n"
      "      const int t5 = flexc_floordiv(t4, 3);\n"
      "                     ^\n\n"
      "flexc_variant.cuh(4): warning #177-D: variable \"t6\" was declared but never referenced\n\n"
      "mods_eval.cuh(12): error: expected a \";\"\n"
      "    int x = 1\n"
      "             ^\n\n"
      "flexc_variant.cuh(4): error: too few arguments\n\n"
      "3 errors detected in the compilation of \"mods_eval.cuh\".\n";
  const std::string msg = explain_nvrtc_log(log, ctx);
  INFO(msg);
  CHECK(msg.starts_with(
      "compiling the flexc mods_eval kernel for variant 'alibi' (sm_90) failed:\n"));
  // The marker: line 2, column 15 of the user's text, with a caret under `d // 3`.
  CHECK(msg.find("alibi.json: score_mod:2:15: error: the CUDA compiler rejected the code "
                 "generated for this: identifier \"flexc_floordiv\" is undefined") !=
        std::string::npos);
  CHECK(msg.find("score + float(d // 3)\n") != std::string::npos);
  CHECK(msg.find("^~~~~~") != std::string::npos);
  CHECK(msg.find("templates/mods_eval.cuh:12: error: expected a \";\"\n    int x = 1\n") !=
        std::string::npos);
  CHECK(msg.find("flexc_variant.cuh:4: error: too few arguments (in flexc's generated code: a "
                 "flexc bug)") != std::string::npos);
  CHECK(msg.find("warning") == std::string::npos);
  CHECK(msg.find("errors detected") == std::string::npos);

  // An unrecognisable log is shown whole.
  CHECK(explain_nvrtc_log("internal compiler failure\n", ctx).find("internal compiler failure") !=
        std::string::npos);
}

TEST_CASE("a real NVRTC error on a generated line points at the user's text", "[jit]") {
  const Variant v = Variant::from_strings("score + float((q_idx - kv_idx) // 7)", "true");
  const detail::VariantImpl& impl = flexc::detail::impl_of(v);
  std::string header =
      dsl::emit_cuda_variant(detail::emit_input(impl));
  // Break the statement the user's `//` became, as a miscompiled emitter would.
  const size_t at = header.find("flexc_floordiv(");
  REQUIRE(at != std::string::npos);
  header.replace(at, 15, "flexc_floordiv_nope(");
  const ErrorContext ctx{"compiling a test kernel", header, &impl.score, &impl.mask};
  try {
    nvrtc_compile(splice("mods_eval.cuh", header), nvrtc_options("sm_80", {}), ctx);
    FAIL("the broken header compiled");
  } catch (const Error& e) {
    const std::string msg = e.what();
    INFO(msg);
    CHECK(msg.find("score_mod:1:15: error: the CUDA compiler rejected the code generated for "
                   "this: identifier \"flexc_floordiv_nope\" is undefined") != std::string::npos);
    CHECK(msg.find("score + float((q_idx - kv_idx) // 7)\n") != std::string::npos);
    CHECK(msg.find("^~~~~~~~~~~~~~~~~~~~~\n") != std::string::npos);
  }
}

TEST_CASE("an error in a template names the template file and line", "[jit]") {
  FreshCache cache;
  TempDir tdir;
  ScopedEnv td("FLEXC_TEMPLATE_DIR", tdir.path.c_str());
  std::string text = *template_text("mods_eval.cuh");
  const size_t lines = static_cast<size_t>(std::count(text.begin(), text.end(), '\n'));
  write_all(tdir.path / "mods_eval.cuh", text + "int broken = ;\n");
  reset_cache();
  CHECK_THROWS_WITH(compile(fresh_variant(), eval_spec()),
                    Catch::Contains(fmt::format("templates/mods_eval.cuh:{}: error: expected an "
                                                "expression",
                                                lines + 1)));
}

TEST_CASE("bad kernel requests get one clear error", "[jit]") {
  FreshCache cache;
  const Variant v = fresh_variant();
  CHECK_THROWS_WITH(compile(v, {"nope.cuh", "x", {}, "sm_90"}),
                    Catch::Contains("unknown kernel template 'nope.cuh' (templates: ") &&
                        Catch::Contains("mods_eval.cuh"));
  CHECK_THROWS_WITH(
      compile(v, eval_spec("sm_91")),
      Catch::Contains("cannot compile for 'sm_91': NVRTC targets ") && Catch::Contains("sm_90"));
  CHECK_THROWS_WITH(compile(v, eval_spec("gfx90a")),
                    Catch::Contains("cannot compile for 'gfx90a'"));
  KernelSpec bad = eval_spec();
  bad.defines.push_back({"A B", "1"});
  CHECK_THROWS_WITH(compile(v, bad), Catch::Contains("bad kernel define 'A B=1'"));
  CHECK_THROWS_WITH(find_kernel("nope"), Catch::Contains("unknown kernel 'nope' (kernels: ") &&
                                             Catch::Contains("mods_eval"));
  CHECK(compile(v, {"mods_eval.cuh", "x", {}, "compute_90"}).cubin.empty());
}

TEST_CASE("NVRTC is searched for in a documented order and a failed search says where it looked",
          "[jit]") {
  {
    ScopedEnv home("CUDA_HOME", "/opt/cuda-a");
    ScopedEnv path("CUDA_PATH", "");
    flexc::add_nvrtc_search_dir("/opt/wheel/nvidia/cu13/lib");
    const std::vector<std::string> c = nvrtc_candidates();
    const auto at = [&](std::string_view x) {
      return std::find(c.begin(), c.end(), x) - c.begin();
    };
    CHECK(c.front() == "/opt/cuda-a/lib64/libnvrtc.so.13");
    CHECK(at("/opt/cuda-a/lib64/libnvrtc.so.12") == 1);
    CHECK(at("/opt/cuda-a/lib64/libnvrtc.so.12") < at("/usr/local/cuda/lib64/libnvrtc.so.13"));
    CHECK(at("/usr/local/cuda/lib64/libnvrtc.so.13") <
          at("/opt/wheel/nvidia/cu13/lib/libnvrtc.so.13"));
    CHECK(at("/opt/wheel/nvidia/cu13/lib/libnvrtc.so.13") < at("libnvrtc.so.13"));
    CHECK(c.back() == "libnvrtc.so.12");
  }
  {
    ScopedEnv forced("FLEXC_NVRTC", "/x/libnvrtc.so");
    CHECK(nvrtc_candidates() == std::vector<std::string>{"/x/libnvrtc.so"});
  }
  const NvrtcLoad none = load_nvrtc({"/nonexistent/libnvrtc.so.13", "libc.so.6"});
  CHECK_THAT(none.error, Catch::Contains("NVRTC (the CUDA runtime compiler, libnvrtc.so.13) was "
                                         "not found. Tried:") &&
                             Catch::Contains("/nonexistent/libnvrtc.so.13: not found") &&
                             Catch::Contains("libc.so.6: lacks nvrtcVersion") &&
                             Catch::Contains("set FLEXC_NVRTC"));
  // This machine's NVRTC (the toolkit's) loads, and the cache keys name the file loaded.
  const NvrtcLoad real = load_nvrtc(nvrtc_candidates());
  REQUIRE(real.error.empty());
  CHECK_THAT(nvrtc_identity(), Catch::Contains(real.api.path));
}

// ---- templates x catalogue

TEST_CASE("NVRTC's own cache is off where it has one: flexc's disk cache keeps the cubins",
          "[jit]") {
  // NVRTC 12.9 added a cache of compiled programs; 13.0 (the CI toolkit) has it.
  const std::vector<std::string> opts = nvrtc_options("sm_90", {{"FLEXC_X", "1"}});
  const bool off = std::find(opts.begin(), opts.end(), "--no-cache") != opts.end();
  CHECK(off == (nvrtc_identity().rfind("nvrtc 12.", 0) != 0 ||
                nvrtc_identity().rfind("nvrtc 12.9", 0) == 0));
  CHECK(opts.back() == "-DFLEXC_X=1");
}

TEST_CASE("every kernel template compiles with every catalogue variant for sm_80 and sm_90",
          "[jit][catalogue]") {
  FreshCache cache;
  REQUIRE_FALSE(Variant::catalogue_names().empty());
  for (const std::string& name : Variant::catalogue_names()) {
    const Variant v = Variant::from_catalogue(name);
    std::vector<KernelSpec> specs;
    for (const char* arch : {"sm_80", "sm_90"})
      for (const KnownKernel* k : kernels_for_arch(arch)) specs.push_back(k->spec({arch, "bf16", 128}));
    INFO(name);
    const std::vector<Compiled> out = compile_all(v, specs);
    for (size_t i = 0; i < out.size(); ++i) {
      INFO(specs[i].template_name << " " << specs[i].arch);
      CHECK(out[i].cubin.size() > 0);
      CHECK(out[i].ptx.find(".entry " + specs[i].entry) != std::string::npos);
    }
  }
}

// Declarations for random mods: every capture dtype, ranks 1-4, every dim symbol, both param
// types.
static dsl::Decls random_mod_decls() {
  dsl::Decls decls;
  decls.captures.push_back({"f", dsl::DType::F32, {{dsl::Dim::H}}});
  decls.captures.push_back({"h", dsl::DType::F16, {{dsl::Dim::Fixed, 4}, {dsl::Dim::QLen}}});
  decls.captures.push_back({"bf", dsl::DType::BF16, {{dsl::Dim::KvLen}}});
  decls.captures.push_back(
      {"i", dsl::DType::I32, {{dsl::Dim::B}, {dsl::Dim::Fixed, 3}, {dsl::Dim::Fixed, 2}}});
  decls.captures.push_back(
      {"m",
       dsl::DType::Bool,
       {{dsl::Dim::Fixed, 2}, {dsl::Dim::Fixed, 2}, {dsl::Dim::Fixed, 2}, {dsl::Dim::H}}});
  decls.params.push_back({"pf", dsl::Type::Float, 0, false});
  decls.params.push_back({"pi", dsl::Type::Int, 0, false});
  return decls;
}

TEST_CASE("generated code for random mods compiles with NVRTC", "[jit]") {
  const dsl::Decls decls = random_mod_decls();
  dsl::testing::RandomExprOptions sopt;
  sopt.decls = &decls;
  sopt.inputs[0] = true;
  sopt.max_depth = 6;
  dsl::testing::RandomExprOptions mopt = sopt;
  mopt.inputs[0] = false;
  const uint64_t seed = rng()();
  for (int i = 0; i < 6; ++i) {
    dsl::Graph s, m;
    s.root = dsl::testing::RandomExpr(seed + 2 * i, sopt).float_expr(s);
    m.root = dsl::testing::RandomExpr(seed + 2 * i + 1, mopt).bool_expr(m);
    // Both float-math modes, alternately.
    const dsl::FloatMath math = i % 2 ? dsl::FloatMath::Fast : dsl::FloatMath::Exact;
    const std::string header = dsl::emit_cuda_variant({&s, &m, &decls, "random", math});
    INFO(header);
    const NvrtcOutput out = nvrtc_compile(splice("mods_eval.cuh", header),
                                          nvrtc_options("sm_90", {}), {"compiling", header});
    CHECK(out.cubin.size() > 0);
  }
}

TEST_CASE("the spliced source is one self-contained translation unit", "[jit]") {
  FreshCache cache;
  const Compiled c = compile(Variant::from_catalogue("alibi"), eval_spec("sm_90"));
  CHECK(c.source.find("#line 1 \"flexc_hooks.cuh\"") != std::string::npos);
  CHECK(c.source.find("#line 1 \"flexc_variant.cuh\"") != std::string::npos);
  CHECK(c.source.find("#include \"") == std::string::npos);
  // NVRTC compiles it with no in-memory headers at all, to the same machine code.
  const NvrtcOutput alone =
      nvrtc_compile({{"spliced.cu", c.source}, {}}, nvrtc_options("sm_90", {}), {"compiling", ""});
  CHECK(alone.cubin.size() > 0);
  CHECK(alone.ptx.find(".entry flexc_mods_eval") != std::string::npos);
}

// ---- on a GPU

namespace {

int64_t extent(const dsl::Dim& d, int B, int H, int q_len, int kv_len) {
  switch (d.kind) {
    case dsl::Dim::B:
      return B;
    case dsl::Dim::H:
      return H;
    case dsl::Dim::QLen:
      return q_len;
    case dsl::Dim::KvLen:
      return kv_len;
    case dsl::Dim::Fixed:
      break;
  }
  return d.extent;
}

// Random finite elements of a dtype; fp16 / bf16 as bits.
std::vector<uint8_t> random_elements(dsl::DType t, size_t n) {
  std::vector<uint8_t> out;
  for (size_t i = 0; i < n; ++i) {
    const float f = std::uniform_real_distribution<float>(-2, 2)(rng());
    const int32_t k = std::uniform_int_distribution<int32_t>(0, 3)(rng());
    // fp16: sign, exponent 10..19 (0.0005 .. 16), random mantissa.
    const uint16_t h =
        static_cast<uint16_t>((rng()() & 0x8000) | ((10 + rng()() % 10) << 10) | (rng()() & 0x3ff));
    const uint16_t bf = static_cast<uint16_t>(std::bit_cast<uint32_t>(f) >> 16);
    const uint8_t* p = nullptr;
    size_t bytes = 0;
    switch (t) {
      case dsl::DType::F32:
        p = reinterpret_cast<const uint8_t*>(&f), bytes = 4;
        break;
      case dsl::DType::I32:
        p = reinterpret_cast<const uint8_t*>(&k), bytes = 4;
        break;
      case dsl::DType::F16:
        p = reinterpret_cast<const uint8_t*>(&h), bytes = 2;
        break;
      case dsl::DType::BF16:
        p = reinterpret_cast<const uint8_t*>(&bf), bytes = 2;
        break;
      case dsl::DType::Bool:
        out.push_back(static_cast<uint8_t>(k & 1));
        continue;
    }
    out.insert(out.end(), p, p + bytes);
  }
  return out;
}

// `got` is `want` within `tol` relative (absolute below magnitude 1); with tol == 0, bit for bit
// (any NaN matches any NaN).
// Bit for bit (tol 0) up to the sign of a zero: CUDA 13.0's ptxas compiles `c ? 1.0f : -0.0f`
// (selp.f32 of those constants) to FSET.BF, which yields +0.0 (seed 810968609 of the random-mod
// test below: a derivative `-(c ? -1.0f : 0.0f)` came out +0 where the interpreter has -0). A
// value computed further from such a zero (1 / it) still differs, and is still caught.
bool close(float got, double want, double tol) {
  if (std::isnan(want)) return std::isnan(got);
  if (tol == 0)
    return std::bit_cast<uint32_t>(got) == std::bit_cast<uint32_t>(static_cast<float>(want)) ||
           (got == 0 && want == 0);
  if (std::isinf(want)) return got == want;
  return std::abs(got - want) <= tol * std::max(1.0, std::abs(want));
}

// Runs mods_eval for `v` over every in-range point (the hooks' contract) with random captures,
// params and scores, and compares with the interpreter: masks exactly, score_mod and its
// derivative within `tol` of the F32 mode (0: bit for bit) and score_mod within 10 tol of the F64
// oracle, capture gradients within 1e-5 of the summed magnitudes (atomics add in any order).
// What flexc_mods_eval wrote (templates/mods_eval.cuh) over the grid [0, B) x [0, H) x [0, q_len)
// x [0, kv_len) with `scores` in: score_mod, its derivative and the mask, outputs poisoned first.
struct ModsEvalOut {
  std::vector<float> score, grad;
  std::vector<uint8_t> mask;
};
ModsEvalOut mods_eval(const Kernel& k, FlexcArgs& args, int B, int H, int q_len, int kv_len,
                      const std::vector<float>& scores, float grad_score) {
  const size_t n = scores.size();
  DeviceBuffer s_in = DeviceBuffer::from(std::span<const float>(scores));
  DeviceBuffer s_out(n * 4), g_out(n * 4), m_out(n);
  s_out.fill(0xff);  // poisoned: NaN until written
  g_out.fill(0xff);
  m_out.fill(2);
  int zero = 0;
  void* sp = s_in.get();
  void *so = s_out.get(), *go = g_out.get(), *mo = m_out.get();
  void* launch_args[] = {&args,  &B,      &H,  &zero, &q_len, &zero, &kv_len,
                         &q_len, &kv_len, &sp, &so,   &go,    &mo,   &grad_score};
  k.launch(static_cast<unsigned>((n + 255) / 256), 1, 1, 256, 0, nullptr, launch_args);
  synchronize_device();
  return {s_out.to_vector<float>(n), g_out.to_vector<float>(n), m_out.to_vector<uint8_t>(n)};
}

void check_on_gpu(const Variant& v, double tol) {
  constexpr int B = 2, H = 4, q_len = 37, kv_len = 53;
  constexpr int q0 = 0, nq = q_len, kv0 = 0, nkv = kv_len;
  const size_t n = static_cast<size_t>(B) * H * nq * nkv;
  const detail::VariantImpl& impl = flexc::detail::impl_of(v);
  const Kernel& k = get_kernel(v, mods_eval_spec({}));
  CHECK(&get_kernel(v, mods_eval_spec({})) == &k);

  FlexcArgs args{};
  std::vector<std::vector<uint8_t>> host;
  std::vector<size_t> counts;
  host.reserve(impl.decls.captures.size());
  std::vector<DeviceBuffer> data, grads;
  std::vector<dsl::HostTensor> tensors;
  for (size_t c = 0; c < impl.decls.captures.size(); ++c) {
    const dsl::CaptureDecl& d = impl.decls.captures[c];
    std::vector<int64_t> shape;
    size_t count = 1;
    for (const dsl::Dim& dim : d.dims) {
      shape.push_back(extent(dim, B, H, q_len, kv_len));
      count *= static_cast<size_t>(shape.back());
    }
    counts.push_back(count);
    host.push_back(random_elements(d.dtype, count));
    data.push_back(DeviceBuffer::from(std::span<const uint8_t>(host.back())));
    grads.emplace_back(count * sizeof(float));
    grads.back().fill(0);
    args.captures[c].data = data.back().get();
    args.captures[c].grad = static_cast<float*>(grads.back().get());
    long long stride = 1;
    for (size_t dim = 4; dim-- > 0;) {
      args.captures[c].shape[dim] = dim < shape.size() ? static_cast<int>(shape[dim]) : 1;
      args.captures[c].stride[dim] = dim < shape.size() ? stride : 0;
      if (dim < shape.size()) stride *= shape[dim];
    }
    tensors.push_back({d.dtype, host.back().data(), shape, {}});
  }
  std::vector<double> params(impl.decls.params.size());
  for (size_t p = 0; p < params.size() && p < FLEXC_MAX_PARAMS; ++p) {
    if (impl.decls.params[p].is_const) continue;
    if (impl.decls.params[p].type == dsl::Type::Float) {
      args.fparam[p] = std::uniform_real_distribution<float>(-3, 3)(rng());
      params[p] = args.fparam[p];
    } else {
      args.iparam[p] = std::uniform_int_distribution<int>(-4, 64)(rng());
      params[p] = args.iparam[p];
    }
  }

  std::vector<float> scores(n);
  for (size_t i = 0; i < n; ++i)
    scores[i] = i % 97 == 0 ? -INFINITY : std::uniform_real_distribution<float>(-8, 8)(rng());
  const float grad_score = 0.25f;
  const ModsEvalOut out = mods_eval(k, args, B, H, q_len, kv_len, scores, grad_score);
  const std::vector<float>&got_s = out.score, &got_g = out.grad;
  const std::vector<uint8_t>& got_m = out.mask;

  dsl::Graph dg = impl.score.graph;
  const dsl::NodeId droot = dsl::derivative_wrt_score(dg, dg.root);
  dsl::Graph cg = impl.score.graph;
  const std::vector<dsl::LoadDerivative> loads = dsl::derivatives_wrt_loads(cg, cg.root);
  // Per gradient element: the exact sum, the sum of |terms| and the number of terms (the kernel
  // sums in float32 with atomics, so its rounding error grows with both).
  std::vector<std::vector<double>> want_grad(tensors.size()), grad_mag(tensors.size()),
      grad_terms(tensors.size());
  for (size_t c = 0; c < tensors.size(); ++c) {
    want_grad[c].assign(counts[c], 0.0);
    grad_mag[c].assign(counts[c], 0.0);
    grad_terms[c].assign(counts[c], 0.0);
  }
  std::vector<dsl::Value> scratch;
  int bad = 0;
  for (size_t i = 0; i < n; ++i) {
    size_t r = i;
    const int kv = kv0 + static_cast<int>(r % nkv);
    r /= nkv;
    const int q = q0 + static_cast<int>(r % nq);
    r /= nq;
    const int h = static_cast<int>(r % H), b = static_cast<int>(r / H);
    dsl::EvalEnv env;
    env.ints = {0, b, h, q, kv, q_len, kv_len};
    env.score = scores[i];
    env.params = params;
    env.captures = tensors;
    const bool mask = dsl::evaluate(impl.mask.graph, env, dsl::Precision::F32, scratch).i != 0;
    const double s32 = dsl::evaluate(impl.score.graph, env, dsl::Precision::F32, scratch).f;
    const double s64 = dsl::evaluate(impl.score.graph, env, dsl::Precision::F64, scratch).f;
    const double g32 = dsl::evaluate(dg, droot, env, dsl::Precision::F32, scratch).f;
    // Against the float64 oracle only where rounding cannot be amplified (tol > 0: catalogue).
    const bool ok = got_m[i] == (mask ? 1 : 0) && close(got_s[i], s32, tol) &&
                    close(got_g[i], g32, tol) && (tol == 0 || close(got_s[i], s64, 10 * tol));
    if (!ok && ++bad <= 10)
      UNSCOPED_INFO("b=" << b << " h=" << h << " q=" << q << " kv=" << kv << " score=" << scores[i]
                         << ": mask " << int(got_m[i]) << " want " << mask << "; score_mod "
                         << got_s[i] << " want " << s32 << " (f64 " << s64 << "); grad " << got_g[i]
                         << " want " << g32);
    for (const dsl::LoadDerivative& ld : loads) {
      const dsl::Node& load = cg[ld.load];
      const dsl::HostTensor& t = tensors[load.slot];
      int64_t off = 0;
      for (int d = 0; d < load.nargs; ++d) {
        const int64_t idx = dsl::evaluate(cg, load.args[d], env, dsl::Precision::F64, scratch).i;
        off = off * t.shape[d] + ((idx % t.shape[d]) + t.shape[d]) % t.shape[d];
      }
      const double term =
          grad_score * dsl::evaluate(cg, ld.derivative, env, dsl::Precision::F32, scratch).f;
      want_grad[load.slot][static_cast<size_t>(off)] += term;
      grad_mag[load.slot][static_cast<size_t>(off)] += std::abs(term);
      grad_terms[load.slot][static_cast<size_t>(off)] += 1;
    }
  }
  CHECK(bad == 0);
  for (size_t c = 0; c < tensors.size(); ++c) {
    if (dsl::dtype_value_type(impl.decls.captures[c].dtype) != dsl::Type::Float) continue;
    const std::vector<float> got = grads[c].to_vector<float>(counts[c]);
    int wrong = 0;
    for (size_t e = 0; e < got.size(); ++e) {
      const double want = want_grad[c][e];
      const double grad_tol = (1e-5 + 0x1p-23 * grad_terms[c][e]) * grad_mag[c][e] + 1e-6;
      const bool ok = std::isfinite(want) ? std::abs(got[e] - want) <= grad_tol
                      : std::isnan(want)  ? std::isnan(got[e])
                                          : got[e] == want;
      if (!ok && ++wrong <= 5)
        UNSCOPED_INFO("capture " << impl.decls.captures[c].name << " element " << e << ": grad "
                                 << got[e] << " want " << want);
    }
    CHECK(wrong == 0);
  }
}

}  // namespace

TEST_CASE("mods_eval on the GPU matches the interpreter for the whole catalogue", "[gpu]") {
  if (!gpu_available()) {
    WARN("no GPU: skipped");
    return;
  }
  for (const std::string& name : Variant::catalogue_names()) {
    INFO(name);
    // Transcendental functions differ from the host's by a few ulp (docs/jit.md), and fast math
    // (the default) adds a few more.
    check_on_gpu(Variant::from_catalogue(name).with_precision(Precision::Exact), 1e-5);
    check_on_gpu(Variant::from_catalogue(name), 1e-5);
  }
}

TEST_CASE("mods_eval on the GPU matches the interpreter bit for bit on random mods", "[gpu]") {
  if (!gpu_available()) {
    WARN("no GPU: skipped");
    return;
  }
  detail::VariantImpl base;
  base.precision = Precision::Exact;  // bit for bit is the exact mode's promise
  base.decls = random_mod_decls();
  const dsl::Decls& decls = base.decls;
  // Every operation whose float32 result is exactly defined (CUDA's transcendental functions
  // are not the host's), so the device must agree bit for bit.
  dsl::testing::RandomExprOptions sopt;
  sopt.decls = &decls;
  sopt.inputs[0] = true;
  sopt.max_depth = 5;
  for (int op = 0; op <= static_cast<int>(dsl::Op::ToInt); ++op) {
    const auto o = static_cast<dsl::Op>(op);
    if (o != dsl::Op::Exp && o != dsl::Op::Exp2 && o != dsl::Op::Log && o != dsl::Op::Log2 &&
        o != dsl::Op::Tanh && o != dsl::Op::Sigmoid && o != dsl::Op::Sin && o != dsl::Op::Cos &&
        o != dsl::Op::Pow)
      sopt.ops.push_back(o);
  }
  dsl::testing::RandomExprOptions mopt = sopt;
  mopt.inputs[0] = false;
  // Fresh mods, then ones that found a bug: 11914357276792041441 made CUDA 13.0's ptxas drop the
  // sign of -kv_len inside max(max(q_idx, -kv_len), int(rsqrt(score))) (flexc_neg's comment).
  const uint64_t seed = rng()();
  std::vector<uint64_t> seeds;
  for (int i = 0; i < 20; ++i) seeds.push_back(seed + 2 * i);
  seeds.push_back(11914357276792041441ull);
  for (size_t i = 0; i < seeds.size(); ++i) {
    auto vi = std::make_shared<detail::VariantImpl>(base);
    vi->name = fmt::format("random{}", i);
    vi->score.graph.root = dsl::testing::RandomExpr(seeds[i], sopt).float_expr(vi->score.graph);
    vi->mask.kind = dsl::ModKind::Mask;
    vi->mask.graph.root = dsl::testing::RandomExpr(seeds[i] + 1, mopt).bool_expr(vi->mask.graph);
    vi->score.graph = dsl::simplify(vi->score.graph);
    vi->mask.graph = dsl::simplify(vi->mask.graph);
    INFO("score_mod " << dsl::to_text(vi->score.graph, vi->score.graph.root, decls) << "; mask_mod "
                      << dsl::to_text(vi->mask.graph, vi->mask.graph.root, decls));
    check_on_gpu(flexc::detail::VariantAccess::make(vi), 0);
  }
}

namespace {

// score_mod(score) of a variant reading only the score, evaluated on the GPU at each of `scores`.
std::vector<float> score_mod_on_gpu(const Variant& v, const std::vector<float>& scores) {
  FlexcArgs args{};
  return mods_eval(get_kernel(v, mods_eval_spec({})), args, 1, 1, 1,
                   static_cast<int>(scores.size()), scores, 0.f)
      .score;
}

}  // namespace

TEST_CASE("fast float math stays within the error docs/dsl.md states for each function", "[gpu]") {
  if (!gpu_available()) {
    WARN("no GPU: skipped");
    return;
  }
  // error = |got - want| / max(|want|, floor): relative, or absolute where |want| < floor.
  struct Fn {
    const char* mod;
    double (*want)(double);
    double lo, hi, floor, bound;
  };
  const Fn fns[] = {
      {"exp(score)", [](double x) { return std::exp(x); }, -80, 80, 0, 0x1p-21 + 80 * 0x1p-23},
      {"exp(score)", [](double x) { return std::exp(x); }, -10, 10, 0, 0x1p-21 + 10 * 0x1p-23},
      {"exp2(score)", [](double x) { return std::exp2(x); }, -120, 120, 0, 0x1p-21},
      {"log(score)", [](double x) { return std::log(x); }, 1e-30, 1e30, 1, 0x1p-21},
      {"log2(score)", [](double x) { return std::log2(x); }, 1e-30, 1e30, 1, 0x1p-21},
      {"sqrt(score)", [](double x) { return std::sqrt(x); }, 1e-30, 1e30, 0, 0x1p-21},
      {"rsqrt(score)", [](double x) { return 1 / std::sqrt(x); }, 1e-30, 1e30, 0, 0x1p-21},
      {"tanh(score)", [](double x) { return std::tanh(x); }, -20, 20, 0, 0x1p-21},
      {"tanh(score)", [](double x) { return std::tanh(x); }, 1e-30, 1, 0, 0x1p-21},
      // (score / 30 as a multiply by 1 / 30: relative near 0 still.)
      {"30.0 * tanh(score / 30.0)", [](double x) { return 30 * std::tanh(x / 30); }, -200, 200, 0,
       0x1p-21},
      {"sigmoid(score)", [](double x) { return 1 / (1 + std::exp(-x)); }, -80, 80, 0,
       0x1p-20 + 80 * 0x1p-23},
      {"sin(score)", [](double x) { return std::sin(x); }, -3.14159, 3.14159, 1, 0x1p-20},
      {"cos(score)", [](double x) { return std::cos(x); }, -3.14159, 3.14159, 1, 0x1p-20},
      {"sin(score)", [](double x) { return std::sin(x); }, -1e4, 1e4, 1, 0x1p-19},
      {"cos(score)", [](double x) { return std::cos(x); }, -1e4, 1e4, 1, 0x1p-19},
      {"1.0 / score", [](double x) { return 1 / x; }, 1e-30, 1e30, 0, 0x1p-21},
      {"score / 7.0", [](double x) { return x / 7.0f; }, -1e30, 1e30, 1e-30, 0x1p-21},
  };
  for (const Fn& f : fns) {
    const Variant v = Variant::from_strings(f.mod, "true", {}, {}, "fast_fn");
    REQUIRE(v.precision() == Precision::Fast);
    // Log-spaced over a positive range, uniform over one that holds 0; plus random points.
    std::vector<float> x;
    for (int i = 0; i < 1 << 16; ++i) {
      const double t = (i + 0.5) / (1 << 16);
      x.push_back(static_cast<float>(f.lo > 0 ? f.lo * std::pow(f.hi / f.lo, t)
                                              : f.lo + (f.hi - f.lo) * t));
    }
    for (int i = 0; i < 1 << 14; ++i)
      x.push_back(std::uniform_real_distribution<float>(float(f.lo), float(f.hi))(rng()));
    const std::vector<float> got = score_mod_on_gpu(v, x);
    double worst = 0, at = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      const double want = f.want(x[i]);
      if (!std::isfinite(want) || std::abs(want) < 0x1p-126 || std::abs(want) > 0x1p127) continue;
      const double e = std::abs(got[i] - want) / std::max(std::abs(want), f.floor);
      if (!(e <= worst)) worst = e, at = x[i];
    }
    // Printed for docs/dsl.md's table.
    WARN(fmt::format("{} on [{:g}, {:g}]: max error {:.3g} = 2^{:.1f} at {:g} (bound 2^{:.1f})",
                     f.mod, f.lo, f.hi, worst, std::log2(worst), at, std::log2(f.bound)));
    CHECK(worst <= f.bound);
  }
  // tanh's fast form (whatever flexc_fast_tanh is): never past +-1 (1 - tanh^2 stays >= 0), NaN
  // stays NaN, +-inf and huge values saturate, -0 stays -0.
  const Variant tanh = Variant::from_strings("tanh(score)", "true", {}, {}, "fast_tanh");
  std::vector<float> x = {std::numeric_limits<float>::quiet_NaN(),
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(), 1e30f, -1e30f, -0.0f};
  for (int i = 0; i < 1 << 16; ++i) x.push_back(5.0f + 10.0f * i / (1 << 16));
  const std::vector<float> got = score_mod_on_gpu(tanh, x);
  CHECK(std::isnan(got[0]));
  CHECK(got[1] == 1.0f);
  CHECK(got[2] == -1.0f);
  CHECK(got[3] == 1.0f);
  CHECK(got[4] == -1.0f);
  CHECK((got[5] == 0.0f && std::signbit(got[5])));
  float most = 0;
  for (float t : got)
    if (!std::isnan(t)) most = std::max(most, std::abs(t));
  CHECK(most <= 1.0f);
}

TEST_CASE("fast tanh is tanhf's bits in either form a warp takes", "[gpu]") {
  if (!gpu_available()) {
    WARN("no GPU: skipped");
    return;
  }
  // mods_eval gives tanh the form the attention kernels give a tile (flexc_hooks.cuh, "Tanh
  // forms"), per warp of 32 points: tanhf's polynomial alone where every |x| < 0.6, tanhf
  // otherwise. Exact precision writes tanhf itself, so the two agree bit for bit, whichever form
  // a warp took: warps all below 0.6, below but for one lane, beyond, and with NaN, -0 and the
  // last floats below 0.6 (the polynomial's) and at it (the exponential form's).
  const Variant fast = Variant::from_strings("tanh(score)", "true", {}, {}, "tanh_forms");
  const Variant exact = fast.with_precision(Precision::Exact);
  REQUIRE(fast.precision() == Precision::Fast);
  const float below = std::nextafter(0.6f, 0.0f);
  const float special[] = {
      std::numeric_limits<float>::quiet_NaN(), -0.0f, below, -below, 0.6f, -0.6f};
  std::vector<float> x;
  for (int w = 0; w < 4096; ++w)
    for (int l = 0; l < 32; ++l) {
      float v = std::uniform_real_distribution<float>(-below, below)(rng());
      if (w % 4 == 1 && l == w / 4 % 32) v = (w & 8 ? 1.0f : -1.0f) * (0.6f + (w % 64) / 16.0f);
      if (w % 4 == 2) v = std::uniform_real_distribution<float>(-20.0f, 20.0f)(rng());
      if (w % 4 == 3 && l < 4) v = special[l];
      if (w % 4 == 3 && l == 4 && w % 8 == 7) v = special[4 + (w / 8) % 2];
      x.push_back(v);
    }
  const std::vector<float> got = score_mod_on_gpu(fast, x), want = score_mod_on_gpu(exact, x);
  int differ = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const bool same = std::isnan(want[i])
                          ? std::isnan(got[i])
                          : std::bit_cast<unsigned>(got[i]) == std::bit_cast<unsigned>(want[i]);
    if (!same && differ++ < 8)
      WARN(fmt::format("tanh({:a}): fast {:a}, tanhf {:a} (warp {})", x[i], got[i], want[i],
                       i / 32));
  }
  CHECK(differ == 0);
}

TEST_CASE("load_kernels compiles and loads ahead of the first call", "[gpu]") {
  if (!gpu_available()) {
    WARN("no GPU: skipped");
    return;
  }
  FreshCache cache;
  const Variant v = fresh_variant();
  const flexc::KernelBuild build{"attention_fwd", "", "bf16", 64};
  const CacheCounters before = cache_counters();
  flexc::load_kernels(v, std::span(&build, 1));
  CHECK(cache_counters().compiles == before.compiles + 1);
  // Loaded: asking again neither compiles nor reads the disk.
  flexc::load_kernels(v, std::span(&build, 1));
  CHECK(cache_counters().compiles == before.compiles + 1);
  CHECK(cache_counters().disk_hits == before.disk_hits);
  CHECK(flexc::compile_kernels(v, std::span(&build, 1))[0].origin ==
        flexc::CompiledKernel::Origin::MemoryCache);
}

TEST_CASE("DeviceBuffer, Stream and EventTimer work on the device", "[gpu]") {
  if (!gpu_available()) {
    WARN("no GPU: skipped");
    return;
  }
  std::vector<int> v(1000);
  for (int& x : v) x = static_cast<int>(rng()());
  DeviceBuffer b = DeviceBuffer::from(std::span<const int>(v));
  CHECK(b.to_vector<int>(v.size()) == v);
  Stream s;
  EventTimer t;
  t.start(s.get());
  b.fill(0, s.get());
  t.stop(s.get());
  s.synchronize();
  CHECK(t.elapsed_ms() >= 0);
  CHECK(b.to_vector<int>(v.size()) == std::vector<int>(v.size(), 0));
  CHECK_THROWS_WITH(b.upload(v.data(), 8000), Catch::Contains("out of range"));
}
