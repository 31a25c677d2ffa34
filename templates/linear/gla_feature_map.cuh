// A linear-attention feature map phi on q and k (include/flexc/linear.h, FeatureMap), elementwise.
// The variant's score_mod is phi (reading only its score) and score_mod_grad phi', both emitted
// from the checked expression.
//
// Compile-time configuration (src/linear/feature_map.cpp): FLEXC_BF16.
#include "flexc_hooks.cuh"
#include "flexc_variant.cuh"
#include "gla_params.cuh"
#include "tile_mma.cuh"

namespace flexc_fmap {

using namespace flexc_tile;
constexpr bool kBf16 = FLEXC_BF16 != 0;

// Eight elements (16 bytes) at a time: rows of d are 16-byte aligned (the calls' argument checks).
template <bool kGrad>
__device__ __forceinline__ void map_rows(const FlexcMapParams& p) {
  const FlexcArgs a{};
  auto phi = [&](float x) { return FlexcVariant::score_mod(a, x, 0, 0, 0, 0, 1, 1); };
  auto dphi = [&](float x) { return FlexcVariant::score_mod_grad(a, x, 0, 0, 0, 0, 1, 1); };
  const int per_row = p.d / 8;
  const long long pieces = p.n[0] * p.n[1] * p.n[2] * per_row;
  const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < pieces;
       i += step) {
    const long long r = i / per_row, i2 = r % p.n[2], i1 = r / p.n[2] % p.n[1],
                    i0 = r / p.n[2] / p.n[1];
    const int c = static_cast<int>(i % per_row) * 8;
    const uint4 xx = __ldg(reinterpret_cast<const uint4*>(static_cast<const unsigned short*>(p.x) +
                                                          i0 * p.x_stride[0] + i1 * p.x_stride[1] +
                                                          i2 * p.x_stride[2] + c));
    uint4* yp = reinterpret_cast<uint4*>(static_cast<unsigned short*>(p.y) + i0 * p.y_stride[0] +
                                         i1 * p.y_stride[1] + i2 * p.y_stride[2] + c);
    const unsigned xs[4] = {xx.x, xx.y, xx.z, xx.w};
    unsigned ys[4];
    if constexpr (kGrad) {
      const uint4 yy = *yp;
      ys[0] = yy.x, ys[1] = yy.y, ys[2] = yy.z, ys[3] = yy.w;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float x0 = unpack_lo<kBf16>(xs[j]), x1 = unpack_hi<kBf16>(xs[j]);
      ys[j] = kGrad ? pack2<kBf16>(unpack_lo<kBf16>(ys[j]) * dphi(x0),
                                   unpack_hi<kBf16>(ys[j]) * dphi(x1))
                    : pack2<kBf16>(phi(x0), phi(x1));
    }
    *yp = make_uint4(ys[0], ys[1], ys[2], ys[3]);
  }
}

}  // namespace flexc_fmap

extern "C" __global__ void __launch_bounds__(256) flexc_feature_map(const FlexcMapParams p) {
  flexc_fmap::map_rows<false>(p);
}
extern "C" __global__ void __launch_bounds__(256) flexc_feature_map_grad(const FlexcMapParams p) {
  flexc_fmap::map_rows<true>(p);
}
