// flexc::decode: validation, the split rule, workspace and launch of
// templates/attention/attention_decode.cuh and its combine.
#include "flexc/decode.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

#include "attention/attention_args.h"
#include "attention/attention_checks.h"
#include "attention/attention_kernel.h"
#include "flexc/error.h"
#include "jit/driver_api.h"
#include "templates/attention/attention_params.cuh"

// The host fills the struct the kernel receives by value: pin its layout.
static_assert(offsetof(FlexcDecodeParams, q_stride) == 80 &&
              offsetof(FlexcDecodeParams, batch) == 184 && sizeof(FlexcDecodeParams) == 224);
static_assert(offsetof(FlexcCombineParams, out_stride) == 32 && sizeof(FlexcCombineParams) == 80);

namespace flexc {

namespace detail {

DecodeConfig decode_config(int head_dim, int v_head_dim, int64_t rows) {
  for (int d : {head_dim, v_head_dim})
    if (d % 32 != 0 || d < 32 || d > 256)
      throw Error(fmt::format("decode: head dim {} is not supported (32, 64, ..., 256)", d));
  DecodeConfig c;
  // 32 query rows per CTA when a kv head has more than 16 (and O's accumulators leave room):
  // fewer CTAs re-reading the same K / V. Three stages of 64 keys: two tiles in flight per CTA,
  // two CTAs per SM; 2 or 4 stages, or 128-key tiles, measured the same or slower (docs/perf.md).
  c.mt = rows > 16 && v_head_dim <= 128 ? 2 : 1;
  c.stages = 3;
  c.block_n = 64;
  const int block_n = c.block_n, warps = 4, q_rows = 16 * c.mt;
  const size_t loop = size_t(2) * (size_t(q_rows) * head_dim +
                                   size_t(c.stages) * block_n * (head_dim + v_head_dim));
  const size_t merge = size_t(4) * warps * q_rows * (v_head_dim + 4 + 2);
  c.smem_bytes = std::max(loop, merge);
  c.rows = q_rows;
  return c;
}

}  // namespace detail

namespace jit {

KernelSpec attention_decode_spec(const KernelConfig& cfg, int mt) {
  check_dtype("attention_decode", cfg);
  const int dv = cfg.v_head_dim ? cfg.v_head_dim : cfg.head_dim;
  const detail::DecodeConfig c = detail::decode_config(cfg.head_dim, dv, mt > 1 ? 32 : 16);
  return {"attention_decode.cuh",
          "flexc_attention_decode",
          {{"FLEXC_HEAD_DIM", std::to_string(cfg.head_dim)},
           {"FLEXC_HEAD_DIM_V", std::to_string(dv)},
           {"FLEXC_BF16", cfg.dtype == "bf16" ? "1" : "0"},
           {"FLEXC_DECODE_MT", std::to_string(c.mt)},
           {"FLEXC_BLOCK_N", std::to_string(c.block_n)},
           {"FLEXC_STAGES", std::to_string(c.stages)}},
          cfg.arch};
}

KernelSpec attention_decode_spec(const KernelConfig& cfg) { return attention_decode_spec(cfg, 1); }

}  // namespace jit

namespace {

constexpr std::string_view kWhat = "flexc::decode";
[[noreturn]] void fail(const std::string& msg) { throw Error(fmt::format("{}: {}", kWhat, msg)); }

constexpr int64_t kMaxInt = std::numeric_limits<int32_t>::max();

// DecodeOptions::check_device_args: the device data against the sizes.
void check_device_args(const KvCache& c, int64_t B, int64_t q_len, int64_t capacity,
                       int64_t page_size, int64_t num_pages, CUstream stream) {
  const std::vector<int32_t> lens = detail::int32_to_host(kWhat, c.kv_lens, B, stream);
  std::vector<int32_t> offsets;
  if (c.q_offsets) offsets = detail::int32_to_host(kWhat, *c.q_offsets, B, stream);
  for (int64_t b = 0; b < B; ++b) {
    if (lens[b] < 0 || lens[b] > capacity)
      fail(fmt::format("kv_lens[{}] = {} is outside [0, {}] (the cache's capacity{})", b, lens[b],
                       capacity, c.page_table ? ": page_table width x page size" : ""));
    if (c.q_offsets && (offsets[b] < 0 || int64_t(offsets[b]) + q_len > capacity))
      fail(fmt::format("q_offsets[{}] = {}: the queries' positions [{}, {}) must lie in [0, {})", b,
                       offsets[b], offsets[b], int64_t(offsets[b]) + q_len, capacity));
  }
  if (!c.page_table) return;
  const TensorView& pt = *c.page_table;
  const int64_t width = pt.shape[1], row = pt.stride(0);
  // The rows as strided in memory: read the span and pick the rows out.
  const int64_t span = (B - 1) * row + width;
  const std::vector<int32_t> table = detail::int32_to_host(kWhat, pt, span, stream);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t used = (lens[b] + page_size - 1) / page_size;
    for (int64_t i = 0; i < used; ++i) {
      const int32_t page = table[b * row + i];
      if (page < 0 || page >= num_pages)
        fail(
            fmt::format("page_table[{}, {}] = {} is outside [0, {}) (k's pages), and kv_lens[{}] "
                        "= {} uses it",
                        b, i, page, num_pages, b, lens[b]));
    }
  }
}

}  // namespace

int decode_splits(int64_t batch, int64_t kv_heads, int64_t row_blocks, int64_t max_kv_len,
                  int sms) {
  // FlashAttention's num_splits_heuristic: no split when the CTAs already fill most of a wave
  // (two CTAs per SM); else the fewest splits whose wave efficiency is within 95% of the best
  // (FlashAttention: 85%; a memory-bound kernel loses what an SM with one CTA leaves unread:
  // B 1 x 128k took 29 splits at 85%, 3784 GB/s, and 33 at 95%, 3894), skipping split counts that
  // give the same tiles per split as one fewer.
  const int64_t ctas = batch * kv_heads * row_blocks, slots = int64_t(std::max(sms, 1)) * 2;
  const int64_t tiles = std::max<int64_t>(1, (max_kv_len + 63) / 64);
  if (ctas >= slots * 8 / 10) return 1;
  const int64_t max_splits = std::min<int64_t>({256, slots, tiles});
  auto ceil_div = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  auto eligible = [&](int64_t s) { return s == 1 || ceil_div(tiles, s) != ceil_div(tiles, s - 1); };
  auto efficiency = [&](int64_t s) {
    const double waves = double(ctas * s) / double(slots);
    return waves / std::ceil(waves);
  };
  double best = 0;
  for (int64_t s = 1; s <= max_splits; ++s)
    if (eligible(s)) best = std::max(best, efficiency(s));
  for (int64_t s = 1; s <= max_splits; ++s)
    if (eligible(s) && efficiency(s) >= 0.95 * best) return int(s);
  return 1;
}

namespace {

// flexc::decode, and with `enqueue` false prepare_decode: every check (but check_device_args,
// which reads the device data) and choice, the kernels compiled and loaded, nothing enqueued.
void run_decode(const TensorView& q, const KvCache& cache, const TensorView& out,
                const Variant& variant, const DecodeOptions& opts, bool enqueue) {
  const DType dtype = q.dtype;
  const TensorView &k = cache.k, &v = cache.v;
  detail::check_qkv(kWhat, "q", q, dtype);
  detail::check_qkv(kWhat, "cache.k", k, dtype);
  detail::check_qkv(kWhat, "cache.v", v, dtype);
  detail::check_qkv(kWhat, "out", out, dtype);
  const int64_t B = q.shape[0], Hq = q.shape[1], q_len = q.shape[2], D = q.shape[3];
  const int64_t Hkv = k.shape[1], Dv = v.shape[3];
  const bool paged = cache.page_table.has_value();
  if (B < 1 || Hq < 1 || Hkv < 1 || Hq % Hkv != 0)
    fail(
        fmt::format("need B, Hq, Hkv >= 1 and Hq % Hkv == 0; got B {}, Hq {}, Hkv {} (cache.k's "
                    "dim 1)",
                    B, Hq, Hkv));
  if (B > 65535) fail(fmt::format("B = {} must be at most 65535", B));
  if (k.shape[3] != D)
    fail(fmt::format("cache.k's head dim {} differs from q's {}", k.shape[3], D));
  if (v.shape[0] != k.shape[0] || v.shape[1] != Hkv || v.shape[2] != k.shape[2])
    fail(fmt::format("cache.v must match cache.k but for the head dim: {} against {}", v.describe(),
                     k.describe()));
  if (out.shape != std::vector<int64_t>{B, Hq, q_len, Dv})
    fail(fmt::format("out must be [B, Hq, Q_LEN, Dv] = [{}, {}, {}, {}]; got {}", B, Hq, q_len, Dv,
                     out.describe()));
  int64_t capacity = 0, page_size = 0, num_pages = 0, page_shift = 0;
  if (paged) {
    const TensorView& pt = *cache.page_table;
    num_pages = k.shape[0], page_size = k.shape[2];
    if (page_size < 1 || (page_size & (page_size - 1)) != 0 || page_size > (int64_t(1) << 20))
      fail(fmt::format("the page size (cache.k's dim 2) must be a power of two up to 2^20; got {}",
                       page_size));
    while ((int64_t(1) << page_shift) < page_size) ++page_shift;
    if (num_pages < 1 || num_pages > kMaxInt)
      fail(fmt::format("cache.k must hold 1 to 2^31 - 1 pages; got {}", num_pages));
    if (pt.dtype != DType::I32 || pt.rank() != 2 || pt.shape[0] != B || pt.shape[1] < 1 ||
        pt.stride(1) != 1 || pt.stride(0) < 0 || pt.data == nullptr ||
        reinterpret_cast<uintptr_t>(pt.data) % 4 != 0)
      fail(
          fmt::format("cache.page_table must be int32 [B, MAX_PAGES] = [{}, *] with MAX_PAGES >= 1 "
                      "and contiguous rows; got {}",
                      B, pt.describe()));
    capacity = pt.shape[1] * page_size;
  } else {
    if (k.shape[0] != B)
      fail(
          fmt::format("a contiguous cache.k must be [B, Hkv, CAPACITY, D] with B = {}; got {} "
                      "(a paged cache needs cache.page_table)",
                      B, k.describe()));
    capacity = k.shape[2];
  }
  if (capacity > kMaxInt - 256)
    fail(fmt::format("the cache's capacity {} exceeds the kernel's int32 positions", capacity));
  detail::check_int_vector(kWhat, "cache.kv_lens", cache.kv_lens, B);
  if (cache.q_offsets) detail::check_int_vector(kWhat, "cache.q_offsets", *cache.q_offsets, B);
  if (q_len > kMaxInt / 256) fail(fmt::format("Q_LEN = {} is too large", q_len));
  const double scale = opts.scale.value_or(1.0 / std::sqrt(static_cast<double>(D)));
  if (!(std::isfinite(scale) && scale > 0))
    fail(fmt::format("scale must be finite and > 0; got {}", scale));
  if (opts.num_splits < 0 || opts.num_splits > 256)
    fail(fmt::format("num_splits must be 0 (automatic) or 1 to 256; got {}", opts.num_splits));
  if (opts.max_kv_len < 0 || opts.max_kv_len > capacity)
    fail(fmt::format("max_kv_len must be 0 (the capacity) or 1 to {}; got {}", capacity,
                     opts.max_kv_len));
  if (opts.lse) detail::check_rows(kWhat, "lse", *opts.lse, B, Hq, q_len);
  if (detail::self_overlaps(out))
    fail(fmt::format("out has elements that share memory; {}", out.describe()));
  for (auto [name, in] : {std::pair{"q", &q}, {"cache.k", &k}, {"cache.v", &v}})
    if (detail::overlap(out, *in)) fail(fmt::format("out overlaps {}", name));
  if (opts.lse)
    for (auto [name, t] : {std::pair{"out", &out}, {"q", &q}, {"cache.k", &k}, {"cache.v", &v}})
      if (detail::overlap(*opts.lse, *t)) fail(fmt::format("lse overlaps {}", name));

  if (q_len > 0 && Hq > kMaxInt / B / q_len)  // (divided: the product may not fit in int64)
    fail(fmt::format("B x Hq x Q_LEN = {} x {} x {} query rows exceed the kernels' int32 row index",
                     B, Hq, q_len));
  const int64_t rows = q_len * (Hq / Hkv);
  const detail::DecodeConfig cfg = detail::decode_config(int(D), int(Dv), rows);
  const detail::VariantImpl& impl = detail::impl_of(variant);
  const std::string what = fmt::format("{} for '{}'", kWhat, impl.name);
  const std::vector<double> params = detail::resolve_params(impl, opts.params, what);
  const auto captures =
      detail::resolve_captures(impl, opts.captures, {B, Hq, capacity, capacity}, what);
  if (q_len == 0) return;
  if (opts.check_device_args && enqueue)
    check_device_args(cache, B, q_len, capacity, page_size, num_pages, opts.stream);

  const detail::DeviceLimits dev = detail::device_limits();
  if (dev.major < 8)
    fail(fmt::format("needs a GPU of compute capability 8.0 or newer; this one is {}.{}", dev.major,
                     dev.minor));
  if (cfg.smem_bytes > dev.max_smem)
    fail(
        fmt::format("head dims {} / {} need {} KiB of shared memory per block; this GPU allows "
                    "{} KiB",
                    D, Dv, cfg.smem_bytes / 1024, dev.max_smem / 1024));
  const int64_t row_blocks = (rows + cfg.rows - 1) / cfg.rows;
  if (row_blocks * Hkv > 65535)
    fail(fmt::format("Q_LEN x Hq = {} query rows need too many blocks", rows * Hkv));
  const int splits = opts.num_splits
                         ? opts.num_splits
                         : decode_splits(B, Hkv, row_blocks,
                                         opts.max_kv_len ? opts.max_kv_len : capacity, dev.sms);

  const jit::KernelConfig kc{"", dtype == DType::BF16 ? "bf16" : "fp16", int(D), int(Dv)};
  jit::KernelSpec spec = jit::attention_decode_spec(kc, cfg.mt);
  const jit::Kernel& kernel = jit::get_kernel(variant, spec);
  kernel.reserve_smem(cfg.smem_bytes);
  const jit::Kernel* combine = nullptr;
  if (splits > 1) {
    spec.entry = "flexc_attention_combine";
    combine = &jit::get_kernel(variant, spec);
  }
  if (!enqueue) {
    if (splits > 1) detail::prepare_workspace(opts.workspace);
    return;
  }

  FlexcDecodeParams p{};
  p.q = q.data, p.k = k.data, p.v = v.data, p.o = out.data;
  p.lse = opts.lse ? static_cast<float*>(opts.lse->data) : nullptr;
  p.kv_lens = static_cast<const int*>(cache.kv_lens.data);
  p.q_offsets = cache.q_offsets ? static_cast<const int*>(cache.q_offsets->data) : nullptr;
  p.page_table = paged ? static_cast<const int*>(cache.page_table->data) : nullptr;
  p.page_table_stride = paged ? cache.page_table->stride(0) : 0;
  for (int i = 0; i < 3; ++i) {
    p.q_stride[i] = q.stride(i), p.o_stride[i] = out.stride(i);
    p.k_stride[i] = k.stride(i), p.v_stride[i] = v.stride(i);
  }
  p.batch = int(B), p.q_heads = int(Hq), p.kv_heads = int(Hkv), p.q_len = int(q_len);
  p.capacity = int(capacity), p.num_pages = int(num_pages), p.page_shift = int(page_shift);
  p.splits = splits;
  p.scale = static_cast<float>(scale);
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  FlexcArgs args = detail::kernel_args(impl, params, captures);

  const int64_t out_rows = B * Hq * q_len;
  std::optional<detail::StreamBuffer> work;
  if (splits > 1) {
    work.emplace(size_t(out_rows) * splits * (Dv + 1) * sizeof(float), opts.stream, opts.workspace,
                 kWhat);
    p.o_part = static_cast<float*>(work->get());
    p.lse_part = p.o_part + out_rows * splits * Dv;
  }
  void* argv[] = {&p, &args};
  kernel.launch(unsigned(splits), unsigned(row_blocks * Hkv), unsigned(B), 128, cfg.smem_bytes,
                opts.stream, argv);
  if (combine) {
    FlexcCombineParams c{};
    c.o_part = p.o_part, c.lse_part = p.lse_part, c.out = out.data, c.lse = p.lse;
    for (int i = 0; i < 3; ++i) c.out_stride[i] = out.stride(i);
    c.heads = int(Hq), c.q_len = int(q_len), c.rows = int(out_rows), c.parts = splits,
    c.dv = int(Dv);
    void* cargs[] = {&c};
    // Launched early (programmatic dependent launch): it starts as the decode CTAs finish their
    // loops and waits for their results, so its launch overlaps the decode's tail.
    combine->launch(unsigned((out_rows + 3) / 4), 1, 1, 128, 0, opts.stream, cargs, true);
  }
}

}  // namespace

void decode(const TensorView& q, const KvCache& cache, const TensorView& out,
            const Variant& variant, const DecodeOptions& opts) {
  run_decode(q, cache, out, variant, opts, true);
}

void prepare_decode(const TensorView& q, const KvCache& cache, const TensorView& out,
                    const Variant& variant, const DecodeOptions& opts) {
  run_decode(q, cache, out, variant, opts, false);
}

}  // namespace flexc
