// NCCL, loaded at run time (dlopen) so that flexc builds and runs without it where no ring
// attention is asked for. The few declarations flexc needs are NCCL's ABI, stable since 2.x (the
// opaque communicator, result codes, the uint8 / int64 data types, the unique id).
//
// The library: the instance already loaded in the process when there is one (a communicator
// belongs to the library instance that made it: torch.distributed's, MPI's), else
// $FLEXC_NCCL, else libnccl.so.2 from the loader's search path, $CUDA_HOME / $CUDA_PATH /
// /usr/local/cuda (lib and lib64).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <type_traits>

struct ncclComm;  // NCCL's ncclComm_t is `ncclComm*`
struct CUstream_st;

namespace flexc::nccl {

using Result = int;  // ncclResult_t: 0 is ncclSuccess
enum DataType : int { kUint8 = 1, kInt64 = 4 };
struct UniqueId {
  char internal[128];
};

// Each function's name and type.
#define FLEXC_NCCL_FUNCTIONS(X)                                                  \
  X(ncclGetVersion, Result(int*))                                                \
  X(ncclGetErrorString, const char*(Result))                                     \
  X(ncclCommCount, Result(ncclComm*, int*))                                      \
  X(ncclCommUserRank, Result(ncclComm*, int*))                                   \
  X(ncclCommCuDevice, Result(ncclComm*, int*))                                   \
  X(ncclCommInitAll, Result(ncclComm**, int, const int*))                        \
  X(ncclCommDestroy, Result(ncclComm*))                                          \
  X(ncclCommAbort, Result(ncclComm*))                                            \
  X(ncclGroupStart, Result())                                                    \
  X(ncclGroupEnd, Result())                                                      \
  X(ncclSend, Result(const void*, size_t, int, int, ncclComm*, CUstream_st*))    \
  X(ncclRecv, Result(void*, size_t, int, int, ncclComm*, CUstream_st*))          \
  X(ncclAllGather, Result(const void*, void*, size_t, int, ncclComm*, CUstream_st*))

struct Api {
#define FLEXC_NCCL_MEMBER(name, ...) std::add_pointer_t<__VA_ARGS__> name = nullptr;
  FLEXC_NCCL_FUNCTIONS(FLEXC_NCCL_MEMBER)
#undef FLEXC_NCCL_MEMBER
  std::string path;  // the library's file
  int version = 0;   // ncclGetVersion's: 22703 for 2.27.3
};

// The loaded library. Throws flexc::Error "<what>: NCCL ... was not found. Tried: ..." listing
// each place and why it failed.
const Api& api(std::string_view what);

// Throws flexc::Error "<what>: <call> failed: <NCCL's message>" unless r is ncclSuccess.
void check(const Api& a, Result r, std::string_view what, std::string_view call);

}  // namespace flexc::nccl
