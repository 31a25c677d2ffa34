// Tensors from any DLPack producer (torch, JAX, CuPy, numpy) as flexc::TensorViews, for the
// module's GPU entry points. The structs are DLPack's ABI (legacy, unversioned capsules named
// "dltensor": what every producer returns when the consumer asks for no max_version), written out
// here rather than taken as a dependency: they are fixed by the standard.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "flexc/tensor.h"

namespace flexc::python {

struct DLDevice {
  int32_t device_type;  // kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, kDLCUDAManaged = 13
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;  // kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4, kDLBool = 6
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; null: compact row-major
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

// Tensors borrowed for one call: each DLPack capsule's deleter runs when the call returns (the
// caller's own objects keep the memory alive while the kernels run on its stream).
class Borrowed {
 public:
  Borrowed() = default;
  Borrowed(const Borrowed&) = delete;
  Borrowed& operator=(const Borrowed&) = delete;
  ~Borrowed();

  // The view of `obj` (anything with __dlpack__ / __dlpack_device__), `name` naming it in
  // errors. `stream`: the consumer's CUDA stream handed to a CUDA producer (DLPack's convention:
  // 1 = the legacy default stream), so that the data is ready on it. `cuda`: refuse a tensor that
  // is not in CUDA device memory.
  // A tuple is taken as a raw view instead: (data_ptr, dtype name, shape, strides in elements,
  // CUDA device index), which flexc.torch reads off torch tensors it has checked are on the GPU
  // (torch's __dlpack__ costs about 25 us a tensor in Python; this, about 1).
  TensorView view(pybind11::handle obj, const std::string& name, int64_t stream, bool cuda);
  // The same for an optional argument: None gives no view.
  std::optional<TensorView> view_or_none(pybind11::handle obj, const std::string& name,
                                         int64_t stream, bool cuda) {
    if (obj.is_none()) return std::nullopt;
    return view(obj, name, stream, cuda);
  }
  // The CUDA device of the CUDA tensors seen so far (-1: none yet); views on two devices are an
  // error.
  int device() const { return device_; }

 private:
  TensorView raw_view(const pybind11::tuple& t, const std::string& name);
  std::vector<DLManagedTensor*> held_;
  int device_ = -1;
};

}  // namespace flexc::python
