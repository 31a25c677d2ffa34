// The hook ABI on the host: templates/flexc_hooks.cuh itself (its device helpers are compiled for
// the device only), so host and device share one definition of FlexcArgs, FlexcCapture and
// FlexcBlockMask. The asserts pin the layout: changing it must be deliberate, and both compilers
// (g++ for the host, NVRTC for the kernels) lay these plain structs out alike.
#pragma once

#include <cstddef>

#include "templates/flexc_hooks.cuh"

static_assert(sizeof(FlexcCapture) == 64 && offsetof(FlexcCapture, grad) == 8 &&
              offsetof(FlexcCapture, shape) == 16 && offsetof(FlexcCapture, stride) == 32);
static_assert(sizeof(FlexcArgs) == FLEXC_MAX_CAPTURES * 64 + FLEXC_MAX_PARAMS * 8 &&
              offsetof(FlexcArgs, fparam) == FLEXC_MAX_CAPTURES * 64 &&
              offsetof(FlexcArgs, iparam) == FLEXC_MAX_CAPTURES * 64 + FLEXC_MAX_PARAMS * 4);
static_assert(sizeof(FlexcBlockMask) == 8 * sizeof(void*) + 6 * sizeof(int) &&
              offsetof(FlexcBlockMask, nb) == 8 * sizeof(void*));
