// A CUDA graph captured from a flexc call, for the tests that replay calls in graphs.
#pragma once

#include <catch2/catch.hpp>
#include <functional>
#include <string>

#include "flexc/error.h"
#include "jit/driver_api.h"

namespace flexc::testing {

// What `enqueue` puts on `stream`, captured in the global capture mode (an allocation, a module
// load or a synchronization anywhere in it fails the capture) and instantiated; replay()
// launches it. A flexc error inside the capture fails the test with its message.
class CapturedGraph {
 public:
  CapturedGraph(CUstream_st* stream, const std::function<void()>& enqueue)
      : d_(jit::driver("a graph test")), stream_(reinterpret_cast<CUstream>(stream)) {
    REQUIRE(d_.cuStreamBeginCapture(stream_, CU_STREAM_CAPTURE_MODE_GLOBAL) == CUDA_SUCCESS);
    std::string error;
    try {
      enqueue();
    } catch (const Error& e) {
      error = e.what();
    }
    const CUresult ended = d_.cuStreamEndCapture(stream_, &graph_);
    INFO(error);
    REQUIRE(error.empty());
    REQUIRE(ended == CUDA_SUCCESS);
    REQUIRE(d_.cuGraphInstantiate(&exec_, graph_, 0) == CUDA_SUCCESS);
  }
  ~CapturedGraph() {
    if (exec_) d_.cuGraphExecDestroy(exec_);
    if (graph_) d_.cuGraphDestroy(graph_);
  }
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;

  void replay() const { REQUIRE(d_.cuGraphLaunch(exec_, stream_) == CUDA_SUCCESS); }

 private:
  const jit::DriverApi& d_;
  CUstream stream_;
  CUgraph graph_ = nullptr;
  CUgraphExec exec_ = nullptr;
};

}  // namespace flexc::testing
