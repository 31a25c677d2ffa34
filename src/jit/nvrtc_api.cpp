#include "nvrtc_api.h"

#include <dlfcn.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <mutex>

#include "flexc/error.h"
#include "flexc/jit.h"

namespace flexc::jit {

namespace {

#define FLEXC_STR2(x) #x
#define FLEXC_STR(x) FLEXC_STR2(x)

// flexc is built against CUDA 13's headers; these functions kept their ABI since CUDA 11.
constexpr const char* kNames[] = {"libnvrtc.so.13", "libnvrtc.so.12"};

std::mutex& dirs_mutex() {
  static std::mutex m;
  return m;
}
std::vector<std::string>& extra_dirs() {
  static std::vector<std::string> dirs;
  return dirs;
}

}  // namespace

std::vector<std::string> nvrtc_candidates() {
  if (const char* p = std::getenv("FLEXC_NVRTC"); p && *p) return {p};
  std::vector<std::string> dirs;
  for (const char* var : {"CUDA_HOME", "CUDA_PATH"})
    if (const char* v = std::getenv(var); v && *v) dirs.push_back(std::string(v) + "/lib64");
  dirs.push_back("/usr/local/cuda/lib64");
  {
    std::lock_guard lock(dirs_mutex());
    dirs.insert(dirs.end(), extra_dirs().begin(), extra_dirs().end());
  }
  std::vector<std::string> out;
  for (size_t i = 0; i < dirs.size(); ++i) {
    if (std::find(dirs.begin(), dirs.begin() + i, dirs[i]) != dirs.begin() + i) continue;
    for (const char* n : kNames) out.push_back(dirs[i] + "/" + n);
  }
  for (const char* n : kNames) out.push_back(n);
  return out;
}

NvrtcLoad load_nvrtc(const std::vector<std::string>& candidates) {
  NvrtcLoad r;
  std::string tried;
  for (const std::string& c : candidates) {
    // A path that is not there is skipped quietly: only a library that fails to load says why.
    if (c.find('/') != std::string::npos) {
      std::error_code ec;
      if (!std::filesystem::exists(c, ec)) {
        tried += fmt::format("\n  {}: not found", c);
        continue;
      }
    }
    void* lib = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      const char* e = dlerror();
      tried += fmt::format("\n  {}: {}", c, e ? e : "could not be loaded");
      continue;
    }
    NvrtcApi api;
    std::string missing;
#define FLEXC_RESOLVE(name)                                                     \
  api.name = reinterpret_cast<decltype(api.name)>(dlsym(lib, FLEXC_STR(name))); \
  if (!api.name && missing.empty()) missing = FLEXC_STR(name);
    FLEXC_NVRTC_FUNCTIONS(FLEXC_RESOLVE)
#undef FLEXC_RESOLVE
    if (!missing.empty()) {
      tried += fmt::format("\n  {}: lacks {}", c, missing);
      dlclose(lib);
      continue;
    }
    Dl_info info{};
    std::string path = c;
    if (dladdr(reinterpret_cast<void*>(api.nvrtcVersion), &info) && info.dli_fname) {
      std::error_code ec;
      const auto p = std::filesystem::canonical(info.dli_fname, ec);
      path = ec ? info.dli_fname : p.string();
    }
    api.path = path;
    r.api = api;
    return r;
  }
  r.error = fmt::format(
      "NVRTC (the CUDA runtime compiler, libnvrtc.so.13) was not found. Tried:{}\nInstall the "
      "CUDA toolkit, or `pip install nvidia-cuda-nvrtc` (13.x) and use flexc from Python, or "
      "set FLEXC_NVRTC to the library's path",
      tried);
  return r;
}

const NvrtcApi& nvrtc(std::string_view doing) {
  static const NvrtcLoad loaded = load_nvrtc(nvrtc_candidates());
  if (!loaded.error.empty()) throw Error(fmt::format("{}: {}", doing, loaded.error));
  return loaded.api;
}

}  // namespace flexc::jit

namespace flexc {

void add_nvrtc_search_dir(const std::string& dir) {
  std::lock_guard lock(jit::dirs_mutex());
  jit::extra_dirs().push_back(dir);
}

}  // namespace flexc
