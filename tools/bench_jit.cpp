// bench_jit: what the JIT costs. For each kernel: a cold NVRTC compile, a warm disk-cache hit
// (with the module load when a GPU is present), and a memory hit. Runs in a private cache
// directory, so the figures never depend on what the user's cache holds.
//
//   bench_jit [--variant alibi] [--kernel all|mods_eval,...] [--arch sm_90] [--reps 5]
#include <fmt/format.h>
#include <sys/resource.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "bench_util.h"
#include "flexc/device.h"
#include "flexc/error.h"
#include "flexc/jit.h"
#include "flexc/variant.h"

using namespace flexc;
using flexc_bench::median;
using Clock = std::chrono::steady_clock;

namespace {

double process_cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);  // NVRTC runs on the JIT's compile threads
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string ms(double s) { return fmt::format("{:.3f} ms", s * 1e3); }
std::string us(double s) { return fmt::format("{:.2f} us", s * 1e6); }

void bench(const std::string& variant, const KernelBuild& build, int reps) {
  const auto fresh = [&] {
    return variant.ends_with(".json") ? Variant::from_json_file(variant)
                                      : Variant::from_catalogue(variant);
  };
  const Variant v = fresh();
  const std::span<const KernelBuild> builds(&build, 1);
  const bool gpu = flexc::gpu_available();

  // Cold: NVRTC every time. The first compile of the process also pays NVRTC's start-up.
  std::vector<double> wall, cpu;
  std::string arch;
  for (int i = 0; i <= reps; ++i) {
    const auto t0 = Clock::now();
    const double c0 = process_cpu_seconds();
    arch = compile_kernels(v, builds, false).at(0).arch;
    wall.push_back(since(t0));
    cpu.push_back(process_cpu_seconds() - c0);
    if (i == 0)
      fmt::print("{} kernel for '{}' ({}), {} repetitions{}\n", build.kernel, v.name(),
                 arch.empty() ? "this GPU" : arch, reps, gpu ? "" : ", no GPU");
  }
  fmt::print("  cold compile, first in process  {:>12}  (cpu {})\n", ms(wall[0]), ms(cpu[0]));
  wall.erase(wall.begin());
  cpu.erase(cpu.begin());
  fmt::print("  cold compile, median            {:>12}  (cpu {})\n", ms(median(wall)),
             ms(median(cpu)));

  // Warm disk hit: memory dropped, as in a new process; emit + splice + key + read + check.
  compile_kernels(v, builds);
  std::vector<double> disk;
  for (int i = 0; i < reps; ++i) {
    clear_kernel_memory_cache();
    const auto t0 = Clock::now();
    const CompiledKernel c = compile_kernels(v, builds).at(0);
    disk.push_back(since(t0));
    if (c.origin != CompiledKernel::Origin::DiskCache)
      throw Error("bench_jit: expected a disk hit");
  }
  fmt::print("  disk hit, compile_kernels()     {:>12}\n", ms(median(disk)));

  // The same with the module load: a new Variant object each time so that nothing in memory
  // can answer.
  if (gpu) {
    std::vector<double> load;
    for (int i = 0; i < reps; ++i) {
      const Variant w = fresh();
      clear_kernel_memory_cache();
      const auto t0 = Clock::now();
      load_kernels(w, builds);
      load.push_back(since(t0));
    }
    fmt::print("  disk hit + module load          {:>12}\n", ms(median(load)));
  } else {
    fmt::print("  disk hit + module load          {:>12}\n", "n/a");
  }

  constexpr int kHits = 2000;
  auto t0 = Clock::now();
  for (int i = 0; i < kHits; ++i) compile_kernels(v, builds);
  fmt::print("  memory hit, compile_kernels()   {:>12}  (copies the cubin and the .cu)\n",
             us(since(t0) / kHits));
  if (gpu) {
    load_kernels(v, builds);
    t0 = Clock::now();
    for (int i = 0; i < kHits; ++i) load_kernels(v, builds);
    fmt::print("  memory hit, load_kernels()      {:>12}\n", us(since(t0) / kHits));
  } else {
    fmt::print("  memory hit, load_kernels()      {:>12}\n", "n/a");
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_jit: cold compile, disk hit and memory hit of flexc's JIT"};
  std::string variant = "alibi", kernels = "all", arch, dtype = "bf16";
  int head_dim = 128, reps = 5;
  bool wide_kv = false;
  app.add_option("--variant", variant, "catalogue name or JSON file")->capture_default_str();
  app.add_option("--kernel", kernels, "comma-separated kernels, or all")->capture_default_str();
  app.add_option("--arch", arch, "target (default: the GPU's, else sm_90)");
  app.add_option("--dtype", dtype, "bf16 or fp16")->capture_default_str();
  app.add_option("--head-dim", head_dim, "head dimension")->capture_default_str();
  app.add_flag("--wide-kv", wide_kv,
               "attention_fwd_sm90 with wide kv tiles (KernelBuild::wide_kv: flexc::attention's "
               "build at D 128 / 192 / 256 where its hooks stage nothing per tile)");
  app.add_option("--reps", reps, "repetitions per figure")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / fmt::format("flexc_bench_jit_{}", getpid());
  setenv("FLEXC_CACHE_DIR", dir.c_str(), 1);
  unsetenv("FLEXC_DISABLE_DISK_CACHE");
  try {
    if (arch.empty() && !flexc::gpu_available()) arch = "sm_90";
    std::vector<std::string> list;
    if (kernels == "all")
      for (const KernelInfo& k : kernel_templates(arch.empty() ? flexc::current_arch() : arch))
        list.push_back(k.name);
    else
      for (size_t start = 0; start <= kernels.size();) {
        const size_t comma = std::min(kernels.find(',', start), kernels.size());
        list.push_back(kernels.substr(start, comma - start));
        start = comma + 1;
      }
    for (const std::string& k : list) {
      KernelBuild build{k, arch, dtype, head_dim};
      build.wide_kv = wide_kv && k == "attention_fwd_sm90";
      bench(variant, build, reps);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_jit: error: %s\n", e.what());
    std::filesystem::remove_all(dir);
    return 1;
  }
  std::filesystem::remove_all(dir);
  return 0;
}
