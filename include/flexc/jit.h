// flexc's JIT from the outside: the kernel templates it builds, compiling a variant's kernels
// ahead of time (NVRTC runs on the CPU: no GPU needed when the architecture is named), and the
// disk cache of compiled kernels (docs/jit.md: where it lives and the variables that set it).
// flexc::attention and the others compile what they need on first use; this is for tools,
// deployment (fill the cache before serving) and inspection (the generated CUDA, PTX, cubin).
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace flexc {

class Variant;

// A kernel template flexc builds.
struct KernelInfo {
  std::string name;         // "attention_fwd", "attention_bwd_sm90", ...
  std::string description;
  std::string only_arch;    // "sm_90a": built for that arch alone; empty: any sm_80 or newer
};

// Every kernel template; with `arch`, those that build for it (Hopper kernels for sm_90 /
// sm_90a only).
std::vector<KernelInfo> kernel_templates(std::string_view arch = {});

// One kernel of a variant to build.
struct KernelBuild {
  std::string kernel;          // a KernelInfo::name; an unknown name throws, listing the known
  std::string arch;            // "sm_90a", "sm_80", "compute_90", ...; empty: the current GPU's
  std::string dtype = "bf16";  // the attention kernels' input type: "bf16" or "fp16"
  int head_dim = 128;          // q's and k's
  int v_head_dim = 0;          // v's and the output's (forward kernels only); 0: head_dim
  // The attention kernels' build for a block of a longer sequence (keys at an offset, the
  // sequence's lengths given: ring attention), which such calls run (docs/attention.md).
  bool positions = false;
  // The attention kernels' build with float32 outputs (the forward's out, the backward's dq, dk,
  // dv), which calls given float32 outputs run; with `accumulate` the backward's adding them
  // (BackwardOptions::accumulate). Ring attention runs both, with `positions`.
  bool f32_out = false, accumulate = false;
  // attention_fwd_sm90's build with FlashAttention-3's wide kv tiles (176, 112 or 80 keys at
  // equal head dims 128, 192, 256), which flexc::attention runs where the variant's hooks load
  // nothing per tile (docs/attention.md). Another kernel, or other head dims, throw.
  bool wide_kv = false;
  // The forward attention kernels' build for packed sequences (AttentionOptions::packed), which
  // such calls run (docs/attention.md). The backward kernels throw; the others ignore it.
  bool varlen = false;
};

struct CompiledKernel {
  std::string arch;    // what it was built for ("sm_90a" for a Hopper kernel asked as sm_90);
                       // empty: the current GPU's
  std::string key;     // the cache key (hex SHA-256)
  std::string source;  // the spliced translation unit, one self-contained .cu
  std::string ptx;
  std::string cubin;   // empty for a virtual (compute_XX) arch
  enum class Origin { Compiled, MemoryCache, DiskCache } origin = Origin::Compiled;
  double compile_seconds = 0;  // NVRTC's time; 0 when cached
};

// Compiles `builds` of variant `v` in parallel (or takes them from the caches unless
// `use_cache` is false), results in the order of `builds`. Throws flexc::Error with the
// diagnostics mapped back to the variant's expressions or to the template's file and line.
std::vector<CompiledKernel> compile_kernels(const Variant& v, std::span<const KernelBuild> builds,
                                            bool use_cache = true);

// The disk cache of compiled kernels, as the environment sets it up.
struct KernelCacheEntry {
  std::string key;
  uint64_t bytes = 0;
  std::chrono::system_clock::time_point last_used;
  std::string description;  // "alibi: attention_fwd.cuh sm_90"; empty: not a valid entry
};
struct KernelCacheInfo {
  std::string dir;
  bool enabled = true;      // false: FLEXC_DISABLE_DISK_CACHE, or the directory is unusable
  uint64_t max_bytes = 0;   // the size limit (least recently used entries go first)
  uint64_t bytes = 0;       // of the entries
  size_t entries = 0;
  size_t temp_files = 0;    // writes in progress, or of killed processes
  uint64_t temp_bytes = 0;
  size_t lock_files = 0;
  int stale_seconds = 0;    // temporary and unused lock files are removed at this age
};
// Compiles (or takes from the caches) and loads `builds` of `v` into the current CUDA context, as
// their first call would: a server pays NVRTC and the module loads before its first request.
// Needs a GPU; architectures must be empty (the current GPU's) or its own.
void load_kernels(const Variant& v, std::span<const KernelBuild> builds);

// Empties this process's in-memory copies of compiled kernels (loaded kernels stay loaded and
// valid) and re-reads the cache's environment: the next compile of a kernel reads the disk cache.
void clear_kernel_memory_cache();

KernelCacheInfo kernel_cache_info();
std::vector<KernelCacheEntry> kernel_cache_entries();  // most recently used first
// Removes every entry, lock and temporary file; returns the number of entries.
size_t clear_kernel_cache();

// NVRTC is loaded on first use: $FLEXC_NVRTC (a path) when set, else from the CUDA toolkit
// ($CUDA_HOME, $CUDA_PATH, /usr/local/cuda), else from the directories added here, else by the
// loader's search path (docs/jit.md). The Python package adds the nvidia-cuda-nvrtc wheel's.
// Takes effect only before the first compile.
void add_nvrtc_search_dir(const std::string& dir);

}  // namespace flexc
