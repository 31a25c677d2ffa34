// Evaluates a variant's hooks over a grid of points, one thread each, so that tests can compare
// the generated code with the CPU interpreter. The points are every (b, h, q, kv) in
// [0, B) x [0, H) x [q0, q0 + nq) x [kv0, kv0 + nkv); point i = ((b * H + h) * nq + (q - q0)) *
// nkv + (kv - kv0) reads score_in[i] and writes score_mod, score_mod_grad and mask_mod at i.
// tanh takes the form the attention kernels would give it (one per warp here).
// accumulate_capture_grads adds grad_score * d score_mod / d capture into the captures' `grad`.
// The caller keeps the points within the hooks' contract (flexc_hooks.cuh): [q0, q0 + nq) inside
// [0, q_len), [kv0, kv0 + nkv) inside [0, kv_len).
#include "flexc_hooks.cuh"
#include "flexc_variant.cuh"

extern "C" __global__ void flexc_mods_eval(FlexcArgs a, int B, int H, int q0, int nq, int kv0,
                                           int nkv, int q_len, int kv_len, const float* score_in,
                                           float* score_out, float* grad_out,
                                           unsigned char* mask_out, float grad_score) {
  const long long n = static_cast<long long>(B) * H * nq * nkv;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    long long r = i;
    const int kv = kv0 + static_cast<int>(r % nkv);
    r /= nkv;
    const int q = q0 + static_cast<int>(r % nq);
    r /= nq;
    const int h = static_cast<int>(r % H);
    const int b = static_cast<int>(r / H);
    const float s = score_in[i];
    const auto mods = [&](auto form) {
      const float score = FlexcVariant::score_mod(a, s, b, h, q, kv, q_len, kv_len, form);
      const float grad = FlexcVariant::score_mod_grad(a, s, b, h, q, kv, q_len, kv_len, form);
      if constexpr (decltype(form)::kValue) score_out[i] = score, grad_out[i] = grad;
    };
    // tanh's form as the attention kernels choose it (flexc_hooks.cuh), per warp of points.
    flexc_tanh_forms<FlexcVariant::kTanhForms>(mods);
    mask_out[i] = FlexcVariant::mask_mod(a, b, h, q, kv, q_len, kv_len) ? 1 : 0;
    FlexcGradSink<FlexcVariant::kCaptureGradLoads> grads;
    FlexcVariant::accumulate_capture_grads(a, grads, grad_score, s, b, h, q, kv, q_len, kv_len);
    grads.flush_thread();
  }
}
