// `--capture NAME=doc:S1,S2,... | NAME=docs:N` for the commands that build a BlockMask from the
// command line (`flexc blockmask`, `flexc ring-plan`): int32 document ids for the variant's
// captures, and the check that every capture mask_mod reads was given.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "flexc/blockmask.h"
#include "flexc/variant.h"

namespace flexc::cli {

struct MaskCaptures {
  std::vector<std::vector<int32_t>> ids;  // what `captures` points into
  std::map<std::string, CaptureData, std::less<>> captures;
};

// The --capture items for a call of B `batch`, H `heads` and the two lengths (a capture's
// symbolic dims resolve to them). Throws flexc::Error naming the option.
MaskCaptures document_captures(const Variant& v, const std::vector<std::string>& items,
                               int64_t batch, int64_t heads, int64_t q_len, int64_t kv_len);

}  // namespace flexc::cli
