#include "jit.h"

#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <stdexcept>
#include <thread>
#include <unordered_map>

#include "cache.h"
#include "compiler.h"
#include "driver_api.h"
#include "dsl/emit_cuda.h"
#include "flexc/device.h"
#include "flexc/error.h"
#include "splice.h"
#include "variant_impl.h"

namespace flexc::jit {

namespace {

// Bound on the per-Variant-object memos (prepared units, get_kernel's lookup): a program that
// makes a new Variant per call must not grow them without end; past it they start over.
constexpr size_t kMaxMemo = 1024;

// A (variant, spec) made ready to compile: everything the cache key covers.
struct Prepared {
  Variant variant;  // keeps the impl alive: its address is part of the memo key
  KernelSpec spec;  // arch resolved
  std::string header;
  Unit unit;
  std::vector<std::string> options;
  std::string key, description, what;
};

enum class Via { Memory, Disk, Nvrtc };

struct Obtained {
  std::shared_ptr<const CacheEntry> entry;
  Via via = Via::Memory;
  double seconds = 0;
};

std::string spec_id(const void* impl, const KernelSpec& s) {
  std::string id = fmt::format("{}|{}|{}|{}", impl, s.template_name, s.entry, s.arch);
  for (const auto& [k, v] : s.defines) id += fmt::format("|{}={}", k, v);
  return id;
}

// A few threads for compiles that may run in parallel.
class Pool {
 public:
  Pool() {
    const unsigned n = std::clamp(std::thread::hardware_concurrency(), 2u, 4u);
    for (unsigned i = 0; i < n; ++i) threads_.emplace_back([this] { run(); });
  }
  ~Pool() {
    {
      std::lock_guard lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : threads_) t.join();
  }
  template <class Fn>
  auto submit(Fn fn) {
    auto task = std::make_shared<std::packaged_task<decltype(fn())()>>(std::move(fn));
    auto fut = task->get_future();
    {
      std::lock_guard lk(mu_);
      queue_.emplace_back([task] { (*task)(); });
    }
    cv_.notify_one();
    return fut;
  }

 private:
  void run() {
    for (;;) {
      std::function<void()> f;
      {
        std::unique_lock lk(mu_);
        cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        f = std::move(queue_.front());
        queue_.pop_front();
      }
      f();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  std::vector<std::thread> threads_;
  bool stop_ = false;
};

class Jit {
 public:
  std::shared_ptr<const Prepared> prepare(const Variant& v, const KernelSpec& spec) {
    KernelSpec resolved = spec;
    if (resolved.arch.empty()) resolved.arch = current_arch();
    const std::string id = spec_id(&detail::impl_of(v), resolved);
    {
      std::lock_guard lk(mu_);
      if (auto it = prepared_.find(id); it != prepared_.end()) return it->second;
    }
    auto p = std::make_shared<Prepared>(Prepared{v, std::move(resolved), {}, {}, {}, {}, {}, {}});
    const detail::VariantImpl& impl = detail::impl_of(v);
    std::string stem = spec.template_name.substr(0, spec.template_name.rfind(".cuh"));
    p->what = fmt::format("flexc {} kernel for variant '{}' ({})", stem, impl.name, p->spec.arch);
    try {
      p->header = dsl::emit_cuda_variant(detail::emit_input(impl));
    } catch (const std::invalid_argument& e) {
      throw Error(fmt::format("generating the {}: {}", p->what, e.what()));
    }
    p->unit = splice(spec.template_name, p->header);
    p->options = nvrtc_options(p->spec.arch, spec.defines);
    p->description = fmt::format("{}: {} {}", impl.name, spec.template_name, p->spec.arch);
    for (const auto& [k, val] : spec.defines) p->description += fmt::format(" {}={}", k, val);

    p->key = cache_key(FLEXC_VERSION, nvrtc_identity(), p->spec.arch, p->options, p->unit);

    std::lock_guard lk(mu_);
    if (prepared_.size() >= kMaxMemo) prepared_.clear();
    return prepared_.emplace(id, std::move(p)).first->second;
  }

  Obtained obtain(const Prepared& p, bool use_cache) {
    if (!use_cache) return compile_now(p, nullptr);
    std::unique_lock lk(mu_);
    if (auto it = memory_.find(p.key); it != memory_.end()) {
      ++memory_hits_;
      return {it->second, Via::Memory, 0};
    }
    if (auto it = inflight_.find(p.key); it != inflight_.end()) {
      std::shared_future<Obtained> f = it->second;
      lk.unlock();
      Obtained r = f.get();
      ++memory_hits_;
      return {r.entry, Via::Memory, 0};
    }
    std::promise<Obtained> promise;
    inflight_.emplace(p.key, promise.get_future().share());
    if (!disk_) disk_ = std::make_shared<DiskCache>(CacheSettings::from_env());
    const std::shared_ptr<const DiskCache> d = disk_;  // stays valid across a reset()
    lk.unlock();
    try {
      Obtained r = load_or_compile(p, *d);
      lk.lock();
      memory_[p.key] = r.entry;
      inflight_.erase(p.key);
      lk.unlock();
      promise.set_value(r);
      return r;
    } catch (...) {
      lk.lock();
      inflight_.erase(p.key);
      lk.unlock();
      promise.set_exception(std::current_exception());
      throw;
    }
  }

  const Kernel& kernel(const Variant& v, const KernelSpec& spec) {
    CUcontext ctx = current_context();
    const std::string id =
        fmt::format("{}|{}", static_cast<void*>(ctx), spec_id(&detail::impl_of(v), spec));
    {
      std::shared_lock lk(kernels_mu_);
      if (auto it = fast_.find(id); it != fast_.end()) {
        ++memory_hits_;
        return *it->second.kernel;
      }
    }
    const std::shared_ptr<const Prepared> p = prepare(v, spec);
    return load(ctx, id, *p, obtain(*p, true));
  }

  std::vector<const Kernel*> kernels(const Variant& v, std::span<const KernelSpec> specs) {
    CUcontext ctx = current_context();
    std::vector<std::shared_ptr<const Prepared>> ps;
    for (const KernelSpec& s : specs) ps.push_back(prepare(v, s));
    std::vector<Obtained> got = obtain_all(ps, true);
    std::vector<const Kernel*> out;
    for (size_t i = 0; i < specs.size(); ++i) {
      const std::string id =
          fmt::format("{}|{}", static_cast<void*>(ctx), spec_id(&detail::impl_of(v), specs[i]));
      out.push_back(&load(ctx, id, *ps[i], got[i]));
    }
    return out;
  }

  std::vector<Obtained> obtain_all(const std::vector<std::shared_ptr<const Prepared>>& ps,
                                   bool use_cache) {
    std::vector<std::future<Obtained>> futures;
    for (const auto& p : ps)
      futures.push_back(pool().submit([this, p, use_cache] { return obtain(*p, use_cache); }));
    std::vector<Obtained> out;
    std::exception_ptr first;
    for (auto& f : futures) {  // wait for all before reporting the first failure
      try {
        out.push_back(f.get());
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    if (first) std::rethrow_exception(first);
    return out;
  }

  CacheCounters counters() const { return {memory_hits_, disk_hits_, compiles_}; }

  void reset() {
    std::lock_guard lk(mu_);
    memory_.clear();
    prepared_.clear();
    disk_.reset();
  }

 private:
  Pool& pool() {
    static Pool p;
    return p;
  }

  Obtained load_or_compile(const Prepared& p, const DiskCache& d) {
    const auto hit = [&](CacheEntry e) {
      ++disk_hits_;
      return Obtained{std::make_shared<const CacheEntry>(std::move(e)), Via::Disk, 0};
    };
    if (std::optional<CacheEntry> e = d.load(p.key)) return hit(std::move(*e));
    const DiskCache::Lock lock = d.lock(p.key);
    // Another process may have compiled it while this one waited for the lock.
    if (std::optional<CacheEntry> e = d.load(p.key)) return hit(std::move(*e));
    return compile_now(p, &d);
  }

  Obtained compile_now(const Prepared& p, const DiskCache* d) {
    const detail::VariantImpl& impl = detail::impl_of(p.variant);
    const ErrorContext ctx{"compiling the " + p.what, p.header, &impl.score, &impl.mask};
    NvrtcOutput out = nvrtc_compile(p.unit, p.options, ctx);
    auto e = std::make_shared<CacheEntry>(
        CacheEntry{p.description, std::move(out.cubin), std::move(out.ptx)});
    if (d) d->store(p.key, *e);
    ++compiles_;
    return {std::move(e), Via::Nvrtc, out.seconds};
  }

  // The module for (context, key) is loaded once, however many Variant objects ask for it.
  // Loading runs outside kernels_mu_: the driver may wait there for the device to go idle, and
  // with an NCCL kernel in flight (ring attention, a thread per GPU) that wait needs the other
  // ranks' threads to reach their next send, which a process-wide lock held here would stop.
  const Kernel& load(CUcontext ctx, const std::string& fast_id, const Prepared& p,
                     const Obtained& got) {
    const std::string id = fmt::format("{}|{}|{}", static_cast<void*>(ctx), p.key, p.spec.entry);
    bool loaded = false;
    {
      std::shared_lock lk(kernels_mu_);
      loaded = modules_.contains(id);
    }
    std::unique_ptr<Kernel> made = loaded ? nullptr : load_module(p, got);
    std::unique_lock lk(kernels_mu_);
    // A thread that loaded the same module meanwhile wins; this copy stays loaded, unused (kept
    // modules are never unloaded, and unloading one could wait for the device too).
    const Kernel* kernel = made ? modules_.try_emplace(id, std::move(made)).first->second.get()
                                : modules_.at(id).get();
    if (fast_.size() >= kMaxMemo) fast_.clear();
    fast_.insert_or_assign(fast_id, Fast{p.variant, kernel});
    return *kernel;
  }

  static std::unique_ptr<Kernel> load_module(const Prepared& p, const Obtained& got) {
    const std::string doing = "loading the " + p.what;
    const DriverApi& d = driver(doing);
    const std::string& image = got.entry->cubin.empty() ? got.entry->ptx : got.entry->cubin;
    CUmodule mod = nullptr;
    check(d.cuModuleLoadData(&mod, image.c_str()), doing);
    try {
      CUfunction fn = nullptr;
      check(d.cuModuleGetFunction(&fn, mod, p.spec.entry.c_str()),
            fmt::format("{}: finding its entry '{}'", doing, p.spec.entry));
      return std::make_unique<Kernel>(fn, p.what, detail::impl_of(p.variant).facts);
    } catch (...) {
      d.cuModuleUnload(mod);  // a failed module must not leak
      throw;
    }
  }

  std::mutex mu_;  // prepared_, memory_, inflight_, disk_
  std::unordered_map<std::string, std::shared_ptr<const Prepared>> prepared_;
  std::unordered_map<std::string, std::shared_ptr<const CacheEntry>> memory_;
  std::unordered_map<std::string, std::shared_future<Obtained>> inflight_;
  std::shared_ptr<const DiskCache> disk_;
  std::atomic<uint64_t> memory_hits_{0}, disk_hits_{0}, compiles_{0};
  // get_kernel's lookup by (context, Variant object, spec); the Variant copy keeps the object's
  // address from being reused while it is a key.
  struct Fast {
    Variant keep_alive;
    const Kernel* kernel;
  };
  std::shared_mutex kernels_mu_;  // fast_, modules_
  std::unordered_map<std::string, Fast> fast_;
  std::unordered_map<std::string, std::unique_ptr<Kernel>> modules_;  // never unloaded
};

Jit& jit() {
  static Jit j;
  return j;
}

Compiled to_compiled(const Prepared& p, const Obtained& got) {
  return {p.key,          flatten(p.unit),       got.entry->cubin,
          got.entry->ptx, got.via != Via::Nvrtc, got.via == Via::Disk,
          got.seconds};
}

}  // namespace

Compiled compile(const Variant& v, const KernelSpec& spec, const CompileOptions& opts) {
  const std::shared_ptr<const Prepared> p = jit().prepare(v, spec);
  return to_compiled(*p, jit().obtain(*p, opts.use_cache));
}

std::vector<Compiled> compile_all(const Variant& v, std::span<const KernelSpec> specs,
                                  const CompileOptions& opts) {
  std::vector<std::shared_ptr<const Prepared>> ps;
  for (const KernelSpec& s : specs) ps.push_back(jit().prepare(v, s));
  const std::vector<Obtained> got = jit().obtain_all(ps, opts.use_cache);
  std::vector<Compiled> out;
  for (size_t i = 0; i < ps.size(); ++i) out.push_back(to_compiled(*ps[i], got[i]));
  return out;
}

int Kernel::local_bytes() const {
  int n = local_bytes_.load(std::memory_order_relaxed);
  if (n < 0) {
    check(driver("asking a flexc kernel").cuFuncGetAttribute(&n, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES,
                                                              fn_),
          fmt::format("asking the {} for its local memory", what_));
    local_bytes_.store(n, std::memory_order_relaxed);
  }
  return n;
}

void Kernel::reserve_smem(size_t smem_bytes) const {
  if (smem_bytes <= smem_limit_.load(std::memory_order_acquire)) return;
  std::lock_guard lk(smem_mu_);
  if (smem_bytes <= smem_limit_.load()) return;
  const DriverApi& d = driver("raising a flexc kernel's shared memory");  // loaded: it exists
  check(d.cuFuncSetAttribute(fn_, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                             static_cast<int>(smem_bytes)),
        fmt::format("raising the dynamic shared memory of the {} to {} bytes", what_, smem_bytes));
  smem_limit_.store(smem_bytes, std::memory_order_release);
}

void Kernel::launch(unsigned grid_x, unsigned grid_y, unsigned grid_z, unsigned block,
                    size_t smem_bytes, CUstream_st* stream, void** args, bool early) const {
  const DriverApi& d = driver("launching a flexc kernel");  // loaded: this kernel exists
  reserve_smem(smem_bytes);
  CUlaunchAttribute attr{};
  attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
  attr.value.programmaticStreamSerializationAllowed = 1;
  CUlaunchConfig cfg{};
  cfg.gridDimX = grid_x, cfg.gridDimY = grid_y, cfg.gridDimZ = grid_z;
  cfg.blockDimX = block, cfg.blockDimY = 1, cfg.blockDimZ = 1;
  cfg.sharedMemBytes = static_cast<unsigned>(smem_bytes);
  cfg.hStream = stream;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  const CUresult r = early ? d.cuLaunchKernelEx(&cfg, fn_, args, nullptr)
                           : d.cuLaunchKernel(fn_, grid_x, grid_y, grid_z, block, 1, 1,
                                              static_cast<unsigned>(smem_bytes), stream, args,
                                              nullptr);
  if (r != CUDA_SUCCESS)
    check(r, fmt::format("launching the {} (grid {}x{}x{}, {} threads, {} bytes of shared memory)",
                         what_, grid_x, grid_y, grid_z, block, smem_bytes));
}

const Kernel& get_kernel(const Variant& v, const KernelSpec& spec) { return jit().kernel(v, spec); }

std::vector<const Kernel*> get_kernels(const Variant& v, std::span<const KernelSpec> specs) {
  return jit().kernels(v, specs);
}

CacheCounters cache_counters() { return jit().counters(); }

void reset_cache() { jit().reset(); }

}  // namespace flexc::jit
