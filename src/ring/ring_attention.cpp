// flexc::RingAttention: ring attention's forward over NCCL (docs/ring.md). Each step computes this
// rank's (query chunk, K/V chunk) blocks of the shard it holds with flexc::attention at global
// positions, folds them into float32 accumulators (templates/attention_combine.cuh), and passes
// the shard on to the next rank on a stream of its own while the blocks run.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <vector>

#include "../../templates/attention_params.cuh"
#include "../attention_checks.h"
#include "../attention_kernel.h"
#include "flexc/device.h"
#include "flexc/error.h"
#include "flexc/ring.h"
#include "jit/driver_api.h"
#include "jit/jit.h"
#include "nccl.h"

namespace flexc {

namespace {

constexpr std::string_view kWhat = "flexc::RingAttention";
[[noreturn]] void fail(const std::string& msg) { throw Error(fmt::format("{}: {}", kWhat, msg)); }

// A CUDA event of the current context (no timing), destroyed with the object.
class Event {
 public:
  Event() {
    jit::check(jit::driver("creating a CUDA event").cuEventCreate(&e_, CU_EVENT_DISABLE_TIMING),
               "creating a CUDA event");
  }
  ~Event() {
    if (e_) jit::driver("destroying a CUDA event").cuEventDestroy(e_);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  // What `stream` has enqueued so far; work enqueued on `waiter` after wait() runs after it (the
  // record at the time of the wait: a later record does not change it).
  void record(CUstream stream) {
    jit::check(jit::driver("recording a CUDA event").cuEventRecord(e_, stream),
               "recording a CUDA event");
  }
  void wait(CUstream waiter) {
    jit::check(jit::driver("waiting for a CUDA event").cuStreamWaitEvent(waiter, e_, 0),
               "making a stream wait for an event");
  }
  void order(CUstream stream, CUstream waiter) { record(stream), wait(waiter); }

 private:
  CUevent e_ = nullptr;
};

// Rows [r0, r0 + n) of a [B, H, S, d] tensor, as a view with its strides.
TensorView rows_of(const TensorView& t, int64_t r0, int64_t n) {
  TensorView v = t;
  v.data = static_cast<char*>(t.data) + r0 * t.stride(2) * int64_t(dtype_size(t.dtype));
  v.shape[2] = n;
  v.strides = {t.stride(0), t.stride(1), t.stride(2), 1};
  return v;
}

// An NCCL group, ended however the scope is left (a group left open would defer every later
// NCCL call of this thread).
class Group {
 public:
  explicit Group(const nccl::Api& n) : n_(n) {
    nccl::check(n_, n_.ncclGroupStart(), kWhat, "ncclGroupStart");
  }
  ~Group() {
    if (open_) n_.ncclGroupEnd();
  }
  void end() {
    open_ = false;
    nccl::check(n_, n_.ncclGroupEnd(), kWhat, "ncclGroupEnd");
  }

 private:
  const nccl::Api& n_;
  bool open_ = true;
};

// A fingerprint of the plan's decisions every rank must agree on (which blocks compute, which
// shards are passed on): they follow from the params and mask captures, which the shape gather
// cannot see.
int64_t fingerprint(const RingPlan& plan) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](uint64_t x) { h = (h ^ x) * 1099511628211ull; };
  for (const RingStep& step : plan.steps) {
    for (bool p : step.passes) mix(p);
    for (const RingBlock& b : step.blocks)
      mix(uint64_t(b.full_tiles)), mix(uint64_t(b.partial_tiles));
  }
  return int64_t(h >> 1);
}

bool contiguous(const TensorView& t) {
  int64_t expect = 1;
  for (int i = int(t.rank()) - 1; i >= 0; --i) {
    if (t.shape[i] > 1 && t.stride(i) != expect) return false;
    expect *= t.shape[i];
  }
  return true;
}

}  // namespace

struct RingAttention::Impl {
  // One (query chunk, K/V chunk) block of a step: the chunks' indices in the two shards, their
  // positions, and its BlockMask (none: the mask is `true`); skipped when the mask leaves it empty.
  struct Block {
    int64_t q_chunk = 0, kv_chunk = 0;  // 0 or 1: which of the shard's chunks
    int64_t q_offset = 0, kv_offset = 0;
    std::optional<BlockMask> mask;
    bool computes = true;
  };

  Variant variant;
  ncclComm* comm = nullptr;
  const nccl::Api* nccl = nullptr;
  RingPlan plan;
  RingPlanOptions plan_opts;
  int64_t rank = 0, ranks = 0, shard_len = 0, per_rank = 1;
  int64_t dv = 0;
  std::vector<std::vector<Block>> steps;  // by step
  std::vector<bool> sends, recvs;         // by step: this rank passes its shard on / receives one
  size_t k_bytes = 0, v_bytes = 0;
  DeviceBuffer slots[2];  // K then V of a shard in flight (contiguous)
  DeviceBuffer acc;       // float32 [B, Hq, L, Dv] accumulators, then [B, Hq, L] LSE
  DeviceBuffer part;      // a block's output [B, Hq, C, Dv] (16-bit), then its LSE [B, Hq, C]
  // The ring's stream and the events ordering it with the caller's (made once the arguments are
  // checked: a bad one is reported before any CUDA work).
  struct Sync {
    Stream comm;
    Event computed, received, finished;
  };
  std::optional<Sync> sync;
  RingStats stats;

  Impl(const Variant& v, ncclComm* c) : variant(v), comm(c) {}

  void check_comm(const RingShape& shape);
  void check_same_everywhere(const RingShape& shape, const std::string& local_error);
  void build_blocks();
  void merge(const char* entry, FlexcMergeParams& p, int64_t rows, CUstream stream);
};

void RingAttention::Impl::check_comm(const RingShape& shape) {
  if (comm == nullptr) fail("comm is null: pass the NCCL communicator of the ring's ranks");
  nccl = &nccl::api(kWhat);
  int count = 0, r = 0, dev = 0;
  nccl::check(*nccl, nccl->ncclCommCount(comm, &count), kWhat, "ncclCommCount");
  nccl::check(*nccl, nccl->ncclCommUserRank(comm, &r), kWhat, "ncclCommUserRank");
  nccl::check(*nccl, nccl->ncclCommCuDevice(comm, &dev), kWhat, "ncclCommCuDevice");
  if (count != shape.ranks)
    fail(fmt::format("comm has {} ranks; shape.ranks is {}", count, shape.ranks));
  if (dev != current_device())
    fail(fmt::format("comm is on CUDA device {}, but the current device is {} (flexc::use_device)",
                     dev, current_device()));
  rank = r, ranks = count;
}

// Every rank must construct the ring with the same shape and plan: gathered and compared, so
// that a mismatch is an error here, not a hang (or garbage) in the first send. A rank whose own
// checks failed (`local_error`) joins the gather too: then every rank fails.
void RingAttention::Impl::check_same_everywhere(const RingShape& s,
                                                const std::string& local_error) {
  const char* names[] = {"status",  "ranks",    "seq_len",  "batch",
                         "q_heads", "kv_heads", "head_dim", "v_head_dim",
                         "dtype",   "sharding", "tile",     "plan (its params and mask captures)"};
  const bool ok = local_error.empty();
  const int64_t mine[] = {ok,
                          s.ranks,
                          s.seq_len,
                          s.batch,
                          s.q_heads,
                          s.kv_heads,
                          s.head_dim,
                          dv,
                          int64_t(s.dtype),
                          int64_t(s.sharding),
                          plan_opts.tile,
                          ok ? fingerprint(plan) : 0};
  constexpr size_t kFields = std::size(mine);
  DeviceBuffer send(sizeof(mine)), all(sizeof(mine) * size_t(ranks));
  send.upload(mine, sizeof(mine));
  synchronize_device();  // the upload ran on the legacy stream; the gather does not wait for it
  nccl::check(
      *nccl,
      nccl->ncclAllGather(send.get(), all.get(), kFields, nccl::kInt64, comm, sync->comm.get()),
      kWhat, "ncclAllGather (comparing the ranks' shapes)");
  sync->comm.synchronize();
  const std::vector<int64_t> got = all.to_vector<int64_t>(kFields * size_t(ranks));
  if (!ok) throw Error(local_error);
  for (int64_t r = 0; r < ranks; ++r)
    if (got[r * kFields] == 0)
      fail(fmt::format("rank {} could not construct the ring (its error says why)", r));
  for (int64_t r = 0; r < ranks; ++r)
    for (size_t f = 1; f < kFields; ++f)
      if (got[r * kFields + f] != mine[f])
        fail(
            fmt::format("rank {} has {} = {}; this rank ({}) has {}: every rank must construct "
                        "the ring with the same shape, params and mask captures",
                        r, names[f], got[r * kFields + f], rank, mine[f]));
}

void RingAttention::Impl::build_blocks() {
  const RingShape& s = plan.shape;
  const int64_t chunk = plan.chunk_len;
  BlockMaskOptions bmo;
  bmo.q_tile = bmo.kv_tile = plan_opts.tile;
  bmo.params = plan_opts.params;
  bmo.captures = plan_opts.captures;
  bmo.seq_q_len = bmo.seq_kv_len = s.seq_len;
  steps.resize(ranks);
  for (int64_t t = 0; t < ranks; ++t) {
    const int64_t src = (rank - t + ranks) % ranks;  // whose shard this rank holds at step t
    for (int64_t a = 0; a < per_rank; ++a)
      for (int64_t c = 0; c < per_rank; ++c) {
        Block b;
        b.q_chunk = a, b.kv_chunk = c;
        b.q_offset = plan.chunks[rank][a] * chunk, b.kv_offset = plan.chunks[src][c] * chunk;
        if (!variant.mask_always_true()) {
          bmo.q_offset = b.q_offset, bmo.kv_offset = b.kv_offset;
          b.mask.emplace(create_block_mask(variant, s.batch, s.q_heads, chunk, chunk, bmo));
          b.computes = b.mask->count(TileKind::Full) + b.mask->count(TileKind::Partial) > 0;
        }
        // The plan decides the sends from the whole sequence's mask; a block it calls empty has
        // nothing here either (the same analysis at tile-aligned chunks).
        if (b.computes && !plan.steps[t].blocks[rank].computes())
          fail(
              fmt::format("internal: step {} block ({}, {}) has tiles the plan does not", t, a, c));
        steps[t].push_back(std::move(b));
      }
  }
  sends.assign(ranks, false), recvs.assign(ranks, false);
  for (int64_t t = 0; t + 1 < ranks; ++t) {
    sends[t] = plan.steps[t].passes[rank];
    recvs[t] = plan.steps[t].passes[(rank - 1 + ranks) % ranks];
  }
}

void RingAttention::Impl::merge(const char* entry, FlexcMergeParams& p, int64_t rows,
                                CUstream stream) {
  const RingShape& s = plan.shape;
  jit::KernelConfig kc{"", s.dtype == DType::BF16 ? "bf16" : "fp16", int(s.head_dim), int(dv)};
  jit::KernelSpec spec = jit::attention_decode_spec(kc);  // attention_combine.cuh's module
  spec.entry = entry;
  const jit::Kernel& k = jit::get_kernel(variant, spec);
  void* argv[] = {&p};
  k.launch(unsigned((rows + 3) / 4), 1, 1, 128, 0, stream, argv);
}

RingAttention::RingAttention(const Variant& v, ncclComm* comm, const RingShape& shape,
                             const RingPlanOptions& opts)
    : impl_(std::make_unique<Impl>(v, comm)) {
  Impl& m = *impl_;
  m.plan_opts = opts;
  m.dv = shape.v_head_dim ? shape.v_head_dim : shape.head_dim;
  // This rank's own checks; with a usable communicator their failure is shared with every rank
  // (check_same_everywhere), so that none waits for this one.
  std::string local_error;
  try {
    if (shape.dtype != DType::BF16 && shape.dtype != DType::F16)
      fail(fmt::format("shape.dtype must be bf16 or fp16; got {}", dtype_name(shape.dtype)));
    m.plan = plan_ring(v, shape, opts);
  } catch (const Error& e) {
    local_error = e.what();
  }
  if (!local_error.empty() && comm == nullptr) throw Error(local_error);
  m.check_comm(shape);
  m.sync.emplace();
  m.check_same_everywhere(shape, local_error);
  m.per_rank = shape.sharding == Sharding::Zigzag ? 2 : 1;
  m.shard_len = shape.seq_len / shape.ranks;
  m.build_blocks();
  const int64_t kv_rows = shape.batch * shape.kv_heads * m.shard_len;
  const int64_t q_rows = shape.batch * shape.q_heads * m.shard_len;
  const int64_t part_rows = shape.batch * shape.q_heads * m.plan.chunk_len;
  const size_t elem = dtype_size(shape.dtype);
  m.k_bytes = size_t(kv_rows * shape.head_dim) * elem;
  m.v_bytes = size_t(kv_rows * m.dv) * elem;
  for (DeviceBuffer& slot : m.slots) slot = DeviceBuffer(m.k_bytes + m.v_bytes);
  m.acc = DeviceBuffer(size_t(q_rows * (m.dv + 1)) * sizeof(float));
  // The part's LSE after its output, 16-byte aligned.
  m.part = DeviceBuffer((size_t(part_rows * m.dv) * elem + 15) / 16 * 16 +
                        size_t(part_rows) * sizeof(float));
}

RingAttention::~RingAttention() = default;
RingAttention::RingAttention(RingAttention&&) noexcept = default;
RingAttention& RingAttention::operator=(RingAttention&&) noexcept = default;

const RingPlan& RingAttention::plan() const { return impl_->plan; }
int64_t RingAttention::rank() const { return impl_->rank; }
const RingStats& RingAttention::stats() const { return impl_->stats; }

void RingAttention::forward(const TensorView& q, const TensorView& k, const TensorView& v,
                            const TensorView& out, const RingForwardOptions& opts) {
  Impl& m = *impl_;
  const RingShape& s = m.plan.shape;
  const int64_t L = m.shard_len, C = m.plan.chunk_len, B = s.batch, Hq = s.q_heads;
  const struct {
    const char* name;
    const TensorView* t;
    std::vector<int64_t> shape;
  } args[] = {{"q", &q, {B, Hq, L, s.head_dim}},
              {"k", &k, {B, s.kv_heads, L, s.head_dim}},
              {"v", &v, {B, s.kv_heads, L, m.dv}},
              {"out", &out, {B, Hq, L, m.dv}}};
  for (const auto& a : args) {
    detail::check_qkv(kWhat, a.name, *a.t, s.dtype);
    if (a.t->shape != a.shape)
      fail(fmt::format("{} must be this rank's shard [{}] (S / ranks = {} rows); got {}", a.name,
                       fmt::join(a.shape, ", "), L, a.t->describe()));
  }
  // K and V go around the ring as they are: contiguous.
  for (const TensorView* t : {&k, &v})
    if (!contiguous(*t))
      fail(fmt::format("{} must be contiguous (it is sent to the next rank as is); got {}",
                       t == &k ? "k" : "v", t->describe()));
  if (opts.lse) detail::check_rows(kWhat, "lse", *opts.lse, B, Hq, L);

  const jit::DriverApi& d = jit::driver("running ring attention");
  Impl::Sync& sync = *m.sync;
  CUstream compute = opts.stream, comm = sync.comm.get();
  float* acc = static_cast<float*>(m.acc.get());
  float* acc_lse = acc + B * Hq * L * m.dv;
  jit::check(d.cuMemsetD8Async(m.acc.ptr(), 0, size_t(B * Hq * L * m.dv) * 4, compute),
             "clearing ring attention's accumulators");
  jit::check(d.cuMemsetD32Async(reinterpret_cast<CUdeviceptr>(acc_lse), 0xff800000u,
                                size_t(B * Hq * L), compute),
             "clearing ring attention's accumulators");  // -inf: no key seen yet
  const size_t elem = dtype_size(s.dtype);
  auto* part_out = static_cast<char*>(m.part.get());
  auto* part_lse =
      reinterpret_cast<float*>(part_out + (size_t(B * Hq * C * m.dv) * elem + 15) / 16 * 16);

  m.stats = {};
  bool communicated = false;
  for (int64_t t = 0; t < m.ranks; ++t) {
    // The shard held at step t: this rank's own at first, then the one received at step t - 1.
    char* slot = t == 0 ? nullptr : static_cast<char*>(m.slots[(t - 1) % 2].get());
    const TensorView held_k = t == 0 ? k : TensorView{slot, s.dtype, k.shape, {}};
    const TensorView held_v = t == 0 ? v : TensorView{slot + m.k_bytes, s.dtype, v.shape, {}};
    // Its blocks wait for its arrival (everything on the ring's stream so far: step t - 1's).
    if (t > 0 && m.recvs[t - 1]) sync.received.order(comm, compute);
    // The slot the next shard arrives in was last read by step t - 1's blocks (and its send,
    // earlier on the ring's stream): the receive waits for what the caller's stream holds now.
    sync.computed.record(compute);
    for (const Impl::Block& b : m.steps[t]) {
      if (!b.computes) {
        ++m.stats.blocks_skipped;
        continue;
      }
      if (t > 0 && !m.recvs[t - 1])
        fail(fmt::format("internal: step {} computes a block of a shard it did not receive", t));
      AttentionOptions ao;
      ao.block_mask = b.mask ? &*b.mask : nullptr;
      ao.captures = opts.captures;
      ao.params = m.plan_opts.params;
      ao.scale = opts.scale;
      ao.lse = TensorView{part_lse, DType::F32, {B, Hq, C}, {}};
      ao.stream = compute;
      ao.kernel = opts.kernel;
      ao.q_offset = b.q_offset, ao.kv_offset = b.kv_offset;
      ao.seq_q_len = ao.seq_kv_len = s.seq_len;
      const TensorView part{part_out, s.dtype, {B, Hq, C, m.dv}, {}};
      attention(rows_of(q, b.q_chunk * C, C), rows_of(held_k, b.kv_chunk * C, C),
                rows_of(held_v, b.kv_chunk * C, C), part, m.variant, ao);
      FlexcMergeParams p{};
      p.part = part_out, p.part_lse = part_lse, p.acc = acc, p.acc_lse = acc_lse;
      for (int i = 0; i < 3; ++i) p.part_stride[i] = part.stride(i);
      p.batch = int(B), p.heads = int(Hq), p.rows = int(C), p.acc_rows = int(L);
      p.row0 = int(b.q_chunk * C), p.dv = int(m.dv);
      m.merge("flexc_attention_merge", p, B * Hq * C, compute);
      ++m.stats.blocks_computed;
    }
    // Pass the shard on (and receive the next) while its blocks run. Enqueued after them: their
    // first call loads kernels, which must not wait behind a send in flight.
    if (t + 1 < m.ranks && (m.sends[t] || m.recvs[t])) {
      sync.computed.wait(comm);
      const nccl::Api& n = *m.nccl;
      char* into = static_cast<char*>(m.slots[t % 2].get());
      const int next = int((m.rank + 1) % m.ranks), prev = int((m.rank - 1 + m.ranks) % m.ranks);
      Group group(n);
      if (m.sends[t]) {
        nccl::check(n, n.ncclSend(held_k.data, m.k_bytes, nccl::kUint8, next, m.comm, comm), kWhat,
                    "ncclSend (K)");
        nccl::check(n, n.ncclSend(held_v.data, m.v_bytes, nccl::kUint8, next, m.comm, comm), kWhat,
                    "ncclSend (V)");
      }
      if (m.recvs[t]) {
        nccl::check(n, n.ncclRecv(into, m.k_bytes, nccl::kUint8, prev, m.comm, comm), kWhat,
                    "ncclRecv (K)");
        nccl::check(n, n.ncclRecv(into + m.k_bytes, m.v_bytes, nccl::kUint8, prev, m.comm, comm),
                    kWhat, "ncclRecv (V)");
      }
      group.end();
      communicated = true;
    }
    if (t + 1 < m.ranks) (m.sends[t] ? m.stats.sends : m.stats.sends_skipped) += 1;
  }
  // The caller's later work on its stream (overwriting k and v, say) waits for the sends.
  if (communicated) sync.finished.order(comm, compute);
  FlexcMergeParams p{};
  p.acc = acc, p.acc_lse = acc_lse, p.out = out.data;
  p.lse = opts.lse ? static_cast<float*>(opts.lse->data) : nullptr;
  for (int i = 0; i < 3; ++i) p.out_stride[i] = out.stride(i);
  p.batch = int(B), p.heads = int(Hq), p.rows = int(L), p.acc_rows = int(L), p.dv = int(m.dv);
  m.merge("flexc_attention_merge_store", p, B * Hq * L, compute);
}

}  // namespace flexc
