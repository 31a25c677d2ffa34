// The `flexc` command line on hostile arguments: each is a clear error naming the option, quickly
// and before any large allocation (no GPU needed: every case fails before looking for one);
// linear-attention configs through check / compile / run ([gpu] for run's checks).
#include <fmt/format.h>
#include <sys/wait.h>

#include <array>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "flexc/device.h"
#include "flexc/npy.h"

namespace {

struct Result {
  int status = -1;
  std::string output;  // stdout and stderr
  double seconds = 0;
};

// The flexc binary: beside the tests where they were built, or where $FLEXC_BINARY_DIR says (the
// GPU machine runs the staged copies of both, tools/gpu/suite.sh).
std::string flexc_dir() {
  const char* dir = std::getenv("FLEXC_BINARY_DIR");
  return dir && *dir ? dir : FLEXC_BINARY_DIR;
}

Result run_cli(const std::string& args) {
  const std::string cmd = fmt::format("{}/flexc {} 2>&1", flexc_dir(), args);
  const auto t0 = std::chrono::steady_clock::now();
  FILE* p = popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  Result r;
  std::array<char, 4096> buf;
  for (size_t n; (n = fread(buf.data(), 1, buf.size(), p)) > 0;) r.output.append(buf.data(), n);
  const int status = pclose(p);
  r.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

// Runs flexc, expects failure with `message` in its output, within a second or two.
void refused(const std::string& args, const std::string& message) {
  const Result r = run_cli(args);
  INFO("flexc " << args << "\n" << r.output);
  CHECK(r.status != 0);
  CHECK(r.output.find(message) != std::string::npos);
  CHECK(r.seconds < 2.0);
}

}  // namespace

TEST_CASE("numbers on the command line are decimal, in range, with readable limits", "[cli]") {
  refused("blockmask @causal --q-len 0", "--q-len: 0 is too small (at least 1)");
  refused("blockmask @causal --q-len 0x10", "--q-len: '0x10' is not a decimal integer");
  refused("blockmask @causal --q-len 1e3", "--q-len: '1e3' is not a decimal integer");
  refused("blockmask @causal --q-len 99999999999999999999",
          "--q-len: '99999999999999999999' is too large (at most 2147483647 (2^31 - 1))");
  refused("blockmask @causal --q-len 64 --tile -1", "--tile: '-1' is not a decimal integer");
  refused("compile @causal --arch sm_90 --head-dim 4096",
          "--head-dim: '4096' is too large (at most 1024)");
  refused("blockmask @sliding_window --q-len 64 --param window=0x10 --device cpu",
          "--param window: '0x10' is not a finite decimal number");
  refused("blockmask @sliding_window --q-len 64 --param window=nan --device cpu",
          "--param window: 'nan' is not a finite decimal number");
  refused("run @noop --random 1,2,2,16,16,64x", "--random D: '64x' is not a decimal integer");
  refused("run @noop --random 1,2,2,16,16",
          "--random '1,2,2,16,16': expected B,HQ,HKV,Q_LEN,KV_LEN,D[,DV]");
  refused("run @noop --random 1,2,2,16,16,64,64,64",
          "--random '1,2,2,16,16,64,64,64': expected B,HQ,HKV,Q_LEN,KV_LEN,D[,DV]");
  refused("run @noop --random 1,2,2,16,16,64,x", "--random DV: 'x' is not a decimal integer");
  refused("compile @causal --arch sm_90 --kernel attention_bwd --head-dim 128 --v-head-dim 64",
          "attention_bwd: v head dim 64 differs from the head dim 128");
  refused("run @noop --random 1,2,2,16,16,64 --scale 0x1p3",
          "--scale: '0x1p3' is not a finite decimal number");
  refused("compile @causal --arch sm_90 --kernel attention_bwd_sm90 --head-dim 64 --varlen",
          "attention_bwd_sm90 takes no packed sequences (varlen): the forward kernels do");
}

TEST_CASE("compile --varlen builds the forward kernels for packed sequences", "[cli]") {
  const Result r = run_cli("compile @causal --arch sm_90 --head-dim 64 --varlen");
  INFO(r.output);
  CHECK(r.status == 0);
  CHECK(r.output.find("causal: attention_fwd (sm_90): ") != std::string::npos);
  CHECK(r.output.find("causal: attention_fwd_sm90 (sm_90a): ") != std::string::npos);
  CHECK(r.output.find("attention_bwd") == std::string::npos);
  CHECK(r.output.find("attention_decode") == std::string::npos);
}

TEST_CASE("repeated NAME=VALUE options and empty lists are errors", "[cli]") {
  refused("blockmask @sliding_window --q-len 64 --param window=5 --param window=6 --device cpu",
          "--param window given twice");
  refused("blockmask @document --q-len 64 --capture doc=docs:2 --capture doc=docs:3 --device cpu",
          "--capture doc given twice");
  refused("run @noop --random 1,2,2,16,16,64 --param x=1 --param x=2", "--param x given twice");
  refused("compile @causal --arch sm_90 --kernel ''", "--kernel '': an empty name in the list");
  refused("compile @causal --arch sm_90 --kernel attention_fwd,,mods_eval",
          "--kernel 'attention_fwd,,mods_eval': an empty name in the list");
  refused("compile @causal --arch sm_90 --emit cu, -o /tmp", "--emit 'cu,': an empty name");
}

TEST_CASE("sizes are checked before anything is allocated", "[cli]") {
  refused("blockmask @causal --q-len 100000 --tile 1 --device cpu",
          "1 groups x 100000 x 100000 tiles need 158.3 GiB of lists; the limit is 4 GiB");
  refused("blockmask @document --q-len 16384 --capture doc=docs:2147483647 --device cpu",
          "--capture doc=docs:N: '2147483647' is too large (at most 16384)");
  refused("blockmask @document_batched --q-len 16384 --batch 2147483647 --capture doc=docs:6 "
          "--device cpu",
          "--capture doc: [2147483647, 16384] values of 4 bytes would take 128.0 TiB; the command "
          "line makes arrays of at most 4.0 GiB");
  refused("run @noop --random 2147483647,16,16,4096,4096,128",
          "--random (q): [2147483647, 16, 4096, 128] values of 6 bytes would take 96.0 PiB");
  refused("check /dev/zero", "cannot read variant config /dev/zero: it is not a regular file");
  // A capture declared [2^31 - 1, 2^31 - 1]: refused before its document ids are built.
  const std::filesystem::path f =
      std::filesystem::temp_directory_path() / fmt::format("flexc_cli_big_{}.json", getpid());
  std::ofstream(f) << R"({"name": "big", "mask_mod": "doc[q_idx, kv_idx] == 0",
      "captures": [{"name": "doc", "dtype": "int32", "shape": [2147483647, 2147483647]}]})";
  refused("blockmask " + f.string() + " --q-len 64 --capture doc=docs:2 --device cpu",
          "--capture doc: [2147483647, 2147483647] values of 4 bytes would take 16.0 EiB");
  std::filesystem::remove(f);
}

TEST_CASE("ring-plan prints a ring's schedule and names a bad option", "[cli]") {
  const Result r = run_cli("ring-plan @document --ranks 2 --seq-len 1024 --capture doc=docs:2 "
                           "--sharding contiguous");
  INFO(r.output);
  CHECK(r.status == 0);
  // Two documents of 512 tokens, one per rank: the off-diagonal blocks are empty.
  CHECK(r.output.find("blocks computed 2 of 4, skipped 2; sends skipped 2 of 2") !=
        std::string::npos);
  refused("ring-plan @causal --ranks 4 --seq-len 1000",
          "seq_len 1000 must be a multiple of 8 chunks (4 ranks, zigzag) x 128-token tiles");
  refused("ring-plan @causal --ranks 0 --seq-len 1024", "--ranks: 0 is too small (at least 1)");
  refused("ring-plan @document --ranks 2 --seq-len 1024",
          "mask_mod reads capture 'doc': pass --capture doc=doc:S1,S2,...");
  refused("ring-plan @causal --ranks 2 --seq-len 1024 --sharding diagonal", "--sharding");
}

TEST_CASE("a description is printed with its control characters escaped", "[cli]") {
  const std::filesystem::path f =
      std::filesystem::temp_directory_path() / fmt::format("flexc_cli_{}.json", getpid());
  std::ofstream(f) << R"({"name": "x", "description": "red \u001b[31mALERT\u001b[0m\nline2 é"})";
  const Result r = run_cli("check " + f.string());
  std::filesystem::remove(f);
  CHECK(r.status == 0);
  CHECK(r.output.find("x: red \\x1b[31mALERT\\x1b[0m\\nline2 é\n") != std::string::npos);
  CHECK(r.output.find('\x1b') == std::string::npos);
}

TEST_CASE("backward options of flexc run are checked before the GPU is needed", "[cli]") {
  refused("run @noop --random 1,2,2,16,16,64 --dq /tmp/dq.npy", "--dq needs --backward");
  refused("run @noop --random 1,2,2,16,16,64 --dout /tmp/dout.npy", "--dout needs --backward");
  refused("run @noop --random 1,2,2,16,16,64 --atomic-dq", "--atomic-dq needs --backward");
  refused("run @noop --random 1,2,2,16,16,64 --deterministic", "--deterministic needs --backward");
  refused("run @noop --random 1,2,2,16,16,64 --backward --atomic-dq --deterministic",
          "--atomic-dq and --deterministic exclude each other");
  refused("run @alibi --random 1,2,2,16,16,64 --backward --capture-grad slope=/tmp/g.npy",
          "--capture-grad slope: pass the capture too (--capture slope=FILE.npy)");
  refused("run @alibi --random 1,2,2,16,16,64 --backward --capture-grad bias=/tmp/g.npy",
          "--capture-grad bias: 'alibi' declares no such capture");
  refused("run @document --random 1,2,2,16,16,64 --backward --capture-grad doc=/tmp/g.npy",
          "--capture-grad doc: the capture is int32, which has no gradient");
  refused("run @alibi --random 1,2,2,16,16,64 --backward --capture-grad slope=/tmp/a.npy "
          "--capture-grad slope=/tmp/b.npy",
          "--capture-grad slope given twice");
}

TEST_CASE("decode options of flexc run are checked before the GPU is needed", "[cli]") {
  refused("run @noop --random 1,2,2,1,64,64 --page-size 16", "--page-size needs --kv-lens");
  refused("run @noop --random 1,2,2,1,64,64 --splits 4", "--splits needs --kv-lens");
  refused("run @noop --random 2,2,2,1,64,64 --q-offsets 3,4",
          "--q-offsets: the forward (without --kv-lens) takes one offset");
  refused("run @noop --random 1,2,2,1,64,64 --kv-lens 12,x", "--kv-lens '12,x'");
  refused("run @noop --random 1,2,2,1,64,64 --kv-lens 12,", "--kv-lens '12,': expected one");
  refused("run @noop --random 1,2,2,1,64,64 --kv-lens -3", "--kv-lens");
  refused("run @noop --random 1,2,2,1,64,64 --kv-lens 12 --page-size 24",
          "--page-size 24 must be a power of two");
  refused("run @noop --random 1,2,2,1,64,64 --kv-lens 12 --splits 300", "--splits");
  refused("run @noop --random 1,2,2,1,64,64 --kv-lens 12 --backward",
          "--backward is not part of the decode path");
  refused("run @noop --random 1,2,2,1,64,64 --seq-lens 100",
          "--seq-lens: expected Q,KV, the sequence's two lengths");
  refused("run @noop --random 1,2,2,1,64,64 --seq-lens 100,0", "--seq-lens '100,0'");
  refused("run @noop --random 1,2,2,1,64,64 --kv-lens 12 --kv-offset 5",
          "--kv-offset is for a block of a longer sequence, not the decode path (--kv-lens)");
}

TEST_CASE("precision on the command line overrides a config's, and is fast, exact or approx",
          "[cli]") {
  const Result fast = run_cli("check @softcap");
  CHECK(fast.status == 0);
  CHECK(fast.output.find("    math      fast\n") != std::string::npos);
  const Result exact = run_cli("check @softcap --precision exact");
  CHECK(exact.status == 0);
  CHECK(exact.output.find("    math      exact\n") != std::string::npos);
  const Result approx = run_cli("check @softcap --precision approx");
  CHECK(approx.status == 0);
  CHECK(approx.output.find("    math      approx\n") != std::string::npos);
  // The generated hooks say which.
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / fmt::format("flexc_cli_{}", getpid());
  const Result cu = run_cli("compile @softcap --precision exact --arch sm_80 --kernel mods_eval "
                          "--emit cu -o " + dir.string());
  CHECK(cu.status == 0);
  std::ifstream in(dir / "softcap.mods_eval.sm_80.cu");
  const std::string text{std::istreambuf_iterator<char>(in), {}};
  CHECK(text.find("(exact float math in score_mod)") != std::string::npos);
  std::filesystem::remove_all(dir);
  refused("check @softcap --precision fastest", "--precision");
  refused("run @softcap --random 1,1,1,8,8,64 --precision approximate", "--precision");
}

TEST_CASE("linear-attention configs: check prints them, compile builds them, run checks options",
          "[cli][linear]") {
  const Result retnet = run_cli("check @retnet");
  INFO(retnet.output);
  CHECK(retnet.status == 0);
  CHECK(retnet.output.find("gate        per_head") != std::string::npos);
  CHECK(retnet.output.find("log_decay   log(1.0 - exp2(float(-5 - h)))") != std::string::npos);
  CHECK(retnet.output.find("-0.031748697") != std::string::npos);  // log(1 - 1/32)
  const Result all = run_cli("check --catalogue");
  for (const char* name : {"gla:", "simple_gla:", "retnet:", "linear:", "alibi:"})
    CHECK(all.output.find(name) != std::string::npos);
  const Result built = run_cli("compile @simple_gla --arch sm_90 --head-dim 64 --gate-dtype bf16");
  INFO(built.output);
  CHECK(built.status == 0);
  CHECK(built.output.find("simple_gla: gla (sm_90)") != std::string::npos);
  CHECK(built.output.find("simple_gla: gla_backward (sm_90)") != std::string::npos);
  refused("compile @gla --arch sm_90 --gate-dtype int32", "gate dtype must be float32, bf16 or fp16");
  refused("compile @gla --arch sm_90 --head-dim 96", "head dim 96 is not supported");
  refused("run @gla --random 1,2,2,16,64 --lse /tmp/lse.npy",
          "--lse: an option of attention variants; '@gla' is a linear-attention config");
  refused("run @gla --random 1,2,2,16,64 --dq /tmp/dq.npy", "--dq needs --backward");
  refused("run @retnet --random 1,2,2,16,64 --g /tmp/g.npy",
          "--g: 'retnet' has a per_head gate, which takes no gate tensor");
  refused("run @gla --random 1,2,2,16", "expected B,H,HK,T,DK[,DV] for a linear-attention config");
  refused("run @causal --random 1,2,2,16,16,64 --g /tmp/g.npy", "--g: the gates of a linear-attention");
  const auto dir = std::filesystem::temp_directory_path();
  const auto write = [&](const char* name, const char* text) {
    const auto f = dir / name;
    std::ofstream(f) << text;
    return f.string();
  };
  refused("check " + write("flexc_lin1.json",
                           R"j({"name": "x", "kind": "linear", "gate": "per_hed"})j"),
          "gate: expected one of per_dim, per_step, per_head, none, got \"per_hed\" (did you "
          "mean \"per_head\"?)");
  refused("check " + write("flexc_lin2.json", R"j({"name": "x", "kind": "linear", "gate":
          "per_head", "log_decay": "-0.1 * kv_idx"})j"),
          "log_decay: reads kv_idx; a fixed decay per head is an expression of h alone");
  refused("check " + write("flexc_lin3.json", R"j({"name": "x", "kind": "linear", "gate":
          "per_head", "log_decay": "0.5 - h"})j"),
          "log_decay is 0.5 at h = 0; a log decay must be <= 0");
  refused("check " + write("flexc_lin4.json",
                           R"j({"name": "x", "kind": "linear", "gate": "per_head"})j"),
          "missing key \"log_decay\"");
  refused("check " + write("flexc_lin5.json", R"j({"name": "x", "kind": "linear", "gate":
          "per_dim", "log_decay": "-1.0"})j"),
          "log_decay: only a per_head gate has a log_decay");
  refused("check " + write("flexc_lin6.json", R"j({"name": "x", "kind": "linear", "gate":
          "per_head", "log_decay": "log(1 - exp2(-5 - hh))"})j"),
          "log_decay:1:19: error: unknown name 'hh'");
}

TEST_CASE("flexc run: linear-attention configs pass their forward and backward checks",
          "[cli][linear][gpu]") {
  if (!flexc::gpu_available()) {
    WARN("no GPU: skipped");
    return;
  }
  for (const char* config : {"@gla", "@simple_gla", "@retnet", "@linear", "@linear_elu"}) {
    const Result r = run_cli(fmt::format("run {} --random 2,4,2,130,64,128 --check --backward --dtype "
                                       "fp16",
                                       config));
    INFO(r.output);
    CHECK(r.status == 0);
    CHECK(r.output.find("check (seed") != std::string::npos);
    CHECK(r.output.find("check backward (seed") != std::string::npos);
    CHECK(r.output.find("FAIL") == std::string::npos);
  }
}

TEST_CASE("flexc run --ranks: ring attention's options are checked before the GPU is needed",
          "[cli][ring]") {
  refused("run @causal --random 1,2,2,512,512,64 --ranks 2 --kv-offset 5",
          "--kv-offset is not part of ring attention (--ranks)");
  refused("run @causal --random 1,2,2,512,512,64 --ranks 2 --sharding diagonal",
          "--sharding 'diagonal': zigzag or contiguous");
  refused("run @causal --random 1,2,2,512,512,64 --ranks 0", "--ranks");
}

TEST_CASE("flexc run --ranks 2: ring attention equals attention on the whole sequence",
          "[cli][ring][gpu]") {
  if (flexc::device_count() < 2) {
    WARN("fewer than 2 GPUs: skipped");
    return;
  }
  // Over two GPUs (a thread and an NCCL communicator each), zigzag and contiguous shards, GQA,
  // both head dims and dtypes, captures indexed by position (document ids, alibi slopes), a
  // window whose far blocks are skipped; the gathered output and gradients (the ALiBi slopes'
  // summed over the ranks) checked against the float64 reference on the whole sequence.
  const std::string dir = std::filesystem::temp_directory_path().string();
  const std::string doc = dir + "/flexc_ring_doc.npy", slope = dir + "/flexc_ring_slope.npy";
  {
    // int32 [2048]: documents of 300 tokens; float32 [4]: ALiBi slopes.
    flexc::npy::Array ids{flexc::DType::I32, {2048}, std::vector<std::byte>(2048 * 4)};
    for (int32_t i = 0; i < 2048; ++i) {
      const int32_t id = i / 300;
      std::memcpy(ids.bytes.data() + 4 * i, &id, 4);
    }
    flexc::npy::write(doc, ids);
    const float slopes[] = {0.5f, 0.25f, 0.125f, 0.0625f};
    flexc::npy::write(slope, flexc::npy::from_float({4}, slopes));
  }
  const struct {
    std::string args;
    bool skips;     // some blocks are left out
    bool backward;  // the gradients too (their float64 check is the test's slow part)
  } cases[] = {
      {"@noop --random 1,4,2,2048,2048,128 --sharding zigzag", false, false},
      // dK / dV of rank 0's shard travel to rank 1 and come back; rank 1's stay.
      {"@causal --random 2,4,4,2048,2048,64 --sharding contiguous --dtype fp16", true, true},
      {"@causal --random 1,4,2,2048,2048,128 --sharding zigzag", true, true},  // chunk pairs above
      {"@sliding_window --random 1,4,2,2048,2048,128 --param window=200 --sharding contiguous",
       true, false},
      {"@document --random 1,4,2,2048,2048,64 --capture doc=" + doc + " --sharding zigzag", true,
       false},
      // The slopes' gradient: each rank's share, summed.
      {"@alibi --random 1,4,2,2048,2048,128 --capture slope=" + slope + " --dtype fp16", false,
       true},
  };
  for (const auto& c : cases) {
    const std::string args = c.args + " --ranks 2 --check" + (c.backward ? " --backward" : "");
    const Result r = run_cli("run " + args);
    INFO("flexc run " << args << "\n" << r.output);
    CHECK(r.status == 0);
    CHECK(r.output.find("PASS") != std::string::npos);
    CHECK(r.output.find("FAIL") == std::string::npos);
    CHECK((r.output.find("check backward") != std::string::npos) == c.backward);
    CHECK((r.output.find("skipped 0,") == std::string::npos) == c.skips);
  }
}
