// include/flexc/jit.h over the JIT's own interfaces (jit.h, kernels.h, cache.h).
#include <fmt/format.h>

#include "flexc/error.h"
#include "flexc/jit.h"
#include "jit/cache.h"
#include "jit/jit.h"
#include "jit/kernels.h"

namespace flexc {

namespace {

KernelInfo info_of(const jit::KnownKernel& k) {
  return {std::string(k.name), std::string(k.description), std::string(k.only_arch)};
}

std::chrono::system_clock::time_point to_system(std::filesystem::file_time_type t) {
  return std::chrono::time_point_cast<std::chrono::system_clock::duration>(
      t - std::filesystem::file_time_type::clock::now() + std::chrono::system_clock::now());
}

std::vector<jit::KernelSpec> specs_of(std::span<const KernelBuild> builds) {
  std::vector<jit::KernelSpec> specs;
  for (const KernelBuild& b : builds) {
    if (b.wide_kv && b.kernel != "attention_fwd_sm90")
      throw Error(fmt::format("kernel '{}': wide_kv is attention_fwd_sm90's alone", b.kernel));
    jit::KernelConfig cfg{b.arch, b.dtype, b.head_dim, b.v_head_dim};
    cfg.positions = b.positions;
    cfg.f32_out = b.f32_out, cfg.accumulate = b.accumulate;
    cfg.wide_kv = b.wide_kv, cfg.varlen = b.varlen;
    specs.push_back(jit::find_kernel(b.kernel).spec(cfg));
  }
  return specs;
}

}  // namespace

std::vector<KernelInfo> kernel_templates(std::string_view arch) {
  std::vector<KernelInfo> out;
  if (arch.empty())
    for (const jit::KnownKernel& k : jit::known_kernels()) out.push_back(info_of(k));
  else
    for (const jit::KnownKernel* k : jit::kernels_for_arch(arch)) out.push_back(info_of(*k));
  return out;
}

namespace jit {
CompiledKernel to_compiled_kernel(Compiled c, std::string arch) {
  CompiledKernel k;
  k.arch = std::move(arch);
  k.key = std::move(c.key);
  k.source = std::move(c.source);
  k.ptx = std::move(c.ptx);
  k.cubin = std::move(c.cubin);
  k.origin = c.from_disk    ? CompiledKernel::Origin::DiskCache
             : c.from_cache ? CompiledKernel::Origin::MemoryCache
                            : CompiledKernel::Origin::Compiled;
  k.compile_seconds = c.compile_seconds;
  return k;
}
}  // namespace jit

std::vector<CompiledKernel> compile_kernels(const Variant& v, std::span<const KernelBuild> builds,
                                            bool use_cache) {
  const std::vector<jit::KernelSpec> specs = specs_of(builds);
  std::vector<CompiledKernel> out;
  std::vector<jit::Compiled> compiled = jit::compile_all(v, specs, {.use_cache = use_cache});
  for (size_t i = 0; i < compiled.size(); ++i)
    out.push_back(jit::to_compiled_kernel(std::move(compiled[i]), specs[i].arch));
  return out;
}

void load_kernels(const Variant& v, std::span<const KernelBuild> builds) {
  jit::get_kernels(v, specs_of(builds));
}

void clear_kernel_memory_cache() { jit::reset_cache(); }

KernelCacheInfo kernel_cache_info() {
  const jit::DiskCache cache(jit::CacheSettings::from_env());
  const jit::DiskCache::Leftovers l = cache.leftovers();
  KernelCacheInfo info;
  info.dir = cache.settings().dir.string();
  info.enabled = cache.enabled();
  info.max_bytes = cache.settings().max_bytes;
  info.bytes = cache.total_bytes();
  info.entries = cache.list().size();
  info.temp_files = l.temp_files;
  info.temp_bytes = l.temp_bytes;
  info.lock_files = l.lock_files;
  info.stale_seconds = jit::DiskCache::kStaleSeconds;
  return info;
}

std::vector<KernelCacheEntry> kernel_cache_entries() {
  std::vector<KernelCacheEntry> out;
  for (const jit::DiskCache::Item& it : jit::DiskCache(jit::CacheSettings::from_env()).list())
    out.push_back({it.key, it.bytes, to_system(it.last_used), it.description});
  return out;
}

size_t clear_kernel_cache() { return jit::DiskCache(jit::CacheSettings::from_env()).clear(); }

}  // namespace flexc
