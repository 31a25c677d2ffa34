// What the forward and backward CPU references share: input checks, rounding to the kernel's
// dtype, and a thread pool over chunks of work.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "attention/attention_args.h"
#include "dsl/analysis.h"
#include "flexc/reference.h"
#include "variant_impl.h"

namespace flexc::detail {

// x as the kernel stores it in dtype d (float32 included: a gate's gradient in g's type).
inline double round_to(DType d, double x) {
  const float f = static_cast<float>(x);
  switch (d) {
    case DType::BF16:
      return bf16_to_float(float_to_bf16(f));
    case DType::F16:
      return fp16_to_float(float_to_fp16(f));
    default:
      return f;
  }
}

// Runs f(begin, end) over [0, n) in chunks on every hardware thread.
template <class F>
void parallel_chunks(int64_t n, int64_t chunk, F f) {
  std::atomic<int64_t> next{0};
  auto work = [&] {
    for (int64_t i; (i = next.fetch_add(chunk)) < n;) f(i, std::min(n, i + chunk));
  };
  const unsigned nt = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> threads;
  for (unsigned t = 1; t < nt; ++t) threads.emplace_back(work);
  work();
  for (auto& t : threads) t.join();
}

// A reference problem's checked inputs, as the interpreter takes them.
struct ReferenceInputs {
  double scale = 0;
  std::vector<double> params;
  std::vector<dsl::HostTensor> captures;  // by slot; empty data where the variant reads none
  Positions pos;  // resolved (decode: 0, 0, KV_LEN, KV_LEN; the rows' own positions apart)
};

// Checks sizes, dtype, params and captures; throws flexc::Error starting with `what`.
ReferenceInputs check_reference_inputs(const VariantImpl& impl, const ReferenceProblem& p,
                                       const std::string& what);

}  // namespace flexc::detail
