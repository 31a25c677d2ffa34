// `flexc compile CONFIG.json`: generates a variant's kernels (or a linear-attention config's) with
// NVRTC, without needing a GPU, through the same cache as the library; optionally writes the
// spliced .cu, the PTX and the cubin.
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "cli/args.h"
#include "cli/command.h"
#include "flexc/device.h"
#include "flexc/error.h"
#include "flexc/jit.h"
#include "flexc/linear.h"
#include "flexc/variant.h"

namespace flexc::cli {
namespace {

namespace fs = std::filesystem;

struct Options {
  std::vector<std::string> configs;
  std::string arch, dtype = "bf16", kernels = "all", out_dir, emit, precision;
  std::string gate_dtype = "float32";  // linear-attention configs' gates
  int head_dim = 128, v_head_dim = 0;
  bool timings = false, positions = false, f32_out = false, accumulate = false, varlen = false;
};

// A comma-separated list; an empty list or item is an error naming the option.
std::vector<std::string> split(const std::string& s, std::string_view option) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t comma = std::min(s.find(',', start), s.size());
    if (comma == start)
      throw Error(fmt::format("{} '{}': an empty name in the list", option, printable(s)));
    out.push_back(s.substr(start, comma - start));
    start = comma + 1;
  }
  return out;
}

// File names from a variant name: keep them to a portable character set.
std::string file_stem(std::string_view name) {
  std::string s;
  for (char c : name)
    s += std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' ? c : '_';
  return s;
}

void write_file(const fs::path& p, const std::string& data) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(data.data(), static_cast<std::streamsize>(data.size()));
  if (!f.good()) throw Error(fmt::format("cannot write {}", p.string()));
}

void run(const Options& o) {
  const auto t0 = std::chrono::steady_clock::now();
  if (o.dtype != "bf16" && o.dtype != "fp16")
    throw Error(fmt::format("--dtype must be bf16 or fp16, not '{}'", o.dtype));
  if (o.arch.empty() && !flexc::gpu_available())
    throw Error(
        "no GPU here to take the architecture from: name it with --arch (e.g. --arch sm_90)");

  // "all": the kernels that can be built for the arch (the Hopper kernels only for sm_90 / sm_90a).
  std::vector<KernelBuild> builds;
  // (With --varlen, "all" means the forward attention kernels: the packed builds there are.)
  if (o.kernels == "all") {
    for (const KernelInfo& k : kernel_templates(o.arch.empty() ? current_arch() : o.arch))
      if (!o.varlen || k.name.starts_with("attention_fwd"))
        builds.push_back({k.name, o.arch, o.dtype, o.head_dim, o.v_head_dim, o.positions, o.f32_out,
                          o.accumulate});
  } else {
    for (const std::string& name : split(o.kernels, "--kernel"))
      builds.push_back({name, o.arch, o.dtype, o.head_dim, o.v_head_dim, o.positions, o.f32_out,
                        o.accumulate});
  }
  for (KernelBuild& b : builds) b.varlen = o.varlen;

  bool want_cu = false, want_ptx = false, want_cubin = false;
  for (const std::string& e : o.emit.empty() ? std::vector<std::string>{} : split(o.emit, "--emit")) {
    if (e == "cu")
      want_cu = true;
    else if (e == "ptx")
      want_ptx = true;
    else if (e == "cubin")
      want_cubin = true;
    else
      throw Error(fmt::format("--emit takes cu, ptx and cubin, not '{}'", e));
  }
  if (!o.out_dir.empty() && o.emit.empty()) want_cubin = true;
  const fs::path dir = o.out_dir.empty() ? fs::path(".") : fs::path(o.out_dir);
  if (want_cu || want_ptx || want_cubin) fs::create_directories(dir);

  // One kernel built: its line, and the files asked for.
  const auto report = [&](const std::string& variant, const std::string& kernel,
                          const CompiledKernel& c) {
    const std::string how = c.origin == CompiledKernel::Origin::DiskCache     ? "disk cache"
                            : c.origin == CompiledKernel::Origin::MemoryCache ? "memory cache"
                                                                              : "compiled";
    std::string line = fmt::format("{}: {} ({}): {}, key {}, cubin {} bytes, ptx {} bytes",
                                   variant, kernel, c.arch.empty() ? "this GPU" : c.arch, how,
                                   c.key.substr(0, 16), c.cubin.size(), c.ptx.size());
    if (o.timings && c.origin == CompiledKernel::Origin::Compiled)
      line += fmt::format(", NVRTC {:.3f} s", c.compile_seconds);
    fmt::print("{}\n", line);
    const std::string stem =
        fmt::format("{}.{}.{}", file_stem(variant), kernel, c.arch.empty() ? "gpu" : c.arch);
    if (want_cu) write_file(dir / (stem + ".cu"), c.source);
    if (want_ptx) write_file(dir / (stem + ".ptx"), c.ptx);
    if (want_cubin) {
      if (c.cubin.empty())
        throw Error(fmt::format(
            "{} has no cubin: '{}' is a virtual architecture (use --emit ptx)", stem, c.arch));
      write_file(dir / (stem + ".cubin"), c.cubin);
    }
  };
  for (const std::string& config : o.configs) {
    if (LinearVariant::is_linear_config(config)) {
      // A linear-attention config: its forward (with the step) and backward modules, and its
      // feature map's.
      const LinearVariant v = LinearVariant::load(config);
      const std::vector<CompiledKernel> out = compile_linear_kernels(
          v, o.arch, o.dtype, o.head_dim, o.v_head_dim ? o.v_head_dim : o.head_dim, o.gate_dtype);
      report(v.name(), "gla", out[0]);
      report(v.name(), "gla_backward", out[1]);
      if (out.size() > 2) report(v.name(), "gla_feature_map", out[2]);
      continue;
    }
    const Variant v = load_variant(config, o.precision);
    const std::vector<CompiledKernel> out = compile_kernels(v, builds);
    for (size_t i = 0; i < out.size(); ++i) report(v.name(), builds[i].kernel, out[i]);
  }
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (o.timings) fmt::print("total {:.3f} s\n", total);
}

const Register reg{
    "compile", [](CLI::App& app) {
      auto o = std::make_shared<Options>();
      CLI::App* c = app.add_subcommand(
          "compile", "Generate variants' kernels with NVRTC (no GPU needed; uses the JIT cache)");
      c->add_option("configs", o->configs,
                    "variant configs (JSON files, or @name from the catalogues; linear-attention "
                    "configs too)")
          ->required();
      c->add_option("--arch", o->arch,
                    "target: sm_80, sm_86, sm_89, sm_90, sm_90a, compute_90, ... "
                    "(default: this machine's GPU)");
      c->add_option("--dtype", o->dtype, "attention input type: bf16 or fp16")
          ->capture_default_str();
      c->add_option("--head-dim", o->head_dim, "attention head dimension (q's and k's)")
          ->check(int_range(1, 1024))
          ->capture_default_str();
      c->add_option("--v-head-dim", o->v_head_dim,
                    "v's and the output's head dimension when it differs (forward kernels only: "
                    "name them with --kernel)")
          ->check(int_range(1, 1024));
      std::string names;
      for (const KernelInfo& k : kernel_templates())
        names += fmt::format("\n  {}: {}", k.name, k.description);
      c->add_option("--kernel", o->kernels, "comma-separated kernels, or all:" + names)
          ->capture_default_str();
      c->add_option("-o,--out", o->out_dir, "directory for the files --emit asks for (default: .)");
      c->add_option("--emit", o->emit,
                    "what to write, comma-separated: cu, ptx, cubin (with -o "
                    "alone: cubin)");
      c->add_option("--gate-dtype", o->gate_dtype,
                    "linear-attention configs: the gates' type, float32, bf16 or fp16 (their "
                    "kernels: gla, gla_backward, gla_feature_map with a feature map; --head-dim and --v-head-dim are DK and DV)")
          ->capture_default_str();
      c->add_flag("--timings", o->timings, "print NVRTC and total times");
      c->add_flag("--positions", o->positions,
                  "the attention kernels' build for a block of a longer sequence (keys at an "
                  "offset, the sequence's lengths given); ring attention runs it with --f32-out "
                  "--accumulate");
      c->add_flag("--f32-out", o->f32_out,
                  "the attention kernels' build with float32 outputs (forward: out; backward: dq, "
                  "dk, dv), which calls given float32 outputs run");
      c->add_flag("--accumulate", o->accumulate,
                  "with --f32-out: the backward's build adding into dq, dk, dv "
                  "(BackwardOptions::accumulate)");
      c->add_flag("--varlen", o->varlen,
                  "the forward kernels' build for packed sequences (AttentionOptions::packed); "
                  "--kernel all then means those (naming a backward kernel is an error)");
      add_precision_option(c, o->precision);
      c->callback([o] { run(*o); });
    }};

}  // namespace
}  // namespace flexc::cli
