// Standalone harness for templates/attention/attention_fwd.cuh: plain nvcc, no JIT, a hand-written
// variant (tools/dev/flexc_variant.cuh). `check` compares against a float64 CPU reference on random
// inputs (tolerance rule of docs/attention.md), `bench` prints TFLOP/s on the anchors' shapes.
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -Xptxas -v -Itemplates -Itemplates/tile \
//        -Itemplates/attention -Itools/dev \
//        -DFLEXC_DEV_VARIANT=1 -DFLEXC_HEAD_DIM=128 -DFLEXC_BF16=1 -DFLEXC_BLOCK_M=128 \
//        -DFLEXC_BLOCK_N=64 -DFLEXC_WARPS=4 -DFLEXC_STAGES=2 tools/dev/attention_fwd_dev.cu -o fwd
//   ./fwd check && ./fwd bench
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include <cuda_fp16.h>

#include "attention_fwd.cuh"

#define CK(x)                                                                          \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x,                  \
                   cudaGetErrorString(e_));                                            \
      std::exit(2);                                                                    \
    }                                                                                  \
  } while (0)

using namespace flexc_fwd;

namespace {

using u16 = unsigned short;

u16 to16(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  if (kBf16) return static_cast<u16>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
  return __half_as_ushort(__float2half_rn(f));
}
float from16(u16 h) {
  if (kBf16) {
    unsigned u = static_cast<unsigned>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  return __half2float(__ushort_as_half(h));
}
double round16(double x) { return from16(to16(static_cast<float>(x))); }

std::mt19937_64 rng{std::random_device{}()};

template <class F>
void parallel_for(int n, F f) {
  const int nt = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> ts;
  for (int t = 0; t < nt; ++t)
    ts.emplace_back([&, t] {
      for (int i = t; i < n; i += nt) f(i);
    });
  for (auto& t : ts) t.join();
}

struct Config {
  int B, Hq, Hkv, Lq, Lkv;
  bool bshd = false;   // [B, S, H, D] layout instead of [B, H, S, D]
  bool use_bm = true;  // BlockMask, or every tile visited
};

struct Problem {
  Config c;
  std::vector<u16> q, k, v;
  FlexcArgs args{};      // device pointers
  FlexcArgs host_args{};  // the same with host pointers
  std::vector<float> slope;
  std::vector<int> doc;
  void* dev_capture = nullptr;
  // BlockMask (tile 128 x 128, broadcast over B and H)
  std::vector<int> kv_num, kv_idx, full_num, full_idx;
  int nqt = 0, nkt = 0;
  double unmasked = 0;  // fraction of (q, kv) pairs the mask keeps
};

void strides(const Config& c, int H, int L, long long (&s)[3]) {
  if (c.bshd) {
    s[0] = 1LL * L * H * kD, s[1] = kD, s[2] = 1LL * H * kD;
  } else {
    s[0] = 1LL * H * L * kD, s[1] = 1LL * L * kD, s[2] = kD;
  }
}

Problem make_problem(const Config& c, float cap = 30.f, int window = 1024, int prefix = 2048,
                     int docs = 6, bool equal_docs = false) {
  Problem p;
  p.c = c;
  auto fill = [&](std::vector<u16>& x, size_t n) {
    x.resize(n);
    const size_t chunk = 1 << 20;
    std::vector<unsigned long long> seeds((n + chunk - 1) / chunk);
    for (auto& sd : seeds) sd = rng();
    parallel_for(static_cast<int>(seeds.size()), [&](int i) {
      std::mt19937_64 g(seeds[i]);
      std::normal_distribution<float> nd(0.f, 1.f);
      for (size_t j = i * chunk; j < std::min(n, (i + 1) * chunk); ++j) x[j] = to16(nd(g));
    });
  };
  fill(p.q, 1ULL * c.B * c.Hq * c.Lq * kD);
  fill(p.k, 1ULL * c.B * c.Hkv * c.Lkv * kD);
  fill(p.v, 1ULL * c.B * c.Hkv * c.Lkv * kD);
  p.args.fparam[0] = p.host_args.fparam[0] = cap;
  p.args.iparam[0] = p.host_args.iparam[0] = std::string(FLEXC_DEV_NAME) == "prefix_lm" ? prefix
                                                                                         : window;
  if (std::string(FLEXC_DEV_NAME) == "alibi") {
    for (int h = 0; h < c.Hq; ++h) p.slope.push_back(std::exp2(-8.0 * (h + 1) / c.Hq));
    CK(cudaMalloc(&p.dev_capture, p.slope.size() * 4));
    CK(cudaMemcpy(p.dev_capture, p.slope.data(), p.slope.size() * 4, cudaMemcpyHostToDevice));
    p.host_args.captures[0].data = p.slope.data();
    p.args.captures[0].data = p.dev_capture;
    p.args.captures[0].shape[0] = p.host_args.captures[0].shape[0] = c.Hq;
  }
  if (std::string(FLEXC_DEV_NAME) == "document") {
    std::vector<int> cuts{0, c.Lkv};
    std::uniform_int_distribution<int> ud(1, std::max(1, c.Lkv - 1));
    // Random documents for checks; equal ones (bench_peers.py's split) for timings.
    for (int i = 1; i < docs; ++i)
      cuts.push_back(equal_docs ? static_cast<int>(std::lround(1.0 * i * c.Lkv / docs)) : ud(rng));
    std::sort(cuts.begin(), cuts.end());
    p.doc.resize(c.Lkv);
    for (size_t i = 0; i + 1 < cuts.size(); ++i)
      for (int j = cuts[i]; j < cuts[i + 1]; ++j) p.doc[j] = static_cast<int>(i);
    CK(cudaMalloc(&p.dev_capture, p.doc.size() * 4));
    CK(cudaMemcpy(p.dev_capture, p.doc.data(), p.doc.size() * 4, cudaMemcpyHostToDevice));
    p.host_args.captures[0].data = p.doc.data();
    p.args.captures[0].data = p.dev_capture;
    p.args.captures[0].shape[0] = p.host_args.captures[0].shape[0] = c.Lkv;
  }
  // Brute-force tile classification (the mask reads neither b nor h here).
  p.nqt = (c.Lq + 127) / 128, p.nkt = (c.Lkv + 127) / 128;
  p.kv_num.assign(p.nqt, 0), p.full_num.assign(p.nqt, 0);
  p.kv_idx.assign(1LL * p.nqt * p.nkt, 0), p.full_idx.assign(1LL * p.nqt * p.nkt, 0);
  std::vector<double> kept(p.nqt, 0);
  parallel_for(p.nqt, [&](int qt) {
    for (int kt = 0; kt < p.nkt; ++kt) {
      long long n = 0, in = 0;
      for (int qi = qt * 128; qi < std::min(c.Lq, qt * 128 + 128); ++qi)
        for (int ki = kt * 128; ki < std::min(c.Lkv, kt * 128 + 128); ++ki) {
          ++in;
          n += FlexcVariant::mask_mod(p.host_args, 0, 0, qi, ki, c.Lq, c.Lkv);
        }
      kept[qt] += n;
      if (n == in) p.full_idx[1LL * qt * p.nkt + p.full_num[qt]++] = kt;
      else if (n > 0) p.kv_idx[1LL * qt * p.nkt + p.kv_num[qt]++] = kt;
    }
  });
  double total = 0;
  for (double x : kept) total += x;
  p.unmasked = total / (1.0 * c.Lq * c.Lkv);
  return p;
}

struct DevBuf {
  void* p = nullptr;
  explicit DevBuf(size_t n) { CK(cudaMalloc(&p, std::max<size_t>(n, 16))); }
  ~DevBuf() { cudaFree(p); }
};

struct Run {
  std::vector<u16> o;
  std::vector<float> lse;
  float ms = 0;
};

Run run(const Problem& pr, int reps) {
  const Config& c = pr.c;
  DevBuf q(pr.q.size() * 2), k(pr.k.size() * 2), v(pr.v.size() * 2), o(pr.q.size() * 2),
      lse(1ULL * c.B * c.Hq * c.Lq * 4);
  CK(cudaMemcpy(q.p, pr.q.data(), pr.q.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(k.p, pr.k.data(), pr.k.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(v.p, pr.v.data(), pr.v.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemset(o.p, 0xff, pr.q.size() * 2));  // NaN poison
  CK(cudaMemset(lse.p, 0xff, 1ULL * c.B * c.Hq * c.Lq * 4));
  FlexcBlockMask bm{};
  std::vector<DevBuf*> bufs;
  auto up = [&](const std::vector<int>& x) {
    bufs.push_back(new DevBuf(x.size() * 4));
    CK(cudaMemcpy(bufs.back()->p, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
    return static_cast<const int*>(bufs.back()->p);
  };
  if (c.use_bm) {
    bm.kv_num = up(pr.kv_num), bm.kv_idx = up(pr.kv_idx);
    bm.full_kv_num = up(pr.full_num), bm.full_kv_idx = up(pr.full_idx);
    bm.nb = bm.nh = 1, bm.num_q_tiles = pr.nqt, bm.num_kv_tiles = pr.nkt;
    bm.q_tile = bm.kv_tile = 128;
  }
  FlexcAttentionParams p{};
  p.q = q.p, p.k = k.p, p.v = v.p, p.o = o.p, p.lse = static_cast<float*>(lse.p);
  strides(c, c.Hq, c.Lq, p.q_stride);
  strides(c, c.Hkv, c.Lkv, p.k_stride);
  strides(c, c.Hkv, c.Lkv, p.v_stride);
  strides(c, c.Hq, c.Lq, p.o_stride);
  p.batch = c.B, p.q_heads = c.Hq, p.kv_heads = c.Hkv, p.q_len = c.Lq, p.kv_len = c.Lkv;
  p.hook_q_len = c.Lq, p.hook_kv_len = c.Lkv;
  p.scale = 1.f / std::sqrt(static_cast<float>(kD));
  p.scale_log2 = p.scale * 1.4426950408889634f;
  CK(cudaFuncSetAttribute(flexc_attention_fwd, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          kSmemBytes));
  dim3 grid((c.Lq + kBlockM - 1) / kBlockM, c.Hq, c.B);
  auto launch = [&] { flexc_attention_fwd<<<grid, kThreads, kSmemBytes>>>(p, pr.args, bm); };
  launch();
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  Run r;
  r.o.resize(pr.q.size());
  r.lse.resize(1ULL * c.B * c.Hq * c.Lq);
  CK(cudaMemcpy(r.o.data(), o.p, r.o.size() * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(r.lse.data(), lse.p, r.lse.size() * 4, cudaMemcpyDeviceToHost));
  if (reps > 0) {
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int i = 0; i < 3; ++i) launch();
    std::vector<float> t;
    for (int i = 0; i < reps; ++i) {
      CK(cudaEventRecord(e0));
      launch();
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      t.push_back(ms);
    }
    CK(cudaGetLastError());
    std::sort(t.begin(), t.end());
    r.ms = t[t.size() / 2];
  }
  for (auto* b : bufs) delete b;
  return r;
}

// Compares `rows` (all if empty) against float64 gold and the rounding-aware ref.
bool check(const Problem& pr, const Run& r, std::vector<long long> rows, const char* what) {
  const Config& c = pr.c;
  if (rows.empty())
    for (long long i = 0; i < 1LL * c.B * c.Hq * c.Lq; ++i) rows.push_back(i);
  const double scale = 1.0 / std::sqrt(static_cast<double>(kD));
  long long so[3], sk[3];
  strides(c, c.Hq, c.Lq, so);
  strides(c, c.Hkv, c.Lkv, sk);
  struct Acc {
    double ok = 0, rg = 0, lk = 0, lr = 0;
    long long n = 0, nl = 0, bad = 0;
  };
  std::vector<Acc> acc(rows.size());
  parallel_for(static_cast<int>(rows.size()), [&](int ri) {
    Acc& a = acc[ri];
    const long long row = rows[ri];
    const int b = row / (1LL * c.Hq * c.Lq), h = (row / c.Lq) % c.Hq, qi = row % c.Lq;
    const int hk = h / (c.Hq / c.Hkv);
    const u16* q = pr.q.data() + b * so[0] + h * so[1] + qi * so[2];
    std::vector<double> s(c.Lkv), s32(c.Lkv);
    double mx = -INFINITY, mx32 = -INFINITY;
    for (int j = 0; j < c.Lkv; ++j) {
      const u16* k = pr.k.data() + b * sk[0] + hk * sk[1] + j * sk[2];
      double dot = 0;
      for (int d = 0; d < kD; ++d) dot += static_cast<double>(from16(q[d])) * from16(k[d]);
      double x = FlexcVariant::kIdentityScore
                     ? dot * scale
                     : FlexcVariant::score_mod(pr.host_args, static_cast<float>(dot * scale), b, h,
                                               qi, j, c.Lq, c.Lkv);
      if (!FlexcVariant::mask_mod(pr.host_args, b, h, qi, j, c.Lq, c.Lkv)) x = -INFINITY;
      s[j] = x;
      s32[j] = static_cast<float>(x);
      mx = std::max(mx, x), mx32 = std::max(mx32, s32[j]);
    }
    const u16* o = r.o.data() + b * so[0] + h * so[1] + qi * so[2];
    const float lse = r.lse[row];
    if (mx == -INFINITY) {  // fully masked: exactly 0 and -inf
      for (int d = 0; d < kD; ++d) a.bad += from16(o[d]) != 0.f;
      a.bad += lse != -INFINITY;
      return;
    }
    double l = 0, l32 = 0;
    for (int j = 0; j < c.Lkv; ++j) l += std::exp(s[j] - mx), l32 += std::exp(s32[j] - mx32);
    std::vector<double> gold(kD, 0), ref(kD, 0);
    for (int j = 0; j < c.Lkv; ++j) {
      if (s[j] == -INFINITY) continue;
      const double pg = std::exp(s[j] - mx), pr16 = round16(std::exp(s32[j] - mx32));
      const u16* v = pr.v.data() + b * sk[0] + hk * sk[1] + j * sk[2];
      for (int d = 0; d < kD; ++d) gold[d] += pg * from16(v[d]), ref[d] += pr16 * from16(v[d]);
    }
    for (int d = 0; d < kD; ++d) {
      const double g = gold[d] / l, rf = round16(ref[d] / l32), k = from16(o[d]);
      if (!std::isfinite(k)) ++a.bad;
      a.ok += (k - g) * (k - g), a.rg += (rf - g) * (rf - g), ++a.n;
    }
    const double lg = mx + std::log(l), lr = static_cast<float>(mx32 + std::log(l32));
    if (!std::isfinite(lse)) ++a.bad;
    a.lk += (lse - lg) * (lse - lg), a.lr += (lr - lg) * (lr - lg), ++a.nl;
  });
  Acc t;
  for (auto& a : acc)
    t.ok += a.ok, t.rg += a.rg, t.lk += a.lk, t.lr += a.lr, t.n += a.n, t.nl += a.nl,
        t.bad += a.bad;
  const double ek = std::sqrt(t.ok / std::max(1LL, t.n)), er = std::sqrt(t.rg / std::max(1LL, t.n));
  const double lk = std::sqrt(t.lk / std::max(1LL, t.nl)), lr = std::sqrt(t.lr / std::max(1LL, t.nl));
  const bool pass = t.bad == 0 && ek <= 1.5 * er + 1e-6 && lk <= 1.5 * lr + 1e-6;
  std::printf("%-5s %-15s B%d Hq%d Hkv%d Lq%-5d Lkv%-5d %s%s rows %zu: O rmse %.3g (ref %.3g) "
              "LSE rmse %.3g (ref %.3g) bad %lld\n",
              pass ? "PASS" : "FAIL", what, c.B, c.Hq, c.Hkv, c.Lq, c.Lkv, c.bshd ? "bshd" : "bhsd",
              c.use_bm ? " bm" : " dense", rows.size(), ek, er, lk, lr, t.bad);
  return pass;
}

int do_check() {
  const Config cfgs[] = {
      {2, 4, 2, 1000, 1000, false, true}, {1, 4, 1, 17, 129, true, true},
      {1, 4, 1, 17, 129, false, false},   {1, 2, 2, 1, 1000, false, true},
      {2, 2, 1, 127, 128, true, true},    {1, 2, 1, 129, 4096, false, true},
      {1, 4, 4, 1000, 777, true, true},   {1, 4, 4, 777, 1000, false, false},
  };
  bool ok = true;
  for (const auto& c : cfgs) {
    Problem p = make_problem(c, 30.f, 100, 300);
    ok &= check(p, run(p, 0), {}, FLEXC_DEV_NAME);
  }
  return ok ? 0 : 1;
}

int do_bench(bool shapes) {
  std::vector<Config> cfgs;
  if (shapes) {
    for (int S : {1024, 4096, 16384}) cfgs.push_back({16384 / S, 2048 / kD, 2048 / kD, S, S});
  } else {
    cfgs.push_back({1, 16, 16, 16384, 16384});
  }
  bool ok = true;
  for (const auto& c : cfgs) {
    Problem p = make_problem(c, 30.f, 1024, 2048, 6, true);
    Run r = run(p, 20);
    std::vector<long long> rows;
    std::uniform_int_distribution<long long> ud(0, 1LL * c.B * c.Hq * c.Lq - 1);
    for (int i = 0; i < 96; ++i) rows.push_back(ud(rng));
    ok &= check(p, r, rows, FLEXC_DEV_NAME);
    const double flops = 4.0 * c.B * c.Hq * c.Lq * c.Lkv * kD * p.unmasked;
    std::printf("BENCH %s %s D%d S%d dens %.3f %.3fms %.1f TFLOP/s\n", FLEXC_DEV_NAME,
                kBf16 ? "bf16" : "fp16", kD, c.Lq, p.unmasked, r.ms, flops / r.ms * 1e-9);
    std::printf("{\"case\": \"%s\", \"s\": %d, \"d\": %d, \"ms\": %.5f, \"tflops\": %.2f}\n",
                FLEXC_DEV_NAME, c.Lq, kD, r.ms, flops / r.ms * 1e-9);
  }
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "check";
  if (!std::strcmp(mode, "check")) return do_check();
  if (!std::strcmp(mode, "bench")) return do_bench(true);
  if (!std::strcmp(mode, "bench16k")) return do_bench(false);
  std::fprintf(stderr, "usage: %s check|bench|bench16k\n", argv[0]);
  return 2;
}
