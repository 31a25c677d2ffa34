// `flexc blockmask CONFIG.json|@name --q-len N ...`: builds a variant's BlockMask and prints its
// picture, sparsity, tile counts, what the interval analysis decided, and the build time.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fmt/format.h>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "cli/args.h"
#include "cli/command.h"
#include "cli/mask_captures.h"
#include "flexc/blockmask.h"
#include "flexc/error.h"
#include "flexc/variant.h"

namespace flexc::cli {
namespace {

struct Options {
  std::string config;
  int64_t q_len = 0, kv_len = 0, batch = 1, heads = 1, tile = 128, q_tile = 0, kv_tile = 0;
  int64_t rows = 32, cols = 32;
  std::vector<std::string> params, captures;
  std::string device = "auto";
  bool brute_force = false;
};

void run(const Options& o) {
  const Variant v = Variant::load(o.config);
  const int64_t kv_len = o.kv_len ? o.kv_len : o.q_len;
  BlockMaskOptions bo;
  bo.q_tile = o.q_tile ? o.q_tile : o.tile;
  bo.kv_tile = o.kv_tile ? o.kv_tile : o.tile;
  bo.analytic = !o.brute_force;
  bo.device = o.device == "cpu"   ? BuildDevice::Cpu
              : o.device == "gpu" ? BuildDevice::Gpu
                                  : BuildDevice::Auto;
  for (const auto& [name, value] : assignments(o.params, "--param"))
    bo.params[name] = parse_number(value, "--param " + name);
  const MaskCaptures docs = document_captures(v, o.captures, o.batch, o.heads, o.q_len, kv_len);
  bo.captures = docs.captures;

  // A GPU build returns once its work is enqueued; the time until the host copy is back bounds
  // it from above (the copy itself included). The first GPU build also compiles the kernels.
  using Clock = std::chrono::steady_clock;
  auto build = [&] {
    const auto t0 = Clock::now();
    BlockMask m = create_block_mask(v, o.batch, o.heads, o.q_len, kv_len, bo);
    m.host();
    return std::pair{m, std::chrono::duration<double, std::milli>(Clock::now() - t0).count()};
  };
  auto [m, first_ms] = build();
  const BlockMaskStats& st = m.stats();
  std::string timing = fmt::format("{:.3f} ms", first_ms);
  if (st.device == "gpu") {
    auto [again, warm_ms] = build();
    timing = fmt::format(
        "{:.3f} ms on the host, {:.3f} ms until the lists are back on the host (first build, "
        "with JIT: {:.3f} ms)",
        again.stats().host_ms, warm_ms, first_ms);
  }
  fmt::print("{}", m.to_string(o.rows, o.cols));
  fmt::print("variant     {}   mask_mod  {}\n", v.name(), v.mask_mod_text());
  fmt::print("tiles       {} = {} x {} x {} q tiles x {} kv tiles of {}x{}\n", st.tiles, m.nb(),
             m.nh(), m.num_q_tiles(), m.num_kv_tiles(), m.q_tile(), m.kv_tile());
  fmt::print("counts      full {}, partial {}, empty {}   sparsity {:.2f}%\n",
             m.count(TileKind::Full), m.count(TileKind::Partial), m.count(TileKind::Empty),
             m.sparsity());
  if (st.analytic)
    fmt::print("analysis    {} tiles decided ({:.2f}%) in {} interval evaluations, {:.3f} ms\n",
               st.decided_tiles, 100.0 * double(st.decided_tiles) / double(st.tiles), st.boxes,
               st.analysis_ms);
  else
    fmt::print("analysis    off (brute force)\n");
  fmt::print("evaluated   {} tiles element by element, on the {}\n", st.evaluated_tiles,
             st.device == "gpu" ? "GPU" : "CPU");
  fmt::print("build time  {}\n", timing);
}

const Register reg("blockmask", [](CLI::App& app) {
  auto o = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand(
      "blockmask",
      "Build a variant's BlockMask and print its picture, sparsity, tile counts, how many tiles "
      "the interval analysis decided, and the build time.");
  cmd->add_option("config", o->config, "JSON variant config, or @name from the catalogue")
      ->required();
  cmd->add_option("--q-len", o->q_len, "query length")->required()->check(int_range(1));
  cmd->add_option("--kv-len", o->kv_len, "key/value length (default: --q-len)")
      ->check(int_range(1));
  cmd->add_option("--batch", o->batch, "batch size B")->check(int_range(1));
  cmd->add_option("--heads", o->heads, "query heads H")->check(int_range(1));
  cmd->add_option("--param", o->params, "runtime param value, NAME=VALUE (repeatable)");
  cmd->add_option("--capture", o->captures,
                  "document ids for an int32 capture: NAME=doc:S1,S2,... (documents start at "
                  "tokens 0, S1, S2, ...) or NAME=docs:N (N equal documents) (repeatable)");
  cmd->add_option("--tile", o->tile, "tile size for q and kv (default 128)")
      ->check(int_range(1));
  cmd->add_option("--q-tile", o->q_tile, "q tile size (overrides --tile)")
      ->check(int_range(1));
  cmd->add_option("--kv-tile", o->kv_tile, "kv tile size (overrides --tile)")
      ->check(int_range(1));
  cmd->add_option("--device", o->device, "where to build: auto (GPU if present), cpu, gpu")
      ->check(CLI::IsMember({"auto", "cpu", "gpu"}));
  cmd->add_flag("--brute-force", o->brute_force,
                "evaluate every element of every tile (no interval analysis)");
  cmd->add_option("--rows", o->rows, "picture rows at most (default 32)")
      ->check(int_range(1));
  cmd->add_option("--cols", o->cols, "picture columns at most (default 32)")
      ->check(int_range(1));
  cmd->callback([o] { run(*o); });
});

}  // namespace
}  // namespace flexc::cli
