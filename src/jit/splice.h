// Splicing: a kernel template plus a variant's generated flexc_variant.cuh, as NVRTC compiles them
// (the template is the translation unit; what it includes are in-memory headers, never files).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace flexc::jit {

inline constexpr std::string_view kVariantHeader = "flexc_variant.cuh";

struct SourceFile {
  std::string name, text;
};

// A file of templates/ by name: from $FLEXC_TEMPLATE_DIR when it is set and holds the file (for
// kernel development), else the copy embedded at build time.
std::optional<std::string> template_text(std::string_view name);
std::vector<std::string> template_names();  // embedded ones, sorted

struct Unit {
  SourceFile main;                  // the kernel template
  std::vector<SourceFile> headers;  // every quoted include it reaches, by name
};

// Throws flexc::Error for an unknown template. Includes that are neither templates nor the
// variant header are left to NVRTC (toolkit headers come through -I).
Unit splice(std::string_view template_name, std::string variant_header);

// The unit as one self-contained .cu (headers inlined once, with #line directives naming the
// original files), for `flexc compile --emit cu` and for compiling it by hand with nvcc.
std::string flatten(const Unit& unit);

}  // namespace flexc::jit
