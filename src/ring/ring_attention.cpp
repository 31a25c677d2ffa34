// flexc::RingAttention: ring attention's forward over NCCL (docs/ring.md). Each step computes this
// rank's (query chunk, K/V chunk) blocks of the shard it holds with flexc::attention at global
// positions, folds them into float32 accumulators (templates/tile/attention_combine.cuh), and
// passes the shard on to the next rank on a stream of its own while the blocks run.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <vector>

#include "attention/attention_checks.h"
#include "attention/attention_kernel.h"
#include "flexc/device.h"
#include "flexc/error.h"
#include "flexc/ring.h"
#include "jit/driver_api.h"
#include "jit/jit.h"
#include "nccl.h"
#include "templates/attention/attention_params.cuh"

namespace flexc {

namespace {

constexpr std::string_view kWhat = "flexc::RingAttention";
constexpr size_t kGatherFields = 12;  // the most values a rank gathers at once
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

// Rows [r0, r0 + n) of a [B, H, S, d] tensor.
TensorView rows_of(const TensorView& t, int64_t r0, int64_t n) { return t.narrow(2, r0, n); }

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
// shards are passed on, which rows): they follow from the params, mask captures and the send
// cost, which the shape gather cannot see.
int64_t fingerprint(const RingPlan& plan) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](uint64_t x) { h = (h ^ x) * 1099511628211ull; };
  for (const RingStep& step : plan.steps) {
    for (bool p : step.passes) mix(p);
    for (const RingBlock& b : step.blocks)
      mix(uint64_t(b.full_tiles)), mix(uint64_t(b.partial_tiles));
    // The sizes of the sends: ranks disagreeing here would hang in NCCL, not fail.
    for (const auto& [first, last] : step.rows_sent) mix(uint64_t(first)), mix(uint64_t(last));
    for (const auto& [first, last] : step.grad_rows) mix(uint64_t(first)), mix(uint64_t(last));
    for (const std::vector<int64_t>& chunks : step.grad_chunks)
      for (int64_t c : chunks) mix(uint64_t(c + 1));
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
  // float32 accumulators of the shard's output, query chunk by query chunk ([per_rank, B, Hq,
  // C, Dv]: each block merges into one chunk's, contiguous), then their LSE ([per_rank, B, Hq,
  // C]); rounded once, at the end, as one GPU rounds the whole row's output.
  DeviceBuffer acc;
  // The ring's stream and the events ordering it with the caller's (made once the arguments are
  // checked: a bad one is reported before any CUDA work). The stream has the high priority: a
  // send's kernel, enqueued after its step's blocks, would otherwise start only once their CTAs
  // have all been scheduled, leaving the send exposed (docs/perf.md, ring version 5).
  struct Sync {
    Stream comm{StreamPriority::High};
    Event computed, received, finished, grad_early, grad_ready, grad_received;
    DeviceBuffer gathered;  // the ranks' agreement rounds (made before anything can fail alone)
  };
  std::optional<Sync> sync;
  // The backward's buffers, made by its first call: float32 dq of the shard, dK / dV of this
  // rank's own shard (`home`), two travelling copies of another shard's, the own one's returned
  // copy, each chunk by chunk (chunk c's dk [B, Hkv, C, D] then its dv: one send a chunk); a
  // block's dK / dV part (one chunk's) and the LSE rows of each query chunk (zigzag: the shard's
  // rows are two chunks).
  struct Backward {
    DeviceBuffer dq_acc, home, slots[2], returned, lse_parts, dkv_part;
  };
  std::optional<Backward> bwd;
  size_t grad_bytes = 0;  // a shard's dK and dV in float32
  RingStats stats;

  Impl(const Variant& v, ncclComm* c) : variant(v), comm(c) {}

  void check_comm(const RingShape& shape);
  void check_same_everywhere(const RingShape& shape, bool ok, const std::string& local_error);
  // Collective: every rank's `n` values, rank by rank (an all-gather on the ring's stream).
  std::vector<int64_t> gather(const int64_t* mine, size_t n, const char* doing);
  // Collective: every rank says whether its own step (`doing`) succeeded; throws on every rank
  // if any failed (its own error where it failed), so that none waits for a send that never
  // comes.
  void agree(bool ok, const std::string& local_error, const char* doing);
  void build_blocks();
  // attention_combine.cuh's kernels, loaded at construction: loading one later, with a send in
  // flight, could wait for the device while the send waits for a peer.
  enum Combine { kMergeStore, kAccumulate, kCombines };
  const jit::Kernel* combine[kCombines] = {};
  void load_combine();
  void merge(Combine which, FlexcMergeParams& p, int64_t rows, CUstream stream);
  // The arguments' shard shapes and dtype; k and v contiguous (they are sent as they are).
  void check_shard(std::initializer_list<std::pair<const char*, const TensorView*>> q_like,
                   std::initializer_list<std::pair<const char*, const TensorView*>> kv_like,
                   const TensorView& k, const TensorView& v) const;
  // The K/V shard held at step t (this rank's own at step 0, then a slot's) and its exchange
  // after the step's blocks: passed to rank r + 1, the next received from r - 1 (ring stream).
  std::pair<TensorView, TensorView> held(int64_t t, const TensorView& k,
                                         const TensorView& v) const;
  bool exchange(int64_t t, const TensorView& held_k, const TensorView& held_v);
  // Whether step t computes block b (a skipped one is counted); computing with a shard this
  // rank did not receive would be a bug of the plan.
  bool computes(const Block& b, int64_t t);
  // A block call's options (AttentionOptions or BackwardOptions): its BlockMask and positions,
  // the plan's params, the call's captures, scale and kernel.
  template <class Options, class Call>
  Options block_options(const Block& b, const Call& call, CUstream stream) const {
    Options o;
    o.block_mask = b.mask ? &*b.mask : nullptr;
    o.captures = call.captures;
    o.params = plan_opts.params;
    o.scale = call.scale;
    o.stream = stream;
    o.kernel = call.kernel;
    o.q_offset = b.q_offset, o.kv_offset = b.kv_offset;
    o.seq_q_len = o.seq_kv_len = plan.shape.seq_len;
    return o;
  }
  // `into` rows [row0, row0 + rows) of each (batch, head) += part_view's rows (float32).
  void accumulate(const TensorView& part_view, float* into, int64_t heads, int64_t rows,
                  int64_t acc_rows, int64_t row0, int64_t width, CUstream stream);
  // out (16-bit; `rows` rows a head) = acc's rows; with lse, the LSE too, as rows lse_row0.. of
  // the shard's.
  void store(float* from, float* from_lse, const TensorView& out, float* lse, int64_t heads,
             int64_t rows, int64_t lse_row0, CUstream stream);
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
std::vector<int64_t> RingAttention::Impl::gather(const int64_t* mine, size_t n,
                                                 const char* doing) {
  DeviceBuffer& buf = sync->gathered;
  int64_t* all = static_cast<int64_t*>(buf.get()) + n;
  buf.upload(mine, n * sizeof(int64_t));
  synchronize_device();  // the upload ran on the legacy stream; the gather does not wait for it
  nccl::check(*nccl, nccl->ncclAllGather(buf.get(), all, n, nccl::kInt64, comm, sync->comm.get()),
              kWhat, fmt::format("ncclAllGather ({})", doing));
  sync->comm.synchronize();
  std::vector<int64_t> got(n * size_t(ranks));
  buf.download(got.data(), got.size() * sizeof(int64_t), n * sizeof(int64_t));
  return got;
}

void RingAttention::Impl::check_same_everywhere(const RingShape& s, bool ok,
                                                const std::string& local_error) {
  const char* names[] = {"status",   "ranks",      "seq_len", "batch",    "q_heads", "kv_heads",
                         "head_dim", "v_head_dim", "dtype",   "sharding", "tile",
                         "plan (params, mask captures, send_cost_bytes)"};
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
  static_assert(kFields <= kGatherFields);
  const std::vector<int64_t> got = gather(mine, kFields, "comparing the ranks' shapes");
  if (!ok) throw Error(local_error);
  for (int64_t r = 0; r < ranks; ++r)
    if (got[r * kFields] == 0)
      fail(fmt::format("rank {} could not construct the ring (its error says why)", r));
  for (int64_t r = 0; r < ranks; ++r)
    for (size_t f = 1; f < kFields; ++f)
      if (got[r * kFields + f] != mine[f])
        fail(
            fmt::format("rank {} has {} = {}; this rank ({}) has {}: every rank must construct "
                        "the ring with the same shape, params, mask captures and send_cost_bytes",
                        r, names[f], got[r * kFields + f], rank, mine[f]));
}

void RingAttention::Impl::agree(bool ok, const std::string& local_error, const char* doing) {
  const int64_t mine = ok;
  const std::vector<int64_t> got = gather(&mine, 1, doing);
  if (!ok) throw Error(local_error);
  for (int64_t r = 0; r < ranks; ++r)
    if (got[r] == 0) fail(fmt::format("rank {} failed {} (its error says why)", r, doing));
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
    // K/V chunk by K/V chunk: the backward sends a chunk's dK / dV once its blocks are done.
    for (int64_t c = 0; c < per_rank; ++c)
      for (int64_t a = 0; a < per_rank; ++a) {
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

void RingAttention::Impl::load_combine() {
  const RingShape& s = plan.shape;
  jit::KernelConfig kc{"", s.dtype == DType::BF16 ? "bf16" : "fp16", int(s.head_dim), int(dv)};
  const jit::KernelSpec module = jit::attention_decode_spec(kc);  // attention_combine.cuh's
  std::vector<jit::KernelSpec> specs(kCombines, module);
  specs[kMergeStore].entry = "flexc_attention_merge_store";
  specs[kAccumulate].entry = "flexc_grad_accumulate";
  const std::vector<const jit::Kernel*> got = jit::get_kernels(variant, specs);
  std::copy(got.begin(), got.end(), combine);
}

void RingAttention::Impl::merge(Combine which, FlexcMergeParams& p, int64_t rows,
                                CUstream stream) {
  void* argv[] = {&p};
  combine[which]->launch(unsigned((rows + 3) / 4), 1, 1, 128, 0, stream, argv);
}

void RingAttention::Impl::check_shard(
    std::initializer_list<std::pair<const char*, const TensorView*>> q_like,
    std::initializer_list<std::pair<const char*, const TensorView*>> kv_like, const TensorView& k,
    const TensorView& v) const {
  const RingShape& s = plan.shape;
  const int64_t L = shard_len;
  const auto expect = [&](const char* name, const TensorView& t, std::vector<int64_t> shape) {
    detail::check_qkv(kWhat, name, t, s.dtype);
    if (t.shape != shape)
      fail(fmt::format("{} must be this rank's shard [{}] (S / ranks = {} rows); got {}", name,
                       fmt::join(shape, ", "), L, t.describe()));
  };
  // q, k and their gradients have the head dim; v, out, dout and theirs v's.
  const auto width = [&](std::string_view n) {
    return n == "q" || n == "k" || n == "grads.dq" || n == "grads.dk" ? s.head_dim : dv;
  };
  for (const auto& [name, t] : q_like) expect(name, *t, {s.batch, s.q_heads, L, width(name)});
  for (const auto& [name, t] : kv_like) expect(name, *t, {s.batch, s.kv_heads, L, width(name)});
  for (const TensorView* t : {&k, &v})
    if (!contiguous(*t))
      fail(fmt::format("{} must be contiguous (it is sent to the next rank as is); got {}",
                       t == &k ? "k" : "v", t->describe()));
}

std::pair<TensorView, TensorView> RingAttention::Impl::held(int64_t t, const TensorView& k,
                                                           const TensorView& v) const {
  if (t == 0) return {k, v};
  char* slot = static_cast<char*>(slots[(t - 1) % 2].get());
  return {TensorView{slot, plan.shape.dtype, k.shape, {}},
          TensorView{slot + k_bytes, plan.shape.dtype, v.shape, {}}};
}

bool RingAttention::Impl::exchange(int64_t t, const TensorView& held_k,
                                   const TensorView& held_v) {
  if (t + 1 < ranks) (sends[t] ? stats.sends : stats.sends_skipped) += 1;
  if (t + 1 >= ranks || !(sends[t] || recvs[t])) return false;
  const CUstream c = sync->comm.get();
  // The slot the next shard arrives in was last read by step t - 1's blocks (and its send,
  // earlier on the ring's stream): `computed` was recorded before step t's blocks.
  sync->computed.wait(c);
  const nccl::Api& n = *nccl;
  char* into = static_cast<char*>(slots[t % 2].get());
  const int next = int((rank + 1) % ranks), prev = int((rank - 1 + ranks) % ranks);
  // The rows later blocks read (RingStep::rows_sent): the whole shard in one send each for K
  // and V, or those rows of every (batch, head); the slot's other rows are never read (the
  // kernels load the tiles the BlockMask lists). At step 0 the caller's k and v: two tensors.
  const RingShape& s = plan.shape;
  const size_t elem = dtype_size(s.dtype);
  const auto transfer = [&](bool send, char* k_at, char* v_at, int64_t peer) {
    const auto [first, last] = plan.steps[t].rows_sent[send ? rank : peer];
    const auto one = [&](char* at, size_t bytes, const char* what) {
      nccl::check(n,
                  send ? n.ncclSend(at, bytes, nccl::kUint8, int(peer), comm, c)
                       : n.ncclRecv(at, bytes, nccl::kUint8, int(peer), comm, c),
                  kWhat, what);
    };
    if (first == 0 && last == shard_len) {
      one(k_at, k_bytes, send ? "ncclSend (K)" : "ncclRecv (K)");
      one(v_at, v_bytes, send ? "ncclSend (V)" : "ncclRecv (V)");
      return;
    }
    for (int64_t bh = 0; bh < s.batch * s.kv_heads; ++bh) {
      one(k_at + size_t((bh * shard_len + first) * s.head_dim) * elem,
          size_t((last - first) * s.head_dim) * elem, send ? "ncclSend (K)" : "ncclRecv (K)");
      one(v_at + size_t((bh * shard_len + first) * dv) * elem,
          size_t((last - first) * dv) * elem, send ? "ncclSend (V)" : "ncclRecv (V)");
    }
  };
  Group group(n);
  if (sends[t])
    transfer(true, static_cast<char*>(held_k.data), static_cast<char*>(held_v.data), next);
  if (recvs[t]) transfer(false, into, into + k_bytes, prev);
  group.end();
  sync->received.record(c);  // the next step's blocks wait for this, not for later groups
  return true;
}

bool RingAttention::Impl::computes(const Block& b, int64_t t) {
  if (!b.computes) {
    ++stats.blocks_skipped;
    return false;
  }
  if (t > 0 && !recvs[t - 1])
    fail(fmt::format("internal: step {} computes a block of a shard it did not receive", t));
  ++stats.blocks_computed;
  return true;
}

void RingAttention::Impl::accumulate(const TensorView& part_view, float* into, int64_t heads,
                                     int64_t rows, int64_t acc_rows, int64_t row0, int64_t width,
                                     CUstream stream) {
  FlexcMergeParams p{};
  p.part = part_view.data, p.acc = into;
  for (int i = 0; i < 3; ++i) p.part_stride[i] = part_view.stride(i);
  p.batch = int(part_view.shape[0]), p.heads = int(heads), p.rows = int(rows);
  p.acc_rows = int(acc_rows), p.row0 = int(row0), p.dv = int(width);
  merge(kAccumulate, p, part_view.shape[0] * heads * rows, stream);
}

void RingAttention::Impl::store(float* from, float* from_lse, const TensorView& out, float* lse,
                                int64_t heads, int64_t rows, int64_t lse_row0, CUstream stream) {
  FlexcMergeParams p{};
  p.acc = from, p.acc_lse = from_lse, p.out = out.data, p.lse = lse;
  for (int i = 0; i < 3; ++i) p.out_stride[i] = out.stride(i);
  p.batch = int(plan.shape.batch), p.heads = int(heads), p.rows = int(rows);
  p.acc_rows = int(rows), p.dv = int(out.shape[3]);
  p.lse_rows = int(shard_len), p.row0 = int(lse_row0);
  merge(kMergeStore, p, plan.shape.batch * heads * rows, stream);
}

RingAttention::RingAttention(const Variant& v, ncclComm* comm, const RingShape& shape,
                             const RingPlanOptions& opts)
    : impl_(std::make_unique<Impl>(v, comm)) {
  Impl& m = *impl_;
  m.plan_opts = opts;
  m.dv = shape.v_head_dim ? shape.v_head_dim : shape.head_dim;
  // This rank's own checks; with a usable communicator their failure is shared with every rank
  // (check_same_everywhere), so that none waits for this one.
  bool ok = true;
  std::string local_error;
  const auto locally = [&](auto&& step) {
    if (!ok) return;
    try {
      step();
    } catch (const std::exception& e) {
      ok = false, local_error = e.what();
    } catch (...) {
      ok = false, local_error = std::string(kWhat) + ": an unknown error";
    }
  };
  locally([&] {
    if (shape.dtype != DType::BF16 && shape.dtype != DType::F16)
      fail(fmt::format("shape.dtype must be bf16 or fp16; got {}", dtype_name(shape.dtype)));
    m.plan = plan_ring(v, shape, opts);
  });
  if (!ok && comm == nullptr) throw Error(local_error);
  m.check_comm(shape);
  m.sync.emplace();
  m.sync->gathered = DeviceBuffer(kGatherFields * sizeof(int64_t) * size_t(m.ranks + 1));
  // The BlockMasks and buffers too: a rank failing here (out of memory, say) fails every rank at
  // the gather below, not the others' first send.
  locally([&] {
    m.per_rank = shape.sharding == Sharding::Zigzag ? 2 : 1;
    m.shard_len = shape.seq_len / shape.ranks;
    m.build_blocks();
    m.load_combine();
    const int64_t kv_rows = shape.batch * shape.kv_heads * m.shard_len;
    const int64_t q_rows = shape.batch * shape.q_heads * m.shard_len;
    const size_t elem = dtype_size(shape.dtype);
    m.k_bytes = size_t(kv_rows * shape.head_dim) * elem;
    m.v_bytes = size_t(kv_rows * m.dv) * elem;
    // Zeroed once: the rows a shard is passed on without (RingStep::rows_sent) are never read,
    // and even so hold finite values (zeros, or an earlier shard's).
    for (DeviceBuffer& slot : m.slots) {
      slot = DeviceBuffer(m.k_bytes + m.v_bytes);
      slot.fill(0);
    }
    m.grad_bytes = size_t(kv_rows * (shape.head_dim + m.dv)) * sizeof(float);
    m.acc = DeviceBuffer(size_t(q_rows * (m.dv + 1)) * sizeof(float));
  });
  m.plan_opts.captures.clear();  // host pointers, valid during construction only
  m.check_same_everywhere(shape, ok, local_error);
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
  m.check_shard({{"q", &q}, {"out", &out}}, {{"k", &k}, {"v", &v}}, k, v);
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

  m.stats = {};
  bool communicated = false;
  for (int64_t t = 0; t < m.ranks; ++t) {
    const auto [held_k, held_v] = m.held(t, k, v);
    // Its blocks wait for its arrival (step t - 1's exchange).
    if (t > 0 && m.recvs[t - 1]) sync.received.wait(compute);
    sync.computed.record(compute);
    for (const Impl::Block& b : m.steps[t]) {
      if (!m.computes(b, t)) continue;
      // The block merges itself into its query chunk's accumulators (AttentionOptions::
      // accumulate): unrounded, with no buffer for it.
      AttentionOptions ao = m.block_options<AttentionOptions>(b, opts, compute);
      ao.accumulate = true;
      ao.lse = TensorView{acc_lse + b.q_chunk * B * Hq * C, DType::F32, {B, Hq, C}, {}};
      const TensorView into{acc + b.q_chunk * B * Hq * C * m.dv, DType::F32, {B, Hq, C, m.dv},
                            {}};
      attention(rows_of(q, b.q_chunk * C, C), rows_of(held_k, b.kv_chunk * C, C),
                rows_of(held_v, b.kv_chunk * C, C), into, m.variant, ao);
    }
    // Pass the shard on (and receive the next) while its blocks run. Enqueued after them: their
    // first call loads kernels, which must not wait behind a send in flight.
    communicated |= m.exchange(t, held_k, held_v);
  }
  // The caller's later work on its stream (overwriting k and v, say) waits for the sends.
  if (communicated) sync.finished.order(comm, compute);
  for (int64_t a = 0; a < m.per_rank; ++a)
    m.store(acc + a * B * Hq * C * m.dv, acc_lse + a * B * Hq * C, rows_of(out, a * C, C),
            opts.lse ? static_cast<float*>(opts.lse->data) : nullptr, Hq, C, a * C, compute);
}

void RingAttention::backward(const TensorView& q, const TensorView& k, const TensorView& v,
                             const TensorView& out, const TensorView& lse, const TensorView& dout,
                             const AttentionGrads& grads, const RingBackwardOptions& opts) {
  Impl& m = *impl_;
  const RingShape& s = m.plan.shape;
  const int64_t L = m.shard_len, C = m.plan.chunk_len, B = s.batch, Hq = s.q_heads;
  const int64_t Hkv = s.kv_heads, D = s.head_dim;
  const auto check = [&] {
    if (m.dv != D)
      fail(fmt::format("backward: v_head_dim {} differs from head_dim {}; the backward kernels "
                       "need them equal (the forward takes any pair)",
                       m.dv, D));
    if (D != 32 && D != 64 && D != 96 && D != 128)
      fail(fmt::format("backward: head_dim {} is not one of the backward kernels' (32, 64, 96, "
                       "128)",
                       D));
    if (m.plan.tile % 64 != 0)
      fail(fmt::format("backward: the plan's tile {} is not a multiple of 64 (the backward "
                       "kernels' BlockMask tiles)",
                       m.plan.tile));
    m.check_shard({{"q", &q}, {"out", &out}, {"dout", &dout}, {"grads.dq", &grads.dq}},
                  {{"k", &k}, {"v", &v}, {"grads.dk", &grads.dk}, {"grads.dv", &grads.dv}}, k,
                  v);
    detail::check_rows(kWhat, "lse", lse, B, Hq, L);
  };
  if (!m.bwd) {
    // The first call checks and allocates on every rank before any of them communicates (a
    // rank that fails here would leave the others waiting); later calls only check.
    bool ok = true;
    std::string local_error;
    try {
      check();
      Impl::Backward& w = m.bwd.emplace();
      w.dq_acc = DeviceBuffer(size_t(B * Hq * L * D) * 4);
      w.home = DeviceBuffer(m.grad_bytes);
      // slots[1] holds step 1's travelling copy; slots[0] a copy passed on (3 ranks or more).
      w.slots[1] = DeviceBuffer(m.grad_bytes);
      if (m.ranks > 2) w.slots[0] = DeviceBuffer(m.grad_bytes);
      bool returns = false;  // this rank's own shard's dK / dV come back from another rank
      for (int64_t t = 1; t < m.ranks; ++t)
        for (int64_t x = 0; x < m.ranks; ++x)
          returns |=
              m.plan.steps[t].grad_to[x] == m.rank && (x - t + m.ranks) % m.ranks == m.rank;
      if (returns) w.returned = DeviceBuffer(m.grad_bytes);
      if (m.per_rank > 1) w.lse_parts = DeviceBuffer(size_t(m.per_rank * B * Hq * C) * 4);
      if (m.ranks > 2) w.dkv_part = DeviceBuffer(size_t(2 * B * Hkv * C * D) * 4);
    } catch (const std::exception& e) {
      ok = false, local_error = e.what();
    } catch (...) {
      ok = false, local_error = std::string(kWhat) + ": backward: an unknown error";
    }
    if (!ok) m.bwd.reset();
    try {
      m.agree(ok, local_error, "the backward's checks and allocations");
    } catch (...) {
      m.bwd.reset();  // every rank starts over at its next call, agreeing again
      throw;
    }
  } else {
    check();
  }
  Impl::Backward& w = *m.bwd;

  const jit::DriverApi& d = jit::driver("running ring attention's backward");
  Impl::Sync& sync = *m.sync;
  CUstream compute = opts.stream, comm = sync.comm.get();
  float* dq_acc = static_cast<float*>(w.dq_acc.get());
  float* home = static_cast<float*>(w.home.get());
  jit::check(d.cuMemsetD8Async(w.dq_acc.ptr(), 0, w.dq_acc.size(), compute),
             "clearing ring attention's gradient accumulators");
  jit::check(d.cuMemsetD8Async(w.home.ptr(), 0, w.home.size(), compute),
             "clearing ring attention's gradient accumulators");
  // Each query chunk's LSE rows, contiguous as the backward takes them.
  std::vector<TensorView> chunk_lse(size_t(m.per_rank), lse);
  if (m.per_rank > 1)
    for (int64_t a = 0; a < m.per_rank; ++a) {
      float* to = static_cast<float*>(w.lse_parts.get()) + a * B * Hq * C;
      CUDA_MEMCPY2D cp{};
      cp.srcMemoryType = cp.dstMemoryType = CU_MEMORYTYPE_DEVICE;
      cp.srcDevice = reinterpret_cast<CUdeviceptr>(static_cast<float*>(lse.data) + a * C);
      cp.srcPitch = size_t(L) * 4;
      cp.dstDevice = reinterpret_cast<CUdeviceptr>(to);
      cp.dstPitch = size_t(C) * 4;
      cp.WidthInBytes = size_t(C) * 4;
      cp.Height = size_t(B * Hq);
      jit::check(d.cuMemcpy2DAsync(&cp, compute), "copying the LSE rows of a query chunk");
      chunk_lse[a] = TensorView{to, DType::F32, {B, Hq, C}, {}};
    }
  // Each block adds its dq, dk, dv into the float32 accumulators (BackwardOptions::accumulate):
  // summed unrounded, rounded once at the end, as on one GPU. The held shard's dK / dV are laid
  // out chunk by chunk, so that a chunk is one send: chunk c of a copy at `at` holds dk
  // [B, Hkv, C, D] then dv.
  const TensorView dq_all{dq_acc, DType::F32, {B, Hq, L, D}, {}};
  const int64_t chunk_floats = 2 * B * Hkv * C * D;
  const size_t chunk_bytes = size_t(chunk_floats) * 4;
  const auto dk_of = [&](float* at, int64_t c) {
    return TensorView{at + c * chunk_floats, DType::F32, {B, Hkv, C, D}, {}};
  };
  const auto dv_of = [&](float* at, int64_t c) {
    return TensorView{at + c * chunk_floats + B * Hkv * C * D, DType::F32, {B, Hkv, C, D}, {}};
  };
  // into += from, a chunk's dk and dv (float32) as one [rows, D] matrix.
  const auto add_chunk = [&](float* from, float* into) {
    const int64_t rows = 2 * B * Hkv * C;
    m.accumulate(TensorView{from, DType::F32, {1, 1, rows, D}, {}}, into, 1, rows, rows, 0, D,
                 compute);
  };
  float* part = static_cast<float*>(w.dkv_part.get());
  const nccl::Api& n = *m.nccl;
  // Where rank x's copy sent to this rank after step t lands: this rank's own shard's returns,
  // another's is the copy it holds at step t + 1.
  const auto landing = [&](int64_t x, int64_t t) {
    return (x - t + m.ranks) % m.ranks == m.rank ? static_cast<float*>(w.returned.get())
                                                 : static_cast<float*>(w.slots[(t + 1) % 2].get());
  };
  std::vector<std::pair<int64_t, std::pair<int64_t, int64_t>>> returned;  // chunk, its rows

  m.stats = {};
  bool communicated = false;
  for (int64_t t = 0; t < m.ranks; ++t) {
    const auto [held_k, held_v] = m.held(t, k, v);
    const bool holds = t == 0 || m.recvs[t - 1];
    if (t > 0 && m.recvs[t - 1]) sync.received.wait(compute);
    sync.computed.record(compute);
    // The held shard's dK / dV: this rank's own at step 0; from step 1 a travelling copy, with
    // the chunks earlier holders touched arriving from rank r - 1 (after that rank's blocks) and
    // the others starting at zero here.
    float* gacc = t == 0 ? home : static_cast<float*>(w.slots[t % 2].get());
    std::vector<bool> incoming(size_t(m.per_rank), false);
    if (t > 1) {
      const int64_t prev = (m.rank - 1 + m.ranks) % m.ranks;
      if (m.plan.steps[t - 1].grad_to[prev] == m.rank)
        for (int64_t c : m.plan.steps[t - 1].grad_chunks[prev]) incoming[c] = true;
    }
    if (t > 0 && holds)
      for (int64_t c = 0; c < m.per_rank; ++c)
        if (!incoming[c])
          jit::check(d.cuMemsetD8Async(reinterpret_cast<CUdeviceptr>(gacc + c * chunk_floats), 0,
                                       chunk_bytes, compute),
                     "clearing a travelling dK / dV");
    // While the copy is on its way, the step's first block adds its dk, dv into a zeroed part,
    // added to the copy once it came, so that its compute does not wait for the transfer.
    bool arrived = std::find(incoming.begin(), incoming.end(), true) == incoming.end();
    // The last block's K/V chunk: the copy's other chunks go while it runs (RingStep::
    // grad_early).
    int64_t last_chunk = -1;
    for (const Impl::Block& b : m.steps[t])
      if (b.computes) last_chunk = b.kv_chunk;
    bool early_recorded = false;
    for (const Impl::Block& b : m.steps[t]) {
      if (!m.computes(b, t)) continue;
      if (b.kv_chunk == last_chunk && !early_recorded)
        sync.grad_early.record(compute), early_recorded = true;
      BackwardOptions bo = m.block_options<BackwardOptions>(b, opts, compute);
      bo.deterministic = opts.deterministic;
      bo.accumulate = true;
      const int64_t q0 = b.q_chunk * C, kv0 = b.kv_chunk * C;
      const auto block = [&](const TensorView& dk, const TensorView& dv) {
        attention_backward(rows_of(q, q0, C), rows_of(held_k, kv0, C), rows_of(held_v, kv0, C),
                           rows_of(out, q0, C), chunk_lse[b.q_chunk], rows_of(dout, q0, C),
                           {rows_of(dq_all, q0, C), dk, dv, grads.captures}, m.variant, bo);
      };
      if (arrived) {
        block(dk_of(gacc, b.kv_chunk), dv_of(gacc, b.kv_chunk));
        continue;
      }
      jit::check(d.cuMemsetD8Async(w.dkv_part.ptr(), 0, w.dkv_part.size(), compute),
                 "clearing a block's dK / dV");
      block(dk_of(part, 0), dv_of(part, 0));
      sync.grad_received.wait(compute), arrived = true;
      add_chunk(part, gacc + b.kv_chunk * chunk_floats);
    }
    if (!early_recorded) sync.grad_early.record(compute);
    communicated |= m.exchange(t, held_k, held_v);
    // dK / dV on (RingStep::grad_to), in two NCCL groups every rank orders alike: the chunks
    // done before a rank's last block (RingStep::grad_early) while it runs, then the rest.
    const RingStep& step = m.plan.steps[t];
    const int64_t to = step.grad_to[m.rank];
    std::vector<int64_t> from;
    for (int64_t x = 0; x < m.ranks; ++x)
      if (step.grad_to[x] == m.rank) from.push_back(x);
    if (to < 0 && from.empty()) continue;
    // Rows [r0, r1) of chunk c that rank x's copy carries (RingStep::grad_rows): the whole chunk
    // in one send, or those rows of its dk and dv for every (batch, head).
    const auto chunk_span = [&](int64_t x, int64_t c) {
      const auto [first, last] = step.grad_rows[x];
      return std::pair<int64_t, int64_t>{std::clamp<int64_t>(first - c * C, 0, C),
                                         std::clamp<int64_t>(last - c * C, 0, C)};
    };
    const auto transfer_chunk = [&](bool send, float* base, int64_t c, int64_t x, int64_t peer) {
      const auto [r0, r1] = chunk_span(x, c);
      const auto one = [&](float* at, int64_t floats) {
        const size_t bytes = size_t(floats) * 4;
        nccl::check(n,
                    send ? n.ncclSend(at, bytes, nccl::kUint8, int(peer), m.comm, comm)
                         : n.ncclRecv(at, bytes, nccl::kUint8, int(peer), m.comm, comm),
                    kWhat, send ? "ncclSend (dK, dV)" : "ncclRecv (dK, dV)");
      };
      float* at = base + c * chunk_floats;
      if (r0 == 0 && r1 == C) return one(at, chunk_floats);
      for (int64_t half = 0; half < 2; ++half)  // dk, then dv
        for (int64_t bh = 0; bh < B * Hkv; ++bh)
          one(at + half * B * Hkv * C * D + (bh * C + r0) * D, (r1 - r0) * D);
    };
    for (int phase = 0; phase < 2; ++phase) {
      const auto part_of = [&](int64_t x) {
        const std::vector<int64_t>& chunks = step.grad_chunks[x];
        const int64_t early = step.grad_early[x];
        return phase == 0 ? std::vector<int64_t>(chunks.begin(), chunks.begin() + early)
                          : std::vector<int64_t>(chunks.begin() + early, chunks.end());
      };
      const std::vector<int64_t> mine = to >= 0 ? part_of(m.rank) : std::vector<int64_t>{};
      bool receives = false;
      for (int64_t x : from) receives |= !part_of(x).empty();
      if (mine.empty() && !receives) continue;
      if (phase == 0)
        sync.grad_early.wait(comm);  // recorded before the last chunk's blocks
      else
        sync.grad_ready.order(compute, comm);
      Group group(n);
      for (int64_t c : mine) transfer_chunk(true, gacc, c, m.rank, to);
      for (int64_t x : from)
        for (int64_t c : part_of(x)) {
          transfer_chunk(false, landing(x, t), c, x, x);
          if (landing(x, t) == static_cast<float*>(w.returned.get()))
            returned.push_back({c, chunk_span(x, c)});
        }
      group.end();
    }
    if (to >= 0) ++m.stats.grad_sends;
    sync.grad_received.record(comm);
    communicated = true;
  }
  if (communicated) sync.finished.order(comm, compute);
  for (const auto& [c, span] : returned) {
    float* from = static_cast<float*>(w.returned.get()) + c * chunk_floats;
    const auto [r0, r1] = span;
    if (r0 == 0 && r1 == C) {
      add_chunk(from, home + c * chunk_floats);
      continue;
    }
    for (int64_t half = 0; half < 2; ++half) {  // dk, then dv
      const int64_t off = half * B * Hkv * C * D;
      m.accumulate(TensorView{from + off, DType::F32, {B, Hkv, C, D}, {}}.narrow(2, r0, r1 - r0),
                   home + c * chunk_floats + off, Hkv, r1 - r0, C, r0, D, compute);
    }
  }
  m.store(dq_acc, nullptr, grads.dq, nullptr, Hq, L, 0, compute);
  for (int64_t c = 0; c < m.per_rank; ++c) {
    m.store(home + c * chunk_floats, nullptr, rows_of(grads.dk, c * C, C), nullptr, Hkv, C, 0,
            compute);
    m.store(home + c * chunk_floats + B * Hkv * C * D, nullptr, rows_of(grads.dv, c * C, C),
            nullptr, Hkv, C, 0, compute);
  }
}

}  // namespace flexc
