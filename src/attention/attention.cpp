// flexc::attention: validation, kernel choice, launch. The kernels are
// templates/attention/attention_fwd.cuh (portable) and templates/attention/attention_fwd_sm90.cuh
// (Hopper).
#include "flexc/attention.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <unordered_map>

#include "attention/attention_args.h"
#include "attention/attention_checks.h"
#include "attention/attention_kernel.h"
#include "blockmask/blockmask_impl.h"
#include "flexc/error.h"
#include "jit/driver_api.h"
#include "templates/attention/attention_params.cuh"

// The host fills the struct the kernel receives by value: pin its layout (NVRTC lays plain
// structs out like g++; a change here must be deliberate).
static_assert(offsetof(FlexcAttentionParams, q_stride) == 40 &&
              offsetof(FlexcAttentionParams, batch) == 136 &&
              offsetof(FlexcAttentionParams, scale_log2) == 176 &&
              offsetof(FlexcAttentionParams, cu_seqlens_q) == 184 &&
              sizeof(FlexcAttentionParams) == 216);

namespace flexc {

namespace detail {

namespace {

// The head dims the forward kernels have tiles for (int64: checked before any int cast, which
// would wrap 2^32 + 128 to 128).
bool fwd_supports(int64_t d) {
  return d == 32 || d == 64 || d == 96 || d == 128 || d == 192 || d == 256;
}
constexpr const char* kFwdHeadDims = "32, 64, 96, 128, 192 or 256";

}  // namespace

TileConfig fwd_config(int head_dim, int v_head_dim) {
  // 4 warps of 32 query rows each where the registers allow (K / V fragments serve two row
  // tiles); 16 rows per warp for D = 96, 192 and 256, whose accumulators need the registers. Two
  // stages: K / V of the next tile load while this one is computed. Measured in docs/perf.md.
  // Tiles for the wider of the two head dims (D for q and k, Dv for v and the output).
  for (int d : {head_dim, v_head_dim})
    if (!fwd_supports(d))
      throw Error(fmt::format("head dim {} is not supported ({})", d, kFwdHeadDims));
  const int d_max = std::max(head_dim, v_head_dim);
  TileConfig c{};
  switch (d_max) {
    case 96:
      c = {64, 64, 128, 2, 0};
      break;
    case 192:
    case 256:
      c = {64, 32, 128, 2, 0};
      break;
    default:
      c = {128, 64, 128, 2, 0};
      break;  // 32, 64, 128
  }
  // Q (or O's staging, the wider), then the stages of K and V.
  c.smem_bytes = size_t(2) * (size_t(d_max) * c.block_m +
                              size_t(c.stages) * c.block_n * (head_dim + v_head_dim));
  return c;
}

bool fwd_sm90_supports(int head_dim) {
  return head_dim == 64 || head_dim == 96 || head_dim == 128 || head_dim == 192 || head_dim == 256;
}

int fwd_sm90_wide_n(int head_dim, int v_head_dim) {
  if (head_dim != v_head_dim) return 0;
  return head_dim == 128 ? 176 : head_dim == 192 ? 112 : head_dim == 256 ? 80 : 0;
}

TileConfig fwd_config_sm90(int head_dim, int v_head_dim, int block_m, bool wide) {
  // A producer warpgroup and two consumer warpgroups of 64 query rows (three at D 64, whose
  // products are half as long: FlashAttention-3's 192-row tiles, when the variant's hooks fit
  // their 160 registers), 128-wide kv tiles (the default BlockMask tile), K and V in two stages
  // each; then 9 mbarriers, the 8-word schedule ring, and 1024 bytes to align the tiles for
  // wgmma's swizzle (docs/perf.md). A 192-row tile spans two BlockMask rows of 128, whose
  // tiles its producer merges (BlockMask q tiles: multiples of 128). Above D 128, 64-wide kv
  // tiles: a consumer's O takes 96 or 128 of its 240 registers, and Q with two stages of K and
  // V must fit 227 KiB. D 96 is stored as two whole 64-column panels (TMA fills the last 32
  // with zeros). Head dims: q's and k's `head_dim`, v's and the output's `v_head_dim`. O is
  // staged apart from Q where both head dims are at most 128 (a persistent CTA then loads its
  // next Q during the last output's store), over Q otherwise. The barriers: 2 + 7 per stage;
  // beside the ring three words per stage (the staged loads' kv index, head and q row) and four
  // (the work item).
  for (int d : {head_dim, v_head_dim})
    if (!fwd_sm90_supports(d))
      throw Error(fmt::format("the Hopper kernel has no head dim {} (64, 96, 128, 192 or 256)", d));
  const bool three = head_dim == 64 && v_head_dim == 64;
  if (block_m == 0) block_m = three ? 192 : 128;
  if (block_m != 128 && !(block_m == 192 && three))
    throw Error(fmt::format("the Hopper kernel has no {}-row q tiles for head dims {} / {}",
                            block_m, head_dim, v_head_dim));
  // Threads: a producer warpgroup and one consumer warpgroup per 64 rows (the kernel asserts it).
  TileConfig c{block_m, 128, 128 * (1 + block_m / 64), 2, 0};
  c.mask_rows = 128;
  const auto panels = [](int d) { return size_t(d + 63) / 64 * 64; };  // whole swizzle panels
  // Wide kv tiles (FlashAttention-3's widths) keep O over Q, and no hook adds shared memory.
  const bool separate_o = head_dim <= 128 && v_head_dim <= 128 && !wide;
  const size_t q_and_o = separate_o ? panels(head_dim) + panels(v_head_dim)
                                    : std::max(panels(head_dim), panels(v_head_dim));
  const auto smem = [&](int block_n) {
    return size_t(2) * (q_and_o * c.block_m +
                        size_t(c.stages) * block_n * (panels(head_dim) + panels(v_head_dim))) +
           8 * (2 + 7 * c.stages) + 4 * (12 + 3 * c.stages) + 1024;
  };
  if (wide) {
    if (block_m != 128 || fwd_sm90_wide_n(head_dim, v_head_dim) == 0)
      throw Error(
          fmt::format("the Hopper kernel has no wide kv tiles for head dims {} / {} at "
                      "{}-row q tiles",
                      head_dim, v_head_dim, block_m));
    c.block_n = fwd_sm90_wide_n(head_dim, v_head_dim);
  } else if (v_head_dim > 128 ||
             smem(128) + fwd_hook_bytes(dsl::kMostLaunchFacts, c, true) > 227 * 1024) {
    // 128-wide kv tiles where O leaves the registers for them (Dv <= 128) and K and V fit twice
    // with the most any variant's hooks add (MLA's D 192 / Dv 128 does: 209 KiB and 7 KiB); 64
    // otherwise (D 256 / Dv 64's 225 KiB with a relative term's tables did not fit).
    c.block_n = 64;
  }
  c.smem_bytes = smem(c.block_n);
  return c;
}

int fwd_sm90_block_m(int head_dim, int v_head_dim, int64_t kv_len, bool mask_always_true,
                     bool block_mask) {
  // Measured (docs/perf.md, "D 64 under a mask at short lengths" and "D 64: a tile empty for a
  // consumer ..."): a 192-row tile spans two BlockMask rows and computes the union of their kv
  // tiles (the diagonal for rows that do not reach it); under a causal mask 128-row tiles, which
  // then run the persistent grid, are 12% faster at KV_LEN 1k and 4-5% slower at 2k; without a
  // mask 3% slower, and at 4k slower either way. The boundary between 1k and 2k is interpolated.
  // (The mask's text decides, not the BlockMask's counts: those may live on the device.)
  const bool d64 = head_dim == 64 && v_head_dim == 64;
  return d64 && kv_len <= 1536 && block_mask && !mask_always_true ? 128 : 0;
}

bool fwd_sm90_persistent(const TileConfig& c, int head_dim, int v_head_dim, int64_t kv_len,
                         int64_t items, int sms) {
  // Measured (docs/perf.md, "A persistent grid for short sequences"): +3-4% (no mask) and +8-13%
  // (causal) at D 128 and KV_LEN 1k; even at 4k, slower beyond (a CTA's K and V no longer stay
  // in L2 across items) and with D 64's three consumers (-4-8% at 1k).
  return c.block_m == 128 && head_dim <= 128 && v_head_dim <= 128 && kv_len <= 2048 && sms > 0 &&
         items > sms && items <= std::numeric_limits<int32_t>::max();
}

int fwd_sm90_q_chunks(const TileConfig& c, int head_dim, int v_head_dim) {
  // Measured (docs/perf.md, "Q in registers"): with 64-wide kv tiles D 192 +4-7%, D 256 (half of
  // Q) +2-12%; with 128-wide ones D 96 +2-5%, but D 128 +1% dense and -2-6% for some of the
  // gallery (sigmoid-bound and sparse masks), D 64's 128-row tiles and D 192 / Dv 128 within
  // the noise. Q's and O's registers together stay within 160 of a consumer's 240 (D 256's ten
  // chunks spilled); D 64's 192-row consumers have 160 in all.
  if (c.block_m != 128) return 0;
  if (c.block_n == 64) return std::min(head_dim / 16, (160 - v_head_dim / 2) / 4);
  // Wide kv tiles: as many as fit beside O, S and P in 212 registers (D 128: 4, D 192: 8, D 256:
  // 6; the kernel keeps at most 4 beside a score_mod other than the identity).
  if (c.block_n != 128)
    return std::min(head_dim / 16, (212 - v_head_dim / 2 - 3 * c.block_n / 4) / 4);
  return head_dim == 96 ? head_dim / 16 : 0;
}

int64_t fwd_sm90_tile_tma_bytes(const TileConfig& c, int head_dim, int v_head_dim) {
  const int64_t separate_o = head_dim <= 128 && v_head_dim <= 128
                                 ? int64_t(2) * ((v_head_dim + 63) / 64 * 64) * c.block_m
                                 : 0;
  return int64_t(c.stages) * (int64_t(2) * c.block_m * c.block_n + 16) - separate_o;
}

size_t fwd_hook_bytes(const dsl::LaunchFacts& facts, const TileConfig& c, bool hopper) {
  // Relative-term tables: the portable kernel's two; the Hopper kernel's one per consumer in each
  // stage.
  const size_t tables = hopper ? size_t(c.threads / 128 - 1) * c.stages : 2;
  const size_t rel = tables * 256 * 4 * facts.score_rel_terms;
  return rel + (hopper ? size_t(c.stages) * c.block_n * 4 * facts.column_loads : 0);
}

// The Hopper kernel loads with TMA, whose descriptors need a positive stride below 2^40 bytes on
// every dim longer than 1 (no stride-0 broadcast of k or v over heads, say). An empty tensor is
// never loaded.
bool tma_fits(const TensorView& t) {
  if (detail::is_empty(t)) return true;
  for (size_t i = 0; i < 3; ++i)
    if (t.shape[i] > 1 && (t.stride(i) == 0 || t.stride(i) >= (int64_t(1) << 39))) return false;
  return true;
}

namespace {
// A TMA descriptor of 16-bit tensor `t` seen as `rank` dims (innermost first; strides in bytes
// of the dims above the first), boxes of `box`, written in the 128-byte swizzle wgmma reads.
FlexcTensorMap encode_map(const TensorView& t, cuuint32_t rank, const cuuint64_t* dims,
                          const cuuint64_t* strides, const cuuint32_t* box, std::string_view what) {
  static_assert(sizeof(CUtensorMap) == sizeof(FlexcTensorMap));
  const jit::DriverApi& d = jit::driver("building a TMA descriptor for a Hopper kernel");
  const cuuint32_t unit[4] = {1, 1, 1, 1};
  CUtensorMap map;
  jit::check(d.cuTensorMapEncodeTiled(&map,
                                      t.dtype == DType::BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                             : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                                      rank, t.data, dims, strides, box, unit,
                                      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
             fmt::format("building a TMA descriptor for {}{}", what, t.describe()));
  FlexcTensorMap out;
  std::memcpy(&out, &map, sizeof out);
  return out;
}
}  // namespace

// The TMA descriptor of a [B, H, S, D] tensor for the Hopper kernel: boxes of 64 columns (one
// 128-byte swizzle panel) x `rows` rows of one head; rows past S read as zeros.
FlexcTensorMap tensor_map(const TensorView& t, uint32_t rows) {
  const int64_t es = 2;  // bf16 / fp16
  // Innermost first: D, S, H, B. A dim of size 1 is never stepped along, so its stride is free;
  // it gets one row's bytes, which meets TMA's rules (a multiple of 16, below 2^40) whatever
  // the view says (0, or a huge stride from as_strided).
  const cuuint64_t dims[4] = {cuuint64_t(t.shape[3]), cuuint64_t(std::max<int64_t>(t.shape[2], 1)),
                              cuuint64_t(t.shape[1]), cuuint64_t(t.shape[0])};
  cuuint64_t strides[3];
  for (int i = 0; i < 3; ++i) {
    const int dim = 2 - i;  // S, H, B
    strides[i] = dims[i + 1] == 1 ? cuuint64_t(t.shape[3] * es) : cuuint64_t(t.stride(dim) * es);
  }
  const cuuint32_t box[4] = {64, rows, 1, 1};
  return encode_map(t, 4, dims, strides, box, "");
}

std::optional<FlexcTensorMap> tile_map(const TensorView& t, int kv_dim, int q_dim, uint32_t rows) {
  const int rank = int(t.rank());
  if ((t.dtype != DType::BF16 && t.dtype != DType::F16) || kv_dim < 0 || q_dim < 0 ||
      kv_dim >= rank || q_dim >= rank || reinterpret_cast<uintptr_t>(t.data) % 16 != 0)
    return std::nullopt;
  const int64_t pitch = t.stride(q_dim), keys = t.shape[kv_dim];
  if ((t.stride(kv_dim) != 1 && keys > 1) || pitch <= 0 || pitch % 8 != 0 || pitch < keys ||
      pitch >= (int64_t(1) << 39))
    return std::nullopt;
  int64_t last = 0;  // the offset of the last element outside the kv dim
  for (int d = 0; d < rank; ++d) {
    if (d == kv_dim || t.shape[d] <= 1) continue;
    if (t.stride(d) <= 0 || t.stride(d) % pitch != 0) return std::nullopt;
    last += (t.shape[d] - 1) * t.stride(d);
  }
  const int64_t row_count = last / pitch + 1;
  if (row_count > std::numeric_limits<int32_t>::max()) return std::nullopt;
  const cuuint64_t dims[2] = {cuuint64_t(keys), cuuint64_t(row_count)};
  const cuuint64_t strides[1] = {cuuint64_t(pitch * 2)};
  const cuuint32_t box[2] = {64, rows};
  return encode_map(t, 2, dims, strides, box, "the tile load of ");
}

std::string hopper_misfit(
    std::string_view kernel, const std::function<TileConfig()>& config, const BlockMask* bm,
    std::initializer_list<std::pair<const char*, const TensorView*>> tensors) {
  TileConfig c;
  try {
    c = config();
  } catch (const Error& e) {  // no configuration for this head dim: the message says which
    return e.what();
  }
  const int rows = c.mask_rows > 0 ? c.mask_rows : c.block_m;
  if (bm && !tiles_fit(*bm, rows, c.block_n))
    return fmt::format("block_mask tiles {} x {} must be multiples of the {}'s {} x {}",
                       bm->q_tile(), bm->kv_tile(), kernel, rows, c.block_n);
  for (auto [name, t] : tensors)
    if (!tma_fits(*t))
      return fmt::format(
          "the Hopper kernel needs a nonzero stride on every dim of {} longer than "
          "1 (below 2^39 elements); {}",
          name, t->describe());
  return {};
}

}  // namespace detail

namespace jit {

void check_dtype(std::string_view kernel, const KernelConfig& cfg) {
  if (cfg.dtype != "bf16" && cfg.dtype != "fp16")
    throw Error(fmt::format("{}: dtype '{}' is not supported (bf16 or fp16)", kernel, cfg.dtype));
}

void check_sm90_arch(std::string_view kernel, const KernelConfig& cfg) {
  // wgmma exists only in the arch-specific sm_90a target.
  if (!cfg.arch.empty() && cfg.arch != "sm_90" && cfg.arch != "sm_90a")
    throw Error(fmt::format("{} is built for sm_90a (wgmma); not for '{}'", kernel, cfg.arch));
}

int v_head_dim(const KernelConfig& cfg) { return cfg.v_head_dim ? cfg.v_head_dim : cfg.head_dim; }

KernelSpec attention_fwd_spec(const KernelConfig& cfg) {
  const detail::TileConfig c = detail::fwd_config(cfg.head_dim, v_head_dim(cfg));
  check_dtype("attention_fwd", cfg);
  KernelSpec spec{"attention_fwd.cuh",
                  "flexc_attention_fwd",
                  {{"FLEXC_HEAD_DIM", std::to_string(cfg.head_dim)},
                   {"FLEXC_HEAD_DIM_V", std::to_string(v_head_dim(cfg))},
                   {"FLEXC_BF16", cfg.dtype == "bf16" ? "1" : "0"},
                   {"FLEXC_BLOCK_M", std::to_string(c.block_m)},
                   {"FLEXC_BLOCK_N", std::to_string(c.block_n)},
                   {"FLEXC_WARPS", std::to_string(c.threads / 32)},
                   {"FLEXC_STAGES", std::to_string(c.stages)}},
                  cfg.arch};
  add_build_defines(cfg, spec.defines);
  return spec;
}

KernelSpec attention_fwd_sm90_spec(const KernelConfig& cfg) {
  const detail::TileConfig c =
      detail::fwd_config_sm90(cfg.head_dim, v_head_dim(cfg), cfg.block_m, cfg.wide_kv);
  check_dtype("attention_fwd_sm90", cfg);
  check_sm90_arch("attention_fwd_sm90", cfg);
  if (cfg.varlen && cfg.tile_tma)
    throw Error("attention_fwd_sm90 over packed sequences (varlen) takes no tile TMA");
  KernelSpec spec{
      "attention_fwd_sm90.cuh",
      "flexc_attention_fwd_sm90",
      {{"FLEXC_HEAD_DIM", std::to_string(cfg.head_dim)},
       {"FLEXC_HEAD_DIM_V", std::to_string(v_head_dim(cfg))},
       {"FLEXC_BF16", cfg.dtype == "bf16" ? "1" : "0"},
       {"FLEXC_BLOCK_M", std::to_string(c.block_m)},
       {"FLEXC_BLOCK_N", std::to_string(c.block_n)},
       {"FLEXC_STAGES", std::to_string(c.stages)},
       {"FLEXC_PERSISTENT", cfg.persistent ? "1" : "0"},
       {"FLEXC_TILE_TMA", cfg.tile_tma ? "1" : "0"},
       {"FLEXC_Q_REGS",
        std::to_string(cfg.smem_q ? 0
                                  : detail::fwd_sm90_q_chunks(c, cfg.head_dim, v_head_dim(cfg)))}},
      "sm_90a"};
  add_build_defines(cfg, spec.defines);
  return spec;
}

}  // namespace jit

namespace {

constexpr int64_t kMaxInt = std::numeric_limits<int32_t>::max();

constexpr std::string_view kWhat = "flexc::attention";
[[noreturn]] void fail(const std::string& msg) { throw Error(fmt::format("{}: {}", kWhat, msg)); }

constexpr std::pair<FwdKernel, std::string_view> kFwdKernelNames[] = {
    {FwdKernel::Auto, "auto"}, {FwdKernel::Portable, "portable"}, {FwdKernel::Hopper, "hopper"}};
}  // namespace

std::string_view to_string(FwdKernel k) {
  for (auto [kernel, name] : kFwdKernelNames)
    if (kernel == k) return name;
  return "?";
}

FwdKernel parse_fwd_kernel(std::string_view name) {
  for (auto [kernel, n] : kFwdKernelNames)
    if (n == name) return kernel;
  throw Error(fmt::format("unknown forward kernel '{}' (auto, portable or hopper)", name));
}

namespace {

// Packed sequences (AttentionOptions::packed) as the kernels see them: the tensors as one batch
// of their rows ([1, H, TOTAL, D] views), the LSE as [1, Hq, TOTAL_Q], and the sequences.
struct Packed {
  TensorView q, k, v, out;
  std::optional<TensorView> lse;
  int64_t count = 0;  // sequences
};

// [TOTAL, H, D] as [1, H, TOTAL, D] (the kernels' layout); other ranks fail, naming `name`.
TensorView rows_as_batch(const TensorView& t, const char* name, const char* shape) {
  if (t.rank() != 3 || (!t.strides.empty() && t.strides.size() != 3))
    fail(fmt::format("packed sequences: {} must be {}; got {}", name, shape, t.describe()));
  const int64_t st = t.stride(0), sh = t.stride(1), sd = t.stride(2);
  return {t.data, t.dtype, {1, t.shape[1], t.shape[0], t.shape[2]}, {st * t.shape[0], sh, st, sd}};
}

Packed packed_views(const TensorView& q, const TensorView& k, const TensorView& v,
                    const TensorView& out, const AttentionOptions& opts) {
  const PackedSequences& ps = *opts.packed;
  Packed pk;
  pk.q = rows_as_batch(q, "q", "[TOTAL_Q, Hq, D]");
  pk.k = rows_as_batch(k, "k", "[TOTAL_KV, Hkv, D]");
  pk.v = rows_as_batch(v, "v", "[TOTAL_KV, Hkv, Dv]");
  pk.out = rows_as_batch(out, "out", "[TOTAL_Q, Hq, Dv]");
  const TensorView& cq = ps.cu_seqlens_q;
  if (cq.rank() != 1 || cq.shape[0] < 2)
    fail(fmt::format("packed.cu_seqlens_q must be int32 [B + 1], B >= 1; got {}", cq.describe()));
  pk.count = cq.shape[0] - 1;
  detail::check_int_vector(kWhat, "packed.cu_seqlens_q", cq, pk.count + 1, "B + 1");
  detail::check_int_vector(kWhat, "packed.cu_seqlens_kv", ps.cu_seqlens_kv, pk.count + 1, "B + 1");
  const int64_t total_q = q.shape[0], total_kv = k.shape[0], Hq = q.shape[1], D = q.shape[2];
  // The shapes in the caller's terms (forward() checks the views again).
  if (k.shape[2] != D)
    fail(fmt::format("packed sequences: k must be [TOTAL_KV, Hkv, D] = [*, *, {}] like q; got {}",
                     D, k.describe()));
  if (v.shape[0] != total_kv || v.shape[1] != k.shape[1])
    fail(fmt::format("packed sequences: v must be [TOTAL_KV, Hkv, Dv] = [{}, {}, *] like k; got {}",
                     total_kv, k.shape[1], v.describe()));
  if (out.shape != std::vector<int64_t>{total_q, Hq, v.shape[2]})
    fail(fmt::format("packed sequences: out must be [TOTAL_Q, Hq, Dv] = [{}, {}, {}]; got {}",
                     total_q, Hq, v.shape[2], out.describe()));
  // The kernels read the offsets while they write out and lse.
  for (auto [name, t] : {std::pair{"cu_seqlens_q", &cq}, {"cu_seqlens_kv", &ps.cu_seqlens_kv}}) {
    if (detail::overlap(out, *t)) fail(fmt::format("out overlaps packed.{}", name));
    if (opts.lse && detail::overlap(*opts.lse, *t))
      fail(fmt::format("lse overlaps packed.{}", name));
  }
  for (auto [name, len, total] : {std::tuple{"max_seqlen_q", ps.max_seqlen_q, total_q},
                                  {"max_seqlen_kv", ps.max_seqlen_kv, total_kv}})
    if (len < 0 || len > total)
      fail(fmt::format("packed.{} = {} must lie in [0, {}] (the packed rows)", name, len, total));
  if (opts.q_offset || opts.kv_offset || opts.seq_q_len || opts.seq_kv_len || opts.accumulate)
    fail("packed sequences take no q_offset, kv_offset, seq_q_len, seq_kv_len or accumulate");
  if (opts.lse) {
    const TensorView& l = *opts.lse;
    if (l.dtype != DType::F32 || l.shape != std::vector<int64_t>{Hq, total_q} ||
        (!l.strides.empty() && l.strides != std::vector<int64_t>{total_q, 1}) ||
        l.data == nullptr || reinterpret_cast<uintptr_t>(l.data) % 4 != 0)
      fail(
          fmt::format("lse must be contiguous float32 [Hq, TOTAL_Q] = [{}, {}] with packed "
                      "sequences; got {}",
                      Hq, total_q, l.describe()));
    pk.lse = TensorView{l.data, l.dtype, {1, Hq, total_q}, {}};
  }
  if (ps.check_device_args) {
    for (auto [name, t, total, max] :
         {std::tuple{"cu_seqlens_q", &cq, total_q, ps.max_seqlen_q},
          {"cu_seqlens_kv", &ps.cu_seqlens_kv, total_kv, ps.max_seqlen_kv}}) {
      const std::vector<int32_t> cu = detail::int32_to_host(kWhat, *t, pk.count + 1, opts.stream);
      if (cu[0] != 0 || cu.back() != total)
        fail(fmt::format("packed.{} must run from 0 to {} (the packed rows); it runs from {} to {}",
                         name, total, cu[0], cu.back()));
      for (int64_t b = 0; b < pk.count; ++b)
        if (cu[b + 1] < cu[b] || cu[b + 1] - cu[b] > max)
          fail(
              fmt::format("packed.{}: sequence {} has {} rows ({} .. {}); 0 to {} (max_seqlen) "
                          "allowed",
                          name, b, int64_t(cu[b + 1]) - cu[b], cu[b], cu[b + 1], max));
    }
  }
  return pk;
}

// flexc::attention, and with `enqueue` false prepare_attention: every check and choice, the
// kernel compiled, loaded and its shared memory raised, then nothing enqueued. With `packed`,
// q / k / v / out and opts.lse are its views.
void forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
             const Variant& variant, const AttentionOptions& opts, bool enqueue,
             const Packed* packed = nullptr) {
  const DType dtype = q.dtype;
  detail::check_qkv(kWhat, "q", q, dtype);
  detail::check_qkv(kWhat, "k", k, dtype);
  detail::check_qkv(kWhat, "v", v, dtype);
  // out: q's dtype, or float32 (unrounded: a part merged later, as ring attention's blocks).
  detail::check_qkv(kWhat, "out", out, dtype, /*or_f32=*/true);
  const int64_t Hq = q.shape[1], D = q.shape[3], Hkv = k.shape[1], Dv = v.shape[3];
  {
    const int64_t B = q.shape[0], q_len = q.shape[2], kv_len = k.shape[2];
    if (k.shape[0] != B || k.shape[3] != D)
      fail(fmt::format("k must be [B, Hkv, KV_LEN, D] = [{}, *, *, {}] like q; got {}", B, D,
                       k.describe()));
    if (v.shape[0] != B || v.shape[1] != Hkv || v.shape[2] != kv_len)
      fail(fmt::format("v must be [B, Hkv, KV_LEN, Dv] = [{}, {}, {}, *] like k; got {}", B, Hkv,
                       kv_len, v.describe()));
    if (out.shape != std::vector<int64_t>{B, Hq, q_len, Dv})
      fail(fmt::format(
          "out must be [B, Hq, Q_LEN, Dv] = [{}, {}, {}, {}] (q's, with v's head dim); got {}", B,
          Hq, q_len, Dv, out.describe()));
    detail::check_sizes(kWhat, B, Hq, Hkv, q_len, kv_len);
    if (opts.lse) detail::check_rows(kWhat, "lse", *opts.lse, B, Hq, q_len);
  }
  // The kernel's batch and lengths: packed sequences' count and longest, else the tensors'.
  const int64_t B = packed ? packed->count : q.shape[0];
  const int64_t q_len = packed ? opts.packed->max_seqlen_q : q.shape[2];
  const int64_t kv_len = packed ? opts.packed->max_seqlen_kv : k.shape[2];
  if (packed) detail::check_sizes(kWhat, B, Hq, Hkv, q_len, kv_len);
  for (auto [name, d] : {std::pair{"q", D}, {"v", Dv}})
    if (!detail::fwd_supports(d))
      fail(fmt::format("{}: head dim {} is not supported ({})", name, d, detail::kFwdHeadDims));
  const detail::TileConfig portable = detail::fwd_config(int(D), int(Dv));
  // Why the Hopper kernel cannot take this call, whatever the GPU (empty: it can).
  std::string hopper_misfit = detail::hopper_misfit(
      "Hopper kernel", [&] { return detail::fwd_config_sm90(int(D), int(Dv)); }, opts.block_mask,
      {{"q", &q}, {"k", &k}, {"v", &v}});
  // Its grid is (heads, q tiles) for a head-shared [Q_LEN, KV_LEN] capture (dsl::LaunchFacts),
  // and a grid's y is at most 65535: checked only when the q tiles exceed that.
  // (Tiles of 128 rows, the smallest it may run.)
  if (hopper_misfit.empty() && (q_len + 127) / 128 > 65535 &&
      detail::impl_of(variant).facts.score_tiles_share_heads)
    hopper_misfit = fmt::format(
        "the Hopper kernel reads a [Q_LEN, KV_LEN] capture with the heads of a q tile together, "
        "at most 65535 q tiles of 128 rows; Q_LEN {} is more",
        q_len);
  if (opts.kernel == FwdKernel::Hopper && !hopper_misfit.empty()) fail(hopper_misfit);
  const double scale = opts.scale.value_or(1.0 / std::sqrt(static_cast<double>(D)));
  if (!(std::isfinite(scale) && scale > 0))
    fail(fmt::format("scale must be finite and > 0; got {}", scale));
  const detail::Positions pos =
      detail::resolve_positions(kWhat, q_len, kv_len, opts.q_offset, opts.kv_offset, opts.seq_q_len,
                                opts.seq_kv_len, kMaxInt - 256);
  if (opts.accumulate && (out.dtype != DType::F32 || !opts.lse))
    fail(fmt::format("accumulate merges into a float32 out and its lse; out is {}{}",
                     dtype_name(out.dtype), opts.lse ? "" : " and lse is not set"));
  // The kernel writes out (and lse) while reading q / k / v: an output element written twice, or
  // an output sharing memory with another operand, gives a result that depends on block order.
  if (detail::self_overlaps(out))
    fail(fmt::format("out has elements that share memory (a stride 0 or too small); {}",
                     out.describe()));
  for (auto [name, in] : {std::pair{"q", &q}, {"k", &k}, {"v", &v}})
    if (detail::overlap(out, *in)) fail(fmt::format("out overlaps {}", name));
  if (opts.lse)
    for (auto [name, t] : {std::pair{"out", &out}, {"q", &q}, {"k", &k}, {"v", &v}})
      if (detail::overlap(*opts.lse, *t)) fail(fmt::format("lse overlaps {}", name));
  if (packed && opts.block_mask && (variant.mask_deps().q_len || variant.mask_deps().kv_len))
    fail(
        "packed sequences: mask_mod reads q_len or kv_len, which differ by sequence, so one "
        "BlockMask cannot serve them all; pass none (mask_mod then runs on every tile)");
  if (opts.block_mask) {
    detail::check_block_mask(kWhat, *opts.block_mask, B, Hq, q_len, kv_len, pos, portable.block_m,
                             portable.block_n);
  }

  const detail::VariantImpl& impl = detail::impl_of(variant);
  const std::string what = fmt::format("flexc::attention for '{}'", impl.name);
  const std::vector<double> params = detail::resolve_params(impl, opts.params, what);
  const auto captures =
      detail::resolve_captures(impl, opts.captures, {B, Hq, pos.seq_q_len, pos.seq_kv_len}, what);
  if (q_len == 0) return;

  const detail::DeviceLimits dev = detail::device_limits();
  if (dev.major < 8)
    fail(fmt::format("needs a GPU of compute capability 8.0 or newer; this one is {}.{}", dev.major,
                     dev.minor));
  // The Hopper kernel where it runs and has the head dim (and the BlockMask's tiles split into
  // its 128 x 128 ones, which the default tiles do); the portable one elsewhere.
  const bool hopper = detail::use_hopper(opts.kernel, dev, hopper_misfit, kWhat);
  jit::KernelConfig kc{"", dtype == DType::BF16 ? "bf16" : "fp16", int(D), int(Dv)};
  if (hopper)
    kc.block_m = detail::fwd_sm90_block_m(int(D), int(Dv), kv_len, variant.mask_always_true(),
                                          opts.block_mask != nullptr);
  detail::TileConfig cfg = hopper ? detail::fwd_config_sm90(int(D), int(Dv), kc.block_m) : portable;
  if (cfg.smem_bytes > dev.max_smem)
    fail(fmt::format("head dim {} needs {} KiB of shared memory per block; this GPU allows {} KiB",
                     D, cfg.smem_bytes / 1024, dev.max_smem / 1024));
  kc.positions = pos.need_kernel(q_len, kv_len, true);
  kc.f32_out = out.dtype == DType::F32, kc.accumulate = opts.accumulate;
  kc.varlen = packed != nullptr;
  // Short sequences on Hopper: a persistent grid (over packed sequences, by the longest).
  kc.persistent = hopper && detail::fwd_sm90_persistent(
                                cfg, int(D), int(Dv), kv_len,
                                (q_len + cfg.block_m - 1) / cfg.block_m * Hq * B, dev.sms);
  // score_mod's [Q_LEN, KV_LEN] tile load by TMA on Hopper, where the capture's layout and shared
  // memory allow (templates/attention/attention_fwd_sm90.cuh, kTileTma).
  const dsl::LaunchFacts& facts = impl.facts;
  // Dynamic shared memory: the tiles', the hooks', and with tile loads by TMA theirs.
  const auto smem_of = [&](bool tma) {
    return int64_t(cfg.smem_bytes + detail::fwd_hook_bytes(facts, cfg, hopper)) +
           (tma ? detail::fwd_sm90_tile_tma_bytes(cfg, int(D), int(Dv)) : 0);
  };
  std::optional<FlexcTensorMap> tile_map;
  const auto tile_tma = [&] {
    tile_map.reset();
    if (!hopper || packed || facts.score_tile_slot < 0 || facts.score_tile_q_dim < 0 ||
        captures[size_t(facts.score_tile_slot)] == nullptr)
      return false;
    if (smem_of(true) > int64_t(std::min<size_t>(dev.max_smem, 227 * 1024))) return false;
    tile_map = detail::tile_map(*captures[size_t(facts.score_tile_slot)], facts.score_tile_kv_dim,
                                facts.score_tile_q_dim, uint32_t(cfg.block_m));
    return tile_map.has_value();
  };
  kc.tile_tma = tile_tma();
  // Wide kv tiles where the hooks stage nothing per tile (at D 128 beside the identity only:
  // softcap and sigmoid-bound gallery variants lost 2-4% there), without a BlockMask or over one
  // whose kv tiles are wider (a kernel tile then straddles at most two: KvStraddle in
  // templates/tile/attention_tile.cuh), with tile indices below 2^24 (the schedule's words).
  const int wide_n = detail::fwd_sm90_wide_n(int(D), int(Dv));
  kc.wide_kv = hopper && wide_n > 0 && !kc.persistent && !kc.tile_tma && cfg.block_m == 128 &&
               (!opts.block_mask || opts.block_mask->kv_tile() > wide_n) &&
               kv_len < (int64_t(1) << 24) * wide_n && facts.score_rel_terms == 0 &&
               facts.column_loads == 0 && facts.score_tile_slot < 0 &&
               (D != 128 || facts.forward_identity);
  if (kc.wide_kv) cfg = detail::fwd_config_sm90(int(D), int(Dv), kc.block_m, true);
  const jit::Kernel* kernel = &jit::get_kernel(
      variant, hopper ? jit::attention_fwd_sm90_spec(kc) : jit::attention_fwd_spec(kc));
  // Where a variant's hooks spill in the build asked for, the kernel gives up registers in this
  // order (each rebuild only where it still spills): Q's fragments (24-48 registers of a
  // consumer's, worth 2-12%), the persistent grid's work item held across the loop, D 64's
  // 192-row tiles (their consumers have 160 registers; hooks that hold column or tile loads
  // across the wait need more; D 64 keeps no Q fragments at 128 rows either).
  const auto spills = [&] { return kernel->local_bytes() > 0; };
  const auto rebuild = [&] {
    kernel = &jit::get_kernel(variant, jit::attention_fwd_sm90_spec(kc));
  };
  if (kc.wide_kv && spills()) {
    kc.wide_kv = false;
    cfg = detail::fwd_config_sm90(int(D), int(Dv), kc.block_m);
    rebuild();
  }
  if (hopper && spills() && detail::fwd_sm90_q_chunks(cfg, int(D), int(Dv)) > 0)
    kc.smem_q = true, rebuild();
  if (kc.persistent && spills()) kc.persistent = false, rebuild();
  if (hopper && cfg.block_m > 128 && spills()) {
    kc.block_m = 128;
    cfg = detail::fwd_config_sm90(int(D), int(Dv), kc.block_m);
    kc.tile_tma = tile_tma();
    rebuild();
  }
  const size_t smem = size_t(smem_of(kc.tile_tma));
  kernel->reserve_smem(smem);
  FlexcBlockMask bm{};
  if (opts.block_mask) bm = detail::device_view(*opts.block_mask, opts.stream);
  if (!enqueue) return;
  FlexcAttentionParams p{};
  p.q = q.data, p.k = k.data, p.v = v.data, p.o = out.data;
  p.lse = opts.lse ? static_cast<float*>(opts.lse->data) : nullptr;
  for (int i = 0; i < 3; ++i) {
    p.q_stride[i] = q.stride(i), p.k_stride[i] = k.stride(i);
    p.v_stride[i] = v.stride(i), p.o_stride[i] = out.stride(i);
  }
  p.batch = int(B), p.q_heads = int(Hq), p.kv_heads = int(Hkv);
  p.q_len = int(q_len), p.kv_len = int(kv_len);
  p.q_pos0 = int(pos.q_offset), p.kv_pos0 = int(pos.kv_offset);
  p.hook_q_len = int(pos.seq_q_len), p.hook_kv_len = int(pos.seq_kv_len);
  p.scale = static_cast<float>(scale);
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  if (packed) {
    // One batch of rows: each CTA finds its sequence's from cu_seqlens.
    p.q_stride[0] = p.k_stride[0] = p.v_stride[0] = p.o_stride[0] = 0;
    p.cu_seqlens_q = static_cast<const int*>(opts.packed->cu_seqlens_q.data);
    p.cu_seqlens_kv = static_cast<const int*>(opts.packed->cu_seqlens_kv.data);
    p.total_q = int(q.shape[2]), p.total_kv = int(k.shape[2]);
  }
  FlexcArgs args = detail::kernel_args(impl, params, captures);
  // The Hopper kernel also takes the TMA descriptors of q, k and v, and of its tile load (unused
  // without kTileTma).
  FlexcTensorMap maps[4]{};
  std::vector<void*> argv = {&p, &args, &bm};
  if (hopper) {
    maps[0] = detail::tensor_map(q, uint32_t(cfg.block_m));
    maps[1] = detail::tensor_map(k, uint32_t(cfg.block_n));
    maps[2] = detail::tensor_map(v, uint32_t(cfg.block_n));
    if (tile_map) maps[3] = *tile_map;
    for (FlexcTensorMap& m : maps) argv.push_back(&m);
  }
  const unsigned q_tiles = unsigned((q_len + cfg.block_m - 1) / cfg.block_m);
  // A CTA per work item (q tile, head, batch), or one per SM looping over them
  // (templates/attention/attention_fwd_sm90.cuh, Items).
  if (kc.persistent) {
    kernel->launch(unsigned(std::min<int64_t>(dev.sms, int64_t(q_tiles) * Hq * B)), 1, 1,
                   unsigned(cfg.threads), smem, opts.stream, argv.data());
    return;
  }
  const bool heads_first = hopper && facts.score_tiles_share_heads;
  kernel->launch(heads_first ? unsigned(Hq) : q_tiles, heads_first ? q_tiles : unsigned(Hq),
                 unsigned(B), unsigned(cfg.threads), smem, opts.stream, argv.data());
}

// forward() over the tensors as given, or over packed sequences' views.
void forward_call(const TensorView& q, const TensorView& k, const TensorView& v,
                  const TensorView& out, const Variant& variant, const AttentionOptions& opts,
                  bool enqueue) {
  if (!opts.packed) return forward(q, k, v, out, variant, opts, enqueue);
  const Packed pk = packed_views(q, k, v, out, opts);
  AttentionOptions o = opts;
  o.lse = pk.lse;
  forward(pk.q, pk.k, pk.v, pk.out, variant, o, enqueue, &pk);
}

}  // namespace

void attention(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
               const Variant& variant, const AttentionOptions& opts) {
  forward_call(q, k, v, out, variant, opts, true);
}

void prepare_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                       const TensorView& out, const Variant& variant,
                       const AttentionOptions& opts) {
  forward_call(q, k, v, out, variant, opts, false);
}

}  // namespace flexc
