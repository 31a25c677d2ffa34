// The one exception type flexc throws. what() is a complete, human-readable message: for bad
// expressions clang-style diagnostics (origin:line:col, the line, a caret, a hint); for JSON the
// path (`captures[1].dtype`); for CUDA what was being done and the driver's error name.
#pragma once

#include <stdexcept>
#include <string>

namespace flexc {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace flexc
