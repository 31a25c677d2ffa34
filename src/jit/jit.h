// The one path from (variant, kernel template, compile-time config) to a launchable kernel:
// splice -> cache lookup (memory, then disk) -> NVRTC on a miss -> Driver API module load.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "flexc/variant.h"

struct CUfunc_st;
struct CUstream_st;

namespace flexc::jit {

// Which template and how it is configured. Everything here is part of the cache key.
struct KernelSpec {
  std::string template_name;  // file in templates/, e.g. "attention_fwd.cuh"
  std::string entry;          // the extern "C" __global__ function it defines
  std::vector<std::pair<std::string, std::string>> defines;  // -DNAME=VALUE, in this order
  std::string arch;           // "sm_90"; empty: the current device's
};

struct CompileOptions {
  bool use_cache = true;  // memory + disk cache (the disk part can also be disabled by env)
};

// What NVRTC produced (or the cache held), with the spliced source for inspection.
struct Compiled {
  std::string key;      // hex SHA-256 cache key
  std::string source;   // the spliced translation unit (variant header + template)
  std::string cubin;
  std::string ptx;      // only when asked for (flexc compile --emit ptx)
  bool from_cache = false;
  double compile_seconds = 0;
};

// Compiles without a GPU (needs an explicit arch). Throws flexc::Error with diagnostics mapped
// back to the user's expression or to the template file and line.
Compiled compile(const Variant& v, const KernelSpec& spec, const CompileOptions& opts = {},
                 bool want_ptx = false);

// A loaded kernel in the primary context of the current device.
class Kernel {
 public:
  // Launches on `stream` (the caller's; nullptr = legacy default). `args` point at each kernel
  // argument, as cuLaunchKernel takes them. Raises the dynamic shared memory limit on first use
  // when `smem_bytes` needs it. Errors name the variant and the kernel.
  void launch(unsigned grid_x, unsigned grid_y, unsigned grid_z, unsigned block, size_t smem_bytes,
              CUstream_st* stream, void** args) const;
  CUfunc_st* function() const { return fn_; }
  const std::string& what() const { return what_; }  // "flexc attention_fwd kernel for 'alibi' (sm_90)"

  CUfunc_st* fn_ = nullptr;
  std::string what_;
  mutable size_t smem_limit_ = 48 * 1024;
};

// Compiles (or finds in the cache) and loads for the current device. Thread-safe; the returned
// reference lives as long as the process.
const Kernel& get_kernel(const Variant& v, const KernelSpec& spec);

// True when a CUDA driver and at least one device are present (libcuda is dlopen'ed).
bool gpu_available();

}  // namespace flexc::jit
