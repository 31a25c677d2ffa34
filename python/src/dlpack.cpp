#include "dlpack.h"

#include <fmt/format.h>
#include <pybind11/stl.h>

#include "flexc/error.h"

namespace py = pybind11;

namespace flexc::python {

namespace {

constexpr int32_t kCpu = 1, kCuda = 2, kCudaHost = 3, kCudaManaged = 13;

const char* device_name(int32_t type) {
  switch (type) {
    case kCpu: return "cpu";
    case kCuda: return "cuda";
    case kCudaHost: return "cuda pinned host";
    case kCudaManaged: return "cuda managed";
    default: return "non-CUDA";
  }
}

DType dtype_of(const DLDataType& t, const std::string& name) {
  if (t.lanes == 1) {
    if (t.code == 2 && t.bits == 32) return DType::F32;
    if (t.code == 2 && t.bits == 16) return DType::F16;
    if (t.code == 4 && t.bits == 16) return DType::BF16;
    if (t.code == 0 && t.bits == 32) return DType::I32;
    if ((t.code == 6 || t.code == 1) && t.bits == 8) return DType::Bool;
  }
  throw Error(fmt::format("{}: DLPack dtype (code {}, {} bits, {} lanes) is not one flexc reads "
                          "(bfloat16, float16, float32, int32, bool)",
                          name, t.code, t.bits, t.lanes));
}

}  // namespace

Borrowed::~Borrowed() {
  for (DLManagedTensor* t : held_)
    if (t->deleter) t->deleter(t);
}

TensorView Borrowed::view(py::handle obj, const std::string& name, int64_t stream, bool cuda) {
  if (py::isinstance<py::tuple>(obj)) return raw_view(obj.cast<py::tuple>(), name);
  if (!py::hasattr(obj, "__dlpack__") || !py::hasattr(obj, "__dlpack_device__"))
    throw Error(fmt::format("{}: expected a tensor with __dlpack__ (torch, JAX, CuPy, numpy); got "
                            "{}",
                            name, py::str(py::type::handle_of(obj)).cast<std::string>()));
  const auto dev = obj.attr("__dlpack_device__")().cast<std::pair<int32_t, int32_t>>();
  const bool on_cuda = dev.first == kCuda || dev.first == kCudaManaged;
  if (cuda && !on_cuda)
    throw Error(fmt::format("{} is in {} memory; flexc's kernels take CUDA device tensors", name,
                            device_name(dev.first)));
  // A CUDA producer makes the data ready on the consumer's stream; others take no stream.
  py::object capsule = on_cuda ? obj.attr("__dlpack__")(py::arg("stream") = stream)
                               : obj.attr("__dlpack__")();
  auto* t = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
  if (t == nullptr) {
    PyErr_Clear();
    throw Error(fmt::format("{}: __dlpack__ returned no 'dltensor' capsule", name));
  }
  PyCapsule_SetName(capsule.ptr(), "used_dltensor");  // ours now: the deleter runs in ~Borrowed
  held_.push_back(t);
  const DLTensor& d = t->dl_tensor;
  if (on_cuda) {
    if (device_ >= 0 && d.device.device_id != device_)
      throw Error(fmt::format("{} is on CUDA device {}, other tensors on device {}", name,
                              d.device.device_id, device_));
    device_ = d.device.device_id;
  }
  TensorView v;
  v.dtype = dtype_of(d.dtype, name);
  v.data = static_cast<char*>(d.data) + d.byte_offset;
  v.shape.assign(d.shape, d.shape + d.ndim);
  if (d.strides != nullptr) v.strides.assign(d.strides, d.strides + d.ndim);
  return v;
}

TensorView Borrowed::raw_view(const py::tuple& t, const std::string& name) {
  if (t.size() != 5)
    throw Error(fmt::format("{}: a raw view is (data_ptr, dtype, shape, strides, CUDA device); "
                            "got a tuple of {}",
                            name, t.size()));
  TensorView v;
  v.data = reinterpret_cast<void*>(t[0].cast<uintptr_t>());
  v.dtype = parse_dtype(t[1].cast<std::string>());
  v.shape = t[2].cast<std::vector<int64_t>>();
  v.strides = t[3].cast<std::vector<int64_t>>();
  const int dev = t[4].cast<int>();
  if (device_ >= 0 && dev != device_)
    throw Error(fmt::format("{} is on CUDA device {}, other tensors on device {}", name, dev,
                            device_));
  device_ = dev;
  return v;
}

}  // namespace flexc::python
