// NVRTC, loaded at run time with dlopen so that flexc needs no CUDA toolkit where it runs: the
// toolkit's NVRTC when there is one, else one beside it (NVIDIA's nvidia-cuda-nvrtc wheel, which
// the Python package points to), else the loader's search path. docs/jit.md has the order.
#pragma once

#include <nvrtc.h>

#include <string>
#include <string_view>
#include <vector>

namespace flexc::jit {

// clang-format off
#define FLEXC_NVRTC_FUNCTIONS(X)                                                                \
  X(nvrtcVersion) X(nvrtcGetNumSupportedArchs) X(nvrtcGetSupportedArchs) X(nvrtcGetErrorString) \
  X(nvrtcCreateProgram) X(nvrtcCompileProgram) X(nvrtcDestroyProgram) X(nvrtcGetProgramLogSize) \
  X(nvrtcGetProgramLog) X(nvrtcGetPTXSize) X(nvrtcGetPTX) X(nvrtcGetCUBINSize) X(nvrtcGetCUBIN)
// clang-format on

struct NvrtcApi {
#define FLEXC_NVRTC_MEMBER(name) decltype(&::name) name = nullptr;
  FLEXC_NVRTC_FUNCTIONS(FLEXC_NVRTC_MEMBER)
#undef FLEXC_NVRTC_MEMBER
  std::string path;  // the library loaded, as found (canonical)
};

// The libraries tried, in order: $FLEXC_NVRTC alone when set; else libnvrtc.so.13 / .so.12 in
// $CUDA_HOME/lib64, $CUDA_PATH/lib64 and /usr/local/cuda/lib64, then in the directories
// add_nvrtc_search_dir() gave, then by bare name (LD_LIBRARY_PATH, the loader's cache).
std::vector<std::string> nvrtc_candidates();

// The first candidate that loads and has every function; otherwise `error` lists each tried.
struct NvrtcLoad {
  NvrtcApi api;
  std::string error;
};
NvrtcLoad load_nvrtc(const std::vector<std::string>& candidates);

// nvrtc_candidates() loaded once per process. Throws flexc::Error("<doing>: ...") when none
// loads, naming what was tried and how to point flexc at an NVRTC.
const NvrtcApi& nvrtc(std::string_view doing);

}  // namespace flexc::jit
