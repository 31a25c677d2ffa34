// NVRTC (src/jit/nvrtc_api.h loads it): the compiler's identity (part of every cache key), the
// options flexc compiles with, and compile errors turned into diagnostics.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dsl/ir.h"
#include "splice.h"

namespace flexc::jit {

// "nvrtc 13.0 /usr/local/cuda/lib64/libnvrtc.so.13.0.48 (123456 bytes)": the version and which
// library build is loaded.
const std::string& nvrtc_identity();

// Throws flexc::Error unless NVRTC can target `arch` (sm_80, sm_90a, compute_90, ...).
void check_arch(std::string_view arch);

// Every option, in order: the architecture, the dialect, --no-cache where NVRTC has a cache of
// its own, the kernel's -D defines, and -lineinfo when FLEXC_LINEINFO=1. No include directories:
// the templates include no toolkit header.
std::vector<std::string> nvrtc_options(
    std::string_view arch, const std::vector<std::pair<std::string, std::string>>& defines);

// What a failed compile is about, to turn NVRTC's log into messages users can act on.
struct ErrorContext {
  std::string what;                 // "compiling the flexc mods_eval kernel for 'alibi' (sm_90)"
  std::string_view variant_header;  // the generated flexc_variant.cuh
  const dsl::Mod* score = nullptr;  // where `// @score_mod:b:e` markers point
  const dsl::Mod* mask = nullptr;   // where `// @mask_mod:b:e` markers point
};

// One message per error in the log: an error on a generated line with a marker becomes a
// diagnostic at the user's expression; one in a template names templates/<file>:<line>.
std::string explain_nvrtc_log(std::string_view log, const ErrorContext& ctx);

struct NvrtcOutput {
  std::string cubin;  // empty for a virtual (compute_XX) architecture
  std::string ptx;
  std::string log;  // NVRTC's messages (warnings; ptxas statistics with --ptxas-options=-v)
  double seconds = 0;
};
// Throws flexc::Error with explain_nvrtc_log's text when the unit does not compile.
NvrtcOutput nvrtc_compile(const Unit& unit, const std::vector<std::string>& options,
                          const ErrorContext& ctx);

}  // namespace flexc::jit
