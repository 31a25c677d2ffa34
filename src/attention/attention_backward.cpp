// flexc::attention_backward: validation, workspace, launch of the main kernel
// (templates/attention/attention_bwd.cuh or attention_bwd_sm90.cuh) between the per-row kernels of
// templates/attention/attention_bwd_rows.cuh (prep, then dq or the deterministic build's dq_rows).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "attention/attention_args.h"
#include "attention/attention_checks.h"
#include "attention/attention_kernel.h"
#include "blockmask/blockmask_impl.h"
#include "flexc/attention.h"
#include "flexc/error.h"
#include "jit/driver_api.h"
#include "templates/attention/attention_params.cuh"

static_assert(offsetof(FlexcAttentionBwdParams, dout) == sizeof(FlexcAttentionParams) &&
              offsetof(FlexcAttentionBwdParams, dlse) == sizeof(FlexcAttentionParams) + 128 &&
              sizeof(FlexcAttentionBwdParams) == sizeof(FlexcAttentionParams) + 152);

namespace flexc {

namespace detail {

TileConfig bwd_config(int head_dim) {
  // 64 kv rows per CTA (4 warps of 16: dK and dV of D = 128 take 128 registers a thread), 64 q
  // rows per step; shared memory: K, V, two stages of Q and dO, dS^T, two stages of LSE / delta.
  if (head_dim != 32 && head_dim != 64 && head_dim != 96 && head_dim != 128)
    throw Error(
        fmt::format("the backward kernel has no head dim {} (32, 64, 96 or 128)", head_dim));
  TileConfig c{64, 64, 128, 2, 0};
  c.smem_bytes = size_t(2) * head_dim * (2 * c.block_n + 2 * 2 * c.block_m) +
                 size_t(2) * c.block_n * c.block_m + 2 * 2 * size_t(4) * c.block_m;
  return c;
}

TileConfig bwd_config_sm90(int head_dim) {
  // A producer warpgroup and two consumers of 64 kv rows (128 per CTA, the default BlockMask
  // tile), 64 q rows per step; shared memory (templates/attention/attention_bwd_sm90.cuh): K, V,
  // two stages of Q and dO, two buffers of the CTA's dS^T (128 x 64), each consumer's float32 half
  // of dQ (64 x D / 2), two stages of LSE / delta rows, 5 mbarriers, and 1024 bytes to align the
  // tiles for wgmma's swizzle. The deterministic build leaves out dS^T and dQ but is launched with
  // the same size.
  if (head_dim != 64 && head_dim != 128)
    throw Error(fmt::format("the Hopper backward kernel has no head dim {} (64 or 128)", head_dim));
  TileConfig c{64, 128, 128 * 3, 2, 0};
  c.smem_bytes = size_t(2) * head_dim * (2 * c.block_n + 2 * 2 * c.block_m) +
                 2 * size_t(2) * c.block_n * c.block_m + size_t(4) * c.block_m * head_dim +
                 2 * 2 * size_t(4) * c.block_m + 8 * 5 + 1024;
  return c;
}

size_t bwd_dq_rows_smem(int head_dim) {
  const TileConfig c = bwd_config(head_dim);
  return size_t(2) * head_dim * (2 * c.block_m + 2 * 2 * c.block_n);  // Q, dO, 2 x (K, V)
}

}  // namespace detail

namespace jit {

namespace {

void check_backward_build(std::string_view kernel, const KernelConfig& cfg) {
  if (cfg.v_head_dim != 0 && cfg.v_head_dim != cfg.head_dim)
    throw Error(
        fmt::format("{}: v head dim {} differs from the head dim {} (the backward kernels "
                    "need them equal)",
                    kernel, cfg.v_head_dim, cfg.head_dim));
  if (cfg.varlen)
    throw Error(
        fmt::format("{} takes no packed sequences (varlen): the forward kernels do", kernel));
}

KernelSpec bwd_spec(const KernelConfig& cfg, bool deterministic) {
  const detail::TileConfig c = detail::bwd_config(cfg.head_dim);
  check_dtype("attention_bwd", cfg);
  check_backward_build("attention_bwd", cfg);
  KernelSpec spec{"attention_bwd.cuh",
                  "flexc_attention_bwd",
                  {{"FLEXC_HEAD_DIM", std::to_string(cfg.head_dim)},
                   {"FLEXC_BF16", cfg.dtype == "bf16" ? "1" : "0"},
                   {"FLEXC_BLOCK_M", std::to_string(c.block_m)},
                   {"FLEXC_BLOCK_N", std::to_string(c.block_n)},
                   {"FLEXC_WARPS", std::to_string(c.threads / 32)},
                   {"FLEXC_DETERMINISTIC", deterministic ? "1" : "0"}},
                  cfg.arch};
  add_build_defines(cfg, spec.defines);
  return spec;
}

KernelSpec bwd_sm90_spec(const KernelConfig& cfg, bool deterministic) {
  const detail::TileConfig c = detail::bwd_config_sm90(cfg.head_dim);
  check_dtype("attention_bwd_sm90", cfg);
  check_sm90_arch("attention_bwd_sm90", cfg);
  check_backward_build("attention_bwd_sm90", cfg);
  KernelSpec spec{"attention_bwd_sm90.cuh",
                  "flexc_attention_bwd_sm90",
                  {{"FLEXC_HEAD_DIM", std::to_string(cfg.head_dim)},
                   {"FLEXC_BF16", cfg.dtype == "bf16" ? "1" : "0"},
                   {"FLEXC_BLOCK_M", std::to_string(c.block_m)},
                   {"FLEXC_BLOCK_N", std::to_string(c.block_n)},
                   {"FLEXC_DETERMINISTIC", deterministic ? "1" : "0"}},
                  "sm_90a"};
  add_build_defines(cfg, spec.defines);
  return spec;
}

}  // namespace

KernelSpec attention_bwd_rows_spec(const KernelConfig& cfg) {
  check_dtype("attention_bwd_rows", cfg);
  check_backward_build("attention_bwd_rows", cfg);
  detail::bwd_config(cfg.head_dim);  // the head dims the backward takes
  KernelSpec spec{"attention_bwd_rows.cuh",
                  "flexc_attention_bwd_prep",
                  {{"FLEXC_HEAD_DIM", std::to_string(cfg.head_dim)},
                   {"FLEXC_BF16", cfg.dtype == "bf16" ? "1" : "0"}},
                  cfg.arch};
  add_f32_out_define(cfg, spec.defines);  // no position: a positions build shares the unit
  return spec;
}
KernelSpec attention_bwd_spec(const KernelConfig& cfg) { return bwd_spec(cfg, false); }
KernelSpec attention_bwd_deterministic_spec(const KernelConfig& cfg) { return bwd_spec(cfg, true); }
KernelSpec attention_bwd_sm90_spec(const KernelConfig& cfg) { return bwd_sm90_spec(cfg, false); }
KernelSpec attention_bwd_sm90_deterministic_spec(const KernelConfig& cfg) {
  return bwd_sm90_spec(cfg, true);
}

}  // namespace jit

namespace {

constexpr std::string_view kWhat = "flexc::attention_backward";
constexpr int64_t kMaxInt = std::numeric_limits<int32_t>::max();

[[noreturn]] void fail(const std::string& msg) { throw Error(fmt::format("{}: {}", kWhat, msg)); }

// flexc::attention_backward, and with `enqueue` false prepare_attention_backward: every check
// and choice, the kernels compiled, loaded and their shared memory raised, nothing enqueued.
void backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
              const TensorView& lse, const TensorView& dout, const AttentionGrads& grads,
              const Variant& variant, const BackwardOptions& opts, bool enqueue) {
  const DType dtype = q.dtype;
  const std::pair<const char*, const TensorView*> tensors[] = {{"q", &q},
                                                               {"k", &k},
                                                               {"v", &v},
                                                               {"out", &out},
                                                               {"dout", &dout},
                                                               {"grads.dq", &grads.dq},
                                                               {"grads.dk", &grads.dk},
                                                               {"grads.dv", &grads.dv}};
  // The gradients: q's dtype, or all three float32 (unrounded: parts summed later, as ring
  // attention sums its blocks').
  for (auto [name, t] : tensors) detail::check_qkv(kWhat, name, *t, dtype, name[0] == 'g');
  const bool grads_f32 = grads.dq.dtype == DType::F32;
  for (auto [name, t] : {std::pair{"grads.dk", &grads.dk}, {"grads.dv", &grads.dv}})
    if ((t->dtype == DType::F32) != grads_f32)
      fail(
          fmt::format("{} is {} but grads.dq is {}: the three gradients are q's dtype or all "
                      "float32",
                      name, dtype_name(t->dtype), dtype_name(grads.dq.dtype)));
  if (opts.accumulate && !grads_f32)
    fail(fmt::format("accumulate adds into float32 gradients; grads.dq, dk, dv are {}",
                     dtype_name(grads.dq.dtype)));
  const int64_t B = q.shape[0], Hq = q.shape[1], q_len = q.shape[2], D = q.shape[3];
  const int64_t Hkv = k.shape[1], kv_len = k.shape[2];
  if (k.shape[0] != B || k.shape[3] != D)
    fail(fmt::format("k must be [B, Hkv, KV_LEN, D] = [{}, *, *, {}] like q; got {}", B, D,
                     k.describe()));
  if (v.shape[3] != D)
    fail(
        fmt::format("v's head dim {} differs from q's and k's {}: the backward kernels need them "
                    "equal (the forward takes any pair)",
                    v.shape[3], D));
  for (auto [name, t] : {std::pair{"v", &v}, {"grads.dk", &grads.dk}, {"grads.dv", &grads.dv}})
    if (t->shape != k.shape)
      fail(fmt::format("{} must have k's shape; k {}, {} {}", name, k.describe(), name,
                       t->describe()));
  for (auto [name, t] : {std::pair{"out", &out}, {"dout", &dout}, {"grads.dq", &grads.dq}})
    if (t->shape != q.shape)
      fail(fmt::format("{} must have q's shape; q {}, {} {}", name, q.describe(), name,
                       t->describe()));
  detail::check_sizes(kWhat, B, Hq, Hkv, q_len, kv_len);
  if (D != 32 && D != 64 && D != 96 && D != 128)
    fail(fmt::format("q: head dim {} is not supported by the backward kernel (32, 64, 96 or 128)",
                     D));
  const detail::TileConfig cfg = detail::bwd_config(static_cast<int>(D));
  detail::check_rows(kWhat, "lse", lse, B, Hq, q_len);
  if (opts.dlse) detail::check_rows(kWhat, "dlse", *opts.dlse, B, Hq, q_len);
  const double scale = opts.scale.value_or(1.0 / std::sqrt(static_cast<double>(D)));
  if (!(std::isfinite(scale) && scale > 0))
    fail(fmt::format("scale must be finite and > 0; got {}", scale));
  // Outputs are written while the inputs are read: none may share memory with another operand.
  const std::pair<const char*, const TensorView*> outputs[] = {
      {"grads.dq", &grads.dq}, {"grads.dk", &grads.dk}, {"grads.dv", &grads.dv}};
  for (auto [name, o] : outputs) {
    if (detail::self_overlaps(*o))
      fail(fmt::format("{} has elements that share memory (a stride 0 or too small); {}", name,
                       o->describe()));
    for (auto [other, t] : tensors)
      if (t != o && detail::overlap(*o, *t)) fail(fmt::format("{} overlaps {}", name, other));
    if (detail::overlap(*o, lse)) fail(fmt::format("{} overlaps lse", name));
  }
  const detail::Positions pos =
      detail::resolve_positions(kWhat, q_len, kv_len, opts.q_offset, opts.kv_offset, opts.seq_q_len,
                                opts.seq_kv_len, kMaxInt - 256);
  if (opts.block_mask)
    detail::check_block_mask(kWhat, *opts.block_mask, B, Hq, q_len, kv_len, pos, cfg.block_m,
                             cfg.block_n);
  // Why the Hopper kernel cannot take this call, whatever the GPU (empty: it can).
  const std::string hopper_misfit = detail::hopper_misfit(
      "Hopper backward kernel", [&] { return detail::bwd_config_sm90(int(D)); }, opts.block_mask,
      {{"q", &q}, {"dout", &dout}, {"k", &k}, {"v", &v}});
  if (opts.kernel == FwdKernel::Hopper && !hopper_misfit.empty()) fail(hopper_misfit);

  const detail::VariantImpl& impl = detail::impl_of(variant);
  const std::string what = fmt::format("{} for '{}'", kWhat, impl.name);
  const detail::CallDims dims{B, Hq, pos.seq_q_len, pos.seq_kv_len};
  const std::vector<double> params = detail::resolve_params(impl, opts.params, what);
  const auto captures = detail::resolve_captures(impl, opts.captures, dims, what);
  FlexcArgs args = detail::kernel_args(impl, params, captures);
  // Capture gradients: float32, at the capture's element offsets (same shape and strides).
  for (const auto& [name, g] : grads.captures) {
    detail::check_capture_name(impl, name, what);
    size_t slot = 0;
    while (impl.decls.captures[slot].name != name) ++slot;
    const dsl::CaptureDecl& d = impl.decls.captures[slot];
    if (d.dtype == dsl::DType::I32 || d.dtype == dsl::DType::Bool)
      fail(fmt::format("grads.captures['{}']: capture '{}' is {}, which has no gradient", name,
                       name, dsl::dtype_name(d.dtype)));
    if (!captures[slot])
      fail(fmt::format("grads.captures['{}']: pass the capture itself in opts.captures too", name));
    const TensorView& c = *captures[slot];
    if (g.dtype != DType::F32 || g.shape != c.shape || g.data == nullptr ||
        reinterpret_cast<uintptr_t>(g.data) % 4 != 0)
      fail(fmt::format("grads.captures['{}'] must be float32 with the capture's shape [{}]; got {}",
                       name, fmt::join(c.shape, ", "), g.describe()));
    for (size_t i = 0; i < c.rank(); ++i)
      if (c.shape[i] > 1 && g.stride(i) != c.stride(i))
        fail(fmt::format("grads.captures['{}'] must have the capture's strides ({}); got {}", name,
                         c.describe(), g.describe()));
    args.captures[slot].grad = static_cast<float*>(g.data);
  }
  if (q_len == 0 && kv_len == 0) return;

  const detail::DeviceLimits dev = detail::device_limits();
  if (dev.major < 8)
    fail(fmt::format("needs a GPU of compute capability 8.0 or newer; this one is {}.{}", dev.major,
                     dev.minor));

  // The Hopper main kernel where it runs and takes the call; prep and dq from the per-row unit
  // (no hook: it compiles in a fraction of the time, once for every variant), dq_rows from the
  // portable template's deterministic build.
  const bool hopper = detail::use_hopper(opts.kernel, dev, hopper_misfit, kWhat);
  // dq's mode: the faster one for the kernel unless the caller chose (docs/perf.md).
  const bool deterministic = opts.deterministic.value_or(!hopper);
  const detail::TileConfig main_cfg = hopper ? detail::bwd_config_sm90(int(D)) : cfg;
  const size_t smem = std::max(main_cfg.smem_bytes, detail::bwd_dq_rows_smem(int(D)));
  if (smem > dev.max_smem)
    fail(fmt::format("head dim {} needs {} KiB of shared memory per block; this GPU allows {} KiB",
                     D, smem / 1024, dev.max_smem / 1024));

  jit::KernelConfig kc{"", dtype == DType::BF16 ? "bf16" : "fp16", int(D)};
  kc.positions = pos.need_kernel(q_len, kv_len, false);
  kc.f32_out = grads_f32, kc.accumulate = opts.accumulate;
  const jit::KernelSpec portable_spec =
      deterministic ? jit::attention_bwd_deterministic_spec(kc) : jit::attention_bwd_spec(kc);
  const jit::KernelSpec main_spec = !hopper         ? portable_spec
                                    : deterministic ? jit::attention_bwd_sm90_deterministic_spec(kc)
                                                    : jit::attention_bwd_sm90_spec(kc);
  const jit::KernelSpec prep_spec = jit::attention_bwd_rows_spec(kc);
  jit::KernelSpec dq_spec = deterministic ? portable_spec : prep_spec;
  dq_spec.entry = deterministic ? "flexc_attention_bwd_dq_rows" : "flexc_attention_bwd_dq";
  const jit::KernelSpec specs[] = {prep_spec, main_spec, dq_spec};
  const std::vector<const jit::Kernel*> kernels = jit::get_kernels(variant, specs);
  const size_t dq_rows_smem = detail::bwd_dq_rows_smem(int(D));
  kernels[1]->reserve_smem(main_cfg.smem_bytes);
  if (deterministic) kernels[2]->reserve_smem(dq_rows_smem);
  FlexcBlockMask bm{};
  if (opts.block_mask) bm = detail::device_view(*opts.block_mask, opts.stream);
  if (!enqueue) {
    detail::prepare_workspace(opts.workspace);
    return;
  }

  const int64_t rows = B * Hq * q_len;
  // delta, and (unless deterministic) the float32 dQ accumulator, 256-byte aligned (the Hopper
  // kernel adds into it with bulk copies) in blocks of 64 q rows per head (DqAccum in
  // templates/tile/attention_tile.cuh).
  const int64_t delta_floats = (rows + 63) / 64 * 64;
  const int64_t dq_floats = deterministic ? 0 : B * Hq * ((q_len + 63) / 64 * 64) * D;
  const detail::StreamBuffer work(static_cast<size_t>(delta_floats + dq_floats) * sizeof(float),
                                  opts.stream, opts.workspace, kWhat);
  FlexcAttentionBwdParams p{};
  FlexcAttentionParams& f = p.fwd;
  f.q = q.data, f.k = k.data, f.v = v.data, f.o = out.data;
  f.lse = static_cast<float*>(lse.data);
  p.dout = dout.data, p.dq = grads.dq.data, p.dk = grads.dk.data, p.dv = grads.dv.data;
  for (int i = 0; i < 3; ++i) {
    f.q_stride[i] = q.stride(i), f.k_stride[i] = k.stride(i);
    f.v_stride[i] = v.stride(i), f.o_stride[i] = out.stride(i);
    p.do_stride[i] = dout.stride(i), p.dq_stride[i] = grads.dq.stride(i);
    p.dk_stride[i] = grads.dk.stride(i), p.dv_stride[i] = grads.dv.stride(i);
  }
  f.batch = int(B), f.q_heads = int(Hq), f.kv_heads = int(Hkv);
  f.q_len = int(q_len), f.kv_len = int(kv_len);
  f.q_pos0 = int(pos.q_offset), f.kv_pos0 = int(pos.kv_offset);
  f.hook_q_len = int(pos.seq_q_len), f.hook_kv_len = int(pos.seq_kv_len);
  f.scale = static_cast<float>(scale);
  f.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  p.dlse = opts.dlse ? static_cast<const float*>(opts.dlse->data) : nullptr;
  p.delta = static_cast<float*>(work.get());
  p.dq_accum = deterministic ? nullptr : p.delta + delta_floats;

  // No queries: dk and dv are zeros (the main kernel visits no q tile). No keys: dq is zeros
  // (the accumulator prep zeroed).
  void* prep_args[] = {&p};
  void* main_args[] = {&p, &args, &bm};
  if (q_len > 0)
    kernels[0]->launch(unsigned((q_len + 7) / 8), unsigned(Hq), unsigned(B), 256, 0, opts.stream,
                       prep_args);
  // The Hopper kernel also takes the TMA descriptors of q, dout, k and v.
  FlexcTensorMap maps[4];
  std::vector<void*> main_argv(std::begin(main_args), std::end(main_args));
  if (hopper && kv_len > 0 && q_len > 0) {
    maps[0] = detail::tensor_map(q, uint32_t(main_cfg.block_m));
    maps[1] = detail::tensor_map(dout, uint32_t(main_cfg.block_m));
    maps[2] = detail::tensor_map(k, uint32_t(main_cfg.block_n));
    maps[3] = detail::tensor_map(v, uint32_t(main_cfg.block_n));
    for (FlexcTensorMap& m : maps) main_argv.push_back(&m);
  }
  if (kv_len > 0)
    kernels[1]->launch(unsigned((kv_len + main_cfg.block_n - 1) / main_cfg.block_n), unsigned(Hkv),
                       unsigned(B), unsigned(main_cfg.threads), main_cfg.smem_bytes, opts.stream,
                       main_argv.data());
  if (q_len > 0 && deterministic)
    kernels[2]->launch(unsigned((q_len + cfg.block_m - 1) / cfg.block_m), unsigned(Hq), unsigned(B),
                       unsigned(cfg.threads), dq_rows_smem, opts.stream, main_args);
  else if (q_len > 0)
    kernels[2]->launch(unsigned((q_len * (D / 8) + 255) / 256), unsigned(Hq), unsigned(B), 256, 0,
                       opts.stream, prep_args);
}

}  // namespace

void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& out, const TensorView& lse, const TensorView& dout,
                        const AttentionGrads& grads, const Variant& variant,
                        const BackwardOptions& opts) {
  backward(q, k, v, out, lse, dout, grads, variant, opts, true);
}

void prepare_attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                                const TensorView& out, const TensorView& lse,
                                const TensorView& dout, const AttentionGrads& grads,
                                const Variant& variant, const BackwardOptions& opts) {
  backward(q, k, v, out, lse, dout, grads, variant, opts, false);
}

}  // namespace flexc
