// The one path from (variant, kernel template, compile-time config) to a launchable kernel:
// emit flexc_variant.cuh -> splice -> cache lookup (memory, then disk) -> NVRTC on a miss ->
// Driver API module load. Settings come from the environment (docs/jit.md): FLEXC_CACHE_DIR,
// FLEXC_DISABLE_DISK_CACHE, FLEXC_CACHE_MAX_BYTES, FLEXC_CACHE_LOCK_TIMEOUT, FLEXC_TEMPLATE_DIR,
// CUDA_HOME, FLEXC_LINEINFO.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dsl/emit_cuda.h"
#include "flexc/jit.h"
#include "flexc/variant.h"

struct CUfunc_st;
struct CUstream_st;

namespace flexc::jit {

// Which template and how it is configured. Everything here but `entry` is part of the cache key.
struct KernelSpec {
  std::string template_name;  // file in templates/, e.g. "attention_fwd.cuh"
  std::string entry;          // the extern "C" __global__ function it defines
  std::vector<std::pair<std::string, std::string>> defines;  // -DNAME=VALUE, in this order
  std::string arch;  // "sm_90", "sm_90a", "compute_90"; empty: the current device's
};

struct CompileOptions {
  bool use_cache = true;  // memory + disk cache (the disk part can also be disabled by env)
};

// What NVRTC produced (or the cache held), with the spliced source for inspection.
struct Compiled {
  std::string key;     // hex SHA-256 cache key
  std::string source;  // the spliced translation unit as one self-contained .cu
  std::string cubin;   // empty for a compute_XX arch
  std::string ptx;
  bool from_cache = false;  // found in memory or on disk
  bool from_disk = false;
  double compile_seconds = 0;  // NVRTC's time; 0 for a hit
};

// The public form of a compile (flexc/jit.h), `arch` as asked.
CompiledKernel to_compiled_kernel(Compiled c, std::string arch);

// Compiles without a GPU (needs an explicit arch). Throws flexc::Error with diagnostics mapped
// back to the user's expression or to the template file and line.
Compiled compile(const Variant& v, const KernelSpec& spec, const CompileOptions& opts = {});

// Several kernels of one variant (fwd + bwd + decode), compiled in parallel on flexc's compile
// threads; results in the order of `specs`. The same key is never compiled twice at once.
std::vector<Compiled> compile_all(const Variant& v, std::span<const KernelSpec> specs,
                                  const CompileOptions& opts = {});

// A loaded kernel in the context that was current when it was loaded.
class Kernel {
 public:
  Kernel(CUfunc_st* fn, std::string what, dsl::LaunchFacts facts)
      : fn_(fn), what_(std::move(what)), facts_(facts) {}

  // Launches on `stream` (the caller's; nullptr = legacy default). `args` point at each kernel
  // argument, as cuLaunchKernel takes them. Raises the dynamic shared memory limit on first use
  // when `smem_bytes` needs it (reserve_smem). Errors name the variant and the kernel.
  // `early`: a programmatic dependent launch (sm_90+; ignored before): the kernel may start while
  // the previous kernel in the stream runs, once all of that kernel's CTAs have executed
  // griddepcontrol.launch_dependents or exited, and must run griddepcontrol.wait before reading
  // what that kernel writes. Hides the launch of a short follow-up kernel (a combine).
  void launch(unsigned grid_x, unsigned grid_y, unsigned grid_z, unsigned block, size_t smem_bytes,
              CUstream_st* stream, void** args, bool early = false) const;
  // Raises the kernel's dynamic shared memory limit to `smem_bytes` where it is lower, as a
  // launch would: the prepare_* calls do it ahead, so that a launch inside a CUDA graph's capture
  // sets no attribute.
  void reserve_smem(size_t smem_bytes) const;
  CUfunc_st* function() const { return fn_; }
  // "flexc attention_fwd kernel for variant 'alibi' (sm_90)"
  const std::string& what() const { return what_; }
  // What the launch must agree on with the kernel's generated header.
  const dsl::LaunchFacts& facts() const { return facts_; }
  // Local memory per thread (ptxas's stack frame: spilled registers, mostly), in bytes.
  int local_bytes() const;

 private:
  CUfunc_st* fn_;
  std::string what_;
  dsl::LaunchFacts facts_;
  mutable std::atomic<size_t> smem_limit_{48 * 1024};
  mutable std::atomic<int> local_bytes_{-1};  // -1: not asked yet
  mutable std::mutex smem_mu_;
};

// Compiles (or finds in the cache) and loads for the current context's device. Thread-safe; the
// returned reference lives as long as the process. A repeated call costs a hash-map lookup.
const Kernel& get_kernel(const Variant& v, const KernelSpec& spec);
// Several at once: compiled in parallel, then loaded.
std::vector<const Kernel*> get_kernels(const Variant& v, std::span<const KernelSpec> specs);

// This process's cache activity. A wait for another thread's compile of the same key counts as
// a memory hit.
struct CacheCounters {
  uint64_t memory_hits = 0, disk_hits = 0, compiles = 0;
};
CacheCounters cache_counters();

// Re-reads the cache settings from the environment and empties the in-memory cache (tests,
// tools). Kernels already loaded stay valid.
void reset_cache();

}  // namespace flexc::jit
