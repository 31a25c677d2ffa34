// The CUDA Driver API, loaded at run time with dlopen("libcuda.so.1") so that flexc links and runs
// (compile-only) on machines without a driver. For flexc's own sources in src/ only: it includes
// cuda.h from the toolkit; code outside src/ uses src/jit/driver.h.
#pragma once

#include <cuda.h>

#include <string>
#include <string_view>

namespace flexc::jit {

// Every driver function flexc calls. cuda.h maps the names to their current ABI versions
// (cuMemAlloc -> cuMemAlloc_v2, ...); the loader resolves exactly those.
// clang-format off
#define FLEXC_CUDA_DRIVER_FUNCTIONS(X)                                                          \
  X(cuInit) X(cuGetErrorName) X(cuDeviceGet) X(cuDeviceGetCount) X(cuDeviceGetAttribute)        \
  X(cuDevicePrimaryCtxRetain) X(cuCtxGetCurrent) X(cuCtxSetCurrent) X(cuCtxGetDevice)           \
  X(cuCtxSynchronize) X(cuModuleLoadData) X(cuModuleUnload) X(cuModuleGetFunction)             \
  X(cuFuncSetAttribute) X(cuFuncGetAttribute) X(cuLaunchKernel) X(cuMemAlloc) X(cuMemFree)       \
  X(cuMemcpyHtoD) X(cuMemcpyDtoH) X(cuMemcpyHtoDAsync) X(cuMemcpyDtoHAsync) X(cuMemsetD8)        \
  X(cuMemsetD8Async) X(cuMemsetD32Async) X(cuMemcpy2DAsync)                                     \
  X(cuStreamCreate) X(cuStreamCreateWithPriority) X(cuCtxGetStreamPriorityRange)              \
  X(cuStreamDestroy) X(cuStreamSynchronize) X(cuStreamWaitEvent)                                \
  X(cuEventCreate) X(cuEventDestroy) X(cuEventRecord) X(cuEventSynchronize)                     \
  X(cuEventElapsedTime) X(cuTensorMapEncodeTiled) X(cuMemAllocAsync) X(cuMemFreeAsync)        \
  X(cuMemPoolCreate) X(cuMemPoolSetAttribute) X(cuMemAllocFromPoolAsync) X(cuStreamBeginCapture) \
  X(cuStreamEndCapture) X(cuGraphInstantiate) X(cuGraphLaunch) X(cuGraphExecDestroy)             \
  X(cuGraphDestroy) X(cuLaunchKernelEx)
// clang-format on

struct DriverApi {
#define FLEXC_DRIVER_MEMBER(name) decltype(&::name) name = nullptr;
  FLEXC_CUDA_DRIVER_FUNCTIONS(FLEXC_DRIVER_MEMBER)
#undef FLEXC_DRIVER_MEMBER
};

// The loaded driver with cuInit done. Throws flexc::Error saying what was being done and why no
// driver is usable (library missing, a symbol missing, cuInit failing).
const DriverApi& driver(std::string_view doing);

// Throws flexc::Error("<doing>: CUDA_ERROR_...") unless r is CUDA_SUCCESS.
void check(CUresult r, std::string_view doing);

// The calling thread's current context; when it has none, device 0's primary context (the one
// the CUDA runtime uses too) is retained and made current.
CUcontext current_context();

}  // namespace flexc::jit
