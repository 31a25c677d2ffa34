// Hand-written stand-ins for the generated flexc_variant.cuh, for developing kernel templates
// with plain nvcc (tools/dev/attention_fwd_dev.cu). FLEXC_DEV_VARIANT picks one; the hooks are
// __host__ __device__ so the harness's CPU reference calls the very same functions.
#pragma once

#include <math.h>

#include "flexc_hooks.cuh"

#define FLEXC_DEV_HD __host__ __device__ __forceinline__

struct FlexcVariantBase {
  static constexpr bool kIdentityScore = true;
  static constexpr bool kMaskAlwaysTrue = true;
  FLEXC_DEV_HD static float score_mod(const FlexcArgs&, float s, int, int, int, int, int, int) {
    return s;
  }
  FLEXC_DEV_HD static bool mask_mod(const FlexcArgs&, int, int, int, int, int, int) { return true; }
};

#if FLEXC_DEV_VARIANT == 0  // noop
#define FLEXC_DEV_NAME "noop"
struct FlexcVariant : FlexcVariantBase {};

#elif FLEXC_DEV_VARIANT == 1  // causal
#define FLEXC_DEV_NAME "causal"
struct FlexcVariant : FlexcVariantBase {
  static constexpr bool kMaskAlwaysTrue = false;
  FLEXC_DEV_HD static bool mask_mod(const FlexcArgs&, int, int, int q, int kv, int, int) {
    return q >= kv;
  }
};

#elif FLEXC_DEV_VARIANT == 2  // alibi: captures[0] = slope float32 [H]
#define FLEXC_DEV_NAME "alibi"
struct FlexcVariant : FlexcVariantBase {
  static constexpr bool kIdentityScore = false;
  FLEXC_DEV_HD static float score_mod(const FlexcArgs& a, float s, int, int h, int q, int kv, int,
                                      int) {
    return s + static_cast<const float*>(a.captures[0].data)[h] * static_cast<float>(kv - q);
  }
};

#elif FLEXC_DEV_VARIANT == 3  // softcap: fparam[0] = cap
#define FLEXC_DEV_NAME "softcap"
struct FlexcVariant : FlexcVariantBase {
  static constexpr bool kIdentityScore = false;
  FLEXC_DEV_HD static float score_mod(const FlexcArgs& a, float s, int, int, int, int, int, int) {
    return a.fparam[0] * tanhf(s / a.fparam[0]);
  }
};

#elif FLEXC_DEV_VARIANT == 4  // sliding window + causal: iparam[0] = window
#define FLEXC_DEV_NAME "sliding_window"
struct FlexcVariant : FlexcVariantBase {
  static constexpr bool kMaskAlwaysTrue = false;
  FLEXC_DEV_HD static bool mask_mod(const FlexcArgs& a, int, int, int q, int kv, int, int) {
    return q >= kv && q - kv < a.iparam[0];
  }
};

#elif FLEXC_DEV_VARIANT == 5  // prefix LM: iparam[0] = prefix
#define FLEXC_DEV_NAME "prefix_lm"
struct FlexcVariant : FlexcVariantBase {
  static constexpr bool kMaskAlwaysTrue = false;
  FLEXC_DEV_HD static bool mask_mod(const FlexcArgs& a, int, int, int q, int kv, int, int) {
    return kv < a.iparam[0] || q >= kv;
  }
};

#elif FLEXC_DEV_VARIANT == 6  // document: captures[0] = doc int32 [KV_LEN]
#define FLEXC_DEV_NAME "document"
struct FlexcVariant : FlexcVariantBase {
  static constexpr bool kMaskAlwaysTrue = false;
  FLEXC_DEV_HD static bool mask_mod(const FlexcArgs& a, int, int, int q, int kv, int, int) {
    // As the generated code reads it: q wraps (doc is [KV_LEN]; q >= 0, so % is the wrap), kv
    // is in range (the hooks' contract, flexc_hooks.cuh).
    const int* doc = static_cast<const int*>(a.captures[0].data);
    return doc[q % a.captures[0].shape[0]] == doc[kv];
  }
};

#elif FLEXC_DEV_VARIANT == 7  // rows without any unmasked element, by mask and by score_mod
#define FLEXC_DEV_NAME "holes"
struct FlexcVariant : FlexcVariantBase {
  static constexpr bool kIdentityScore = false;
  static constexpr bool kMaskAlwaysTrue = false;
  FLEXC_DEV_HD static float score_mod(const FlexcArgs&, float s, int, int, int q, int, int, int) {
    return q % 5 == 1 ? -INFINITY : s;
  }
  FLEXC_DEV_HD static bool mask_mod(const FlexcArgs&, int, int, int q, int kv, int, int) {
    return q % 3 != 0 && (kv + q) % 7 != 0;
  }
};
#endif
