// `flexc ring-plan CONFIG.json|@name --ranks N --seq-len S ...`: ring attention's schedule for a
// variant (flexc/ring.h): per step the shard pair each rank computes or skips, the K/V sends,
// and the balance of the work across ranks, for contiguous or zigzag sharding.
#include <fmt/format.h>

#include <memory>
#include <string>
#include <vector>

#include "cli/args.h"
#include "cli/command.h"
#include "cli/mask_captures.h"
#include "flexc/error.h"
#include "flexc/ring.h"

namespace flexc::cli {
namespace {

struct Options {
  std::string config, sharding = "zigzag", dtype = "bf16";
  int64_t ranks = 0, seq_len = 0, batch = 1, heads = 1, kv_heads = 0, head_dim = 128, tile = 128;
  int64_t send_cost_bytes = RingPlanOptions{}.send_cost_bytes;
  std::vector<std::string> params, captures;
};

void run(const Options& o) {
  const Variant v = Variant::load(o.config);
  RingShape shape;
  shape.ranks = o.ranks;
  shape.seq_len = o.seq_len;
  shape.batch = o.batch;
  shape.q_heads = o.heads;
  shape.kv_heads = o.kv_heads ? o.kv_heads : o.heads;
  shape.head_dim = o.head_dim;
  shape.dtype = o.dtype == "fp16" ? DType::F16 : DType::BF16;
  shape.sharding = o.sharding == "contiguous" ? Sharding::Contiguous : Sharding::Zigzag;
  RingPlanOptions ro;
  ro.tile = o.tile;
  ro.send_cost_bytes = o.send_cost_bytes;
  for (const auto& [name, value] : assignments(o.params, "--param"))
    ro.params[name] = parse_number(value, "--param " + name);
  const MaskCaptures docs =
      document_captures(v, o.captures, o.batch, o.heads, o.seq_len, o.seq_len);
  ro.captures = docs.captures;
  fmt::print("{}", to_string(plan_ring(v, shape, ro)));
}

const Register reg("ring-plan", [](CLI::App& app) {
  auto o = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand(
      "ring-plan",
      "Ring attention's schedule for a variant: per ring step the K/V shard each rank holds and "
      "whether its block has work (the BlockMask decides), the K/V sends still needed, and how "
      "evenly the ranks' work spreads (docs/ring.md).");
  cmd->add_option("config", o->config, "JSON variant config, or @name from the catalogue")
      ->required();
  cmd->add_option("--ranks", o->ranks, "GPUs in the ring")->required()->check(int_range(1));
  cmd->add_option("--seq-len", o->seq_len, "tokens of the whole sequence")
      ->required()
      ->check(int_range(1));
  cmd->add_option("--sharding", o->sharding,
                  "zigzag (rank r holds chunks r and 2N-1-r; the default) or contiguous")
      ->check(CLI::IsMember({"zigzag", "contiguous"}));
  cmd->add_option("--batch", o->batch, "batch size B")->check(int_range(1));
  cmd->add_option("--heads", o->heads, "query heads")->check(int_range(1));
  cmd->add_option("--kv-heads", o->kv_heads, "key/value heads (default: --heads)")
      ->check(int_range(1));
  cmd->add_option("--head-dim", o->head_dim, "head dim of k and v (the bytes sent)")
      ->check(int_range(1));
  cmd->add_option("--dtype", o->dtype, "k and v: bf16 or fp16")
      ->check(CLI::IsMember({"bf16", "fp16"}));
  cmd->add_option("--tile", o->tile, "BlockMask tile size (default 128)")->check(int_range(1));
  cmd->add_option("--send-cost-bytes", o->send_cost_bytes,
                  "what one more NCCL send costs in bytes of link: rows of a shard go as a send "
                  "per (batch, head) where that leaves out more (default 2 MiB; 0: always)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--param", o->params, "runtime param value, NAME=VALUE (repeatable)");
  cmd->add_option("--capture", o->captures,
                  "document ids for an int32 capture: NAME=doc:S1,S2,... or NAME=docs:N "
                  "(repeatable)");
  cmd->callback([o] { run(*o); });
});

}  // namespace
}  // namespace flexc::cli
