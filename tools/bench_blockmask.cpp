// bench_blockmask: BlockMask construction time for causal, sliding window (1024), prefix LM
// (2048) and document (6 documents) masks from 1k to 1M tokens, B = H = 1, 128 x 128 tiles.
//
//   bench_blockmask [--sizes 1024,4096,...] [--masks causal,...] [--reps 20] [--device gpu|cpu]
//                   [--analysis-only]
// gpu: end to end on one stream (host analysis + uploads + kernels), timed with CUDA events from
// before create_block_mask until the lists are written; the median of --reps after 3 warm-ups
// (the first compiles the kernels). cpu: the CPU builder's wall time. --analysis-only: just the
// host's interval analysis as a GPU build runs it (measurable without a GPU).
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <optional>
#include <vector>

#include "bench_util.h"
#include "blockmask/blockmask_impl.h"
#include "flexc/blockmask.h"
#include "flexc/device.h"
#include "flexc/error.h"
#include "flexc/variant.h"

using namespace flexc;
using flexc_bench::median;
using Clock = std::chrono::steady_clock;

namespace {

double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

struct Row {
  double ms = 0, host_ms = 0, analysis_ms = 0;
  BlockMaskStats stats;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"BlockMask construction benchmark"};
  std::vector<int64_t> sizes{1024, 4096, 16384, 131072, 1048576};
  std::vector<std::string> masks{"causal", "sliding_window", "prefix_lm", "document"};
  int reps = 20;
  std::string device = "gpu";
  bool analysis_only = false;
  int64_t leaf = 0;
  bool json = false;
  app.add_option("--sizes", sizes, "sequence lengths (q_len = kv_len)")->delimiter(',');
  app.add_option("--masks", masks, "catalogue masks")->delimiter(',');
  app.add_option("--reps", reps, "timed repetitions (median reported)")->check(CLI::PositiveNumber);
  app.add_option("--device", device, "gpu or cpu")->check(CLI::IsMember({"gpu", "cpu"}));
  app.add_flag("--analysis-only", analysis_only, "time only the host analysis of a GPU build");
  app.add_option("--leaf", leaf, "BlockMaskOptions::gpu_leaf_tiles (0: the default)");
  app.add_flag("--json", json, "one JSON object per case instead of the table");
  CLI11_PARSE(app, argc, argv);
  try {
    const bool gpu = device == "gpu" && !analysis_only;
    if (gpu && !flexc::gpu_available()) {
      std::fprintf(stderr, "bench_blockmask: no GPU (use --device cpu or --analysis-only)\n");
      return 1;
    }
    std::optional<flexc::Stream> stream;
    if (gpu) stream.emplace();
    if (!json)
      fmt::print("{}, leaf boxes of {} tiles\n",
                 analysis_only ? "host analysis of a GPU build"
                 : gpu         ? "GPU build, end to end (CUDA events)"
                               : "CPU build (wall time)",
                 leaf ? leaf : BlockMaskOptions::kDefaultGpuLeafTiles);
    if (!json)
      fmt::print(
          "| mask | tokens | tiles | time ms | host ms | analysis ms | boxes | decided % | "
          "evaluated tiles | ns / tile |\n|---|---|---|---|---|---|---|---|---|---|\n");
    for (const std::string& name : masks) {
      const Variant v = Variant::from_catalogue(name);
      for (int64_t n : sizes) {
        BlockMaskOptions o;
        o.device = gpu ? BuildDevice::Gpu : BuildDevice::Cpu;
        o.gpu_leaf_tiles = leaf;
        std::vector<int32_t> doc;
        if (name.starts_with("document")) {
          // Six documents, boundaries at round(i * n / 6), as tools/bench_blockmask_peers.py.
          doc.resize(n);
          for (int64_t i = 0, d = 0; i < n; ++i) {
            while (d < 5 && std::llround(double(d + 1) * double(n) / 6) <= i) ++d;
            doc[i] = int32_t(d);
          }
          o.captures["doc"] = CaptureData{doc.data(), nullptr, {n}, {}};
        }
        std::vector<Row> rows;
        for (int r = 0; r < reps + 3; ++r) {
          Row row;
          if (analysis_only) {
            const auto t0 = Clock::now();
            const detail::MaskProblem p = detail::resolve_problem(v, 1, 1, n, n, o);
            const detail::Analysis a =
                detail::analyse(p, detail::gpu_leaf_tiles(o), detail::gpu_box_budget(p));
            row.ms = row.host_ms = row.analysis_ms = ms_since(t0);
            row.stats.tiles = p.tiles();
            row.stats.boxes = a.boxes;
            row.stats.decided_tiles = a.decided_tiles;
            for (const auto& x : a.undecided) row.stats.evaluated_tiles += x.area();
          } else if (gpu) {
            flexc::EventTimer timer;
            timer.start(stream->get());
            const auto t0 = Clock::now();
            const BlockMask m = create_block_mask(v, 1, 1, n, n, o, stream->get());
            timer.stop(stream->get());
            row.host_ms = ms_since(t0);
            row.ms = timer.elapsed_ms();
            row.stats = m.stats();
            row.analysis_ms = m.stats().analysis_ms;
          } else {
            const auto t0 = Clock::now();
            const BlockMask m = create_block_mask(v, 1, 1, n, n, o);
            row.ms = row.host_ms = ms_since(t0);
            row.stats = m.stats();
            row.analysis_ms = m.stats().analysis_ms;
          }
          if (r >= 3) rows.push_back(row);
        }
        std::vector<double> ms, hms, ams;
        for (const Row& r : rows)
          ms.push_back(r.ms), hms.push_back(r.host_ms), ams.push_back(r.analysis_ms);
        const BlockMaskStats& st = rows.back().stats;
        const double t = median(ms);
        const double decided = 100.0 * double(st.decided_tiles) / double(st.tiles);
        if (json)
          fmt::print(
              "{{\"mask\": \"{}\", \"s\": {}, \"tiles\": {}, \"ms\": {:.6f}, "
              "\"host_ms\": {:.6f}, \"analysis_ms\": {:.6f}, \"boxes\": {}, "
              "\"decided_pct\": {:.3f}, \"evaluated_tiles\": {}}}\n",
              name, n, st.tiles, t, median(hms), median(ams), st.boxes, decided,
              st.evaluated_tiles);
        else
          fmt::print("| {} | {} | {} | {:.4f} | {:.4f} | {:.4f} | {} | {:.2f} | {} | {:.2f} |\n",
                     name, n, st.tiles, t, median(hms), median(ams), st.boxes, decided,
                     st.evaluated_tiles, t * 1e6 / double(st.tiles));
        std::fflush(stdout);
      }
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "bench_blockmask: %s\n", e.what());
    return 2;
  }
  return 0;
}
