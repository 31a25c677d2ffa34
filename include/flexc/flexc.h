// flexc's public C++ API in one include: variants (flexc/variant.h), BlockMasks
// (flexc/blockmask.h), the attention kernels (flexc/attention.h), decode over a KV cache
// (flexc/decode.h), gated linear attention (flexc/linear.h) and their tensor views
// (flexc/tensor.h), the float64 CPU reference (flexc/reference.h), .npy files (flexc/npy.h) and
// ring attention's schedule (flexc/ring.h).
#pragma once

#include "flexc/attention.h"
#include "flexc/blockmask.h"
#include "flexc/decode.h"
#include "flexc/error.h"
#include "flexc/linear.h"
#include "flexc/npy.h"
#include "flexc/reference.h"
#include "flexc/ring.h"
#include "flexc/tensor.h"
#include "flexc/variant.h"
