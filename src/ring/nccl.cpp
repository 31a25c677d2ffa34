#include "nccl.h"

#include <dlfcn.h>
#include <fmt/format.h>

#include <cstdlib>
#include <mutex>
#include <optional>
#include <vector>

#include "flexc/error.h"

namespace flexc::nccl {

namespace {

constexpr const char* kSoname = "libnccl.so.2";

// Resolves every function of `lib`; the first missing name, or empty.
std::string resolve(void* lib, Api& a) {
#define FLEXC_NCCL_RESOLVE(name, ...)                          \
  a.name = reinterpret_cast<decltype(a.name)>(dlsym(lib, #name)); \
  if (!a.name) return #name;
  FLEXC_NCCL_FUNCTIONS(FLEXC_NCCL_RESOLVE)
#undef FLEXC_NCCL_RESOLVE
  return {};
}

struct Loaded {
  std::optional<Api> api;
  std::string error;
};

Loaded load() {
  std::vector<std::pair<std::string, int>> candidates;
  // The instance the process already has (its communicators are that instance's).
  candidates.push_back({kSoname, RTLD_NOW | RTLD_NOLOAD});
  if (const char* p = std::getenv("FLEXC_NCCL"); p && *p) candidates.push_back({p, RTLD_NOW});
  candidates.push_back({kSoname, RTLD_NOW});
  for (const char* var : {"CUDA_HOME", "CUDA_PATH"})
    if (const char* v = std::getenv(var); v && *v)
      for (const char* lib : {"/lib64/", "/lib/"})
        candidates.push_back({std::string(v) + lib + kSoname, RTLD_NOW});
  for (const char* lib : {"/usr/local/cuda/lib64/", "/usr/local/cuda/lib/"})
    candidates.push_back({std::string(lib) + kSoname, RTLD_NOW});

  Loaded r;
  std::string tried;
  for (const auto& [name, flags] : candidates) {
    void* lib = dlopen(name.c_str(), flags | RTLD_LOCAL);
    if (!lib) {
      const char* e = dlerror();
      tried += (flags & RTLD_NOLOAD) ? fmt::format("\n  {} (already loaded): no", name)
                                     : fmt::format("\n  {}: {}", name, e ? e : "not loaded");
      continue;
    }
    Api a;
    if (std::string missing = resolve(lib, a); !missing.empty()) {
      tried += fmt::format("\n  {}: lacks {}", name, missing);
      dlclose(lib);
      continue;
    }
    Dl_info info{};
    a.path = dladdr(reinterpret_cast<void*>(a.ncclGetVersion), &info) && info.dli_fname
                 ? info.dli_fname
                 : name;
    a.ncclGetVersion(&a.version);
    r.api = a;
    return r;
  }
  r.error = fmt::format(
      "NCCL ({}, which ring attention communicates with) was not found. Tried:{}\nInstall NCCL "
      "(the CUDA toolkit's, or `pip install nvidia-nccl-cu13`), or set FLEXC_NCCL to the "
      "library's path",
      kSoname, tried);
  return r;
}

}  // namespace

const Api& api(std::string_view what) {
  static std::mutex mu;
  static Loaded loaded;
  static bool tried = false;
  std::lock_guard lock(mu);
  if (!tried) loaded = load(), tried = true;
  if (!loaded.api) throw Error(fmt::format("{}: {}", what, loaded.error));
  return *loaded.api;
}

void check(const Api& a, Result r, std::string_view what, std::string_view call) {
  if (r != 0) throw Error(fmt::format("{}: {} failed: {}", what, call, a.ncclGetErrorString(r)));
}

}  // namespace flexc::nccl
