#include "flexc/device.h"

#include <dlfcn.h>
#include <fmt/format.h>

#include <mutex>
#include <string>

#include "flexc/error.h"
#include "jit/driver_api.h"
#include "jit/jit.h"

namespace flexc::jit {

namespace {

#define FLEXC_STR2(x) #x
#define FLEXC_STR(x) FLEXC_STR2(x)

// Loads the driver once; `error` says why it is unusable (empty when it is usable).
struct Loaded {
  DriverApi api;
  std::string error;

  Loaded() {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      const char* e = dlerror();
      error = fmt::format("no CUDA driver: libcuda.so.1 could not be loaded ({})", e ? e : "?");
      return;
    }
#define FLEXC_RESOLVE(name)                                                     \
  api.name = reinterpret_cast<decltype(api.name)>(dlsym(lib, FLEXC_STR(name))); \
  if (!api.name) {                                                              \
    error = "the CUDA driver is too old for flexc: it lacks " FLEXC_STR(name);  \
    return;                                                                     \
  }
    FLEXC_CUDA_DRIVER_FUNCTIONS(FLEXC_RESOLVE)
#undef FLEXC_RESOLVE
    const CUresult r = api.cuInit(0);
    if (r != CUDA_SUCCESS) {
      const char* name = nullptr;
      api.cuGetErrorName(r, &name);
      error =
          name ? fmt::format("the CUDA driver failed to initialise: {}", name)
               : fmt::format("the CUDA driver failed to initialise: error {}", static_cast<int>(r));
    }
  }
};

const Loaded& loaded() {
  static const Loaded l;
  return l;
}

}  // namespace

const DriverApi& driver(std::string_view doing) {
  const Loaded& l = loaded();
  if (!l.error.empty()) throw Error(fmt::format("{}: {}", doing, l.error));
  return l.api;
}

void check(CUresult r, std::string_view doing) {
  if (r == CUDA_SUCCESS) return;
  const char* name = nullptr;
  if (loaded().api.cuGetErrorName) loaded().api.cuGetErrorName(r, &name);
  throw Error(name ? fmt::format("{}: {}", doing, name)
                   : fmt::format("{}: CUDA error {}", doing, static_cast<int>(r)));
}

CUcontext current_context() {
  const DriverApi& d = driver("getting the current CUDA context");
  CUcontext ctx = nullptr;
  check(d.cuCtxGetCurrent(&ctx), "getting the current CUDA context");
  if (ctx) return ctx;
  CUdevice dev = 0;
  check(d.cuDeviceGet(&dev, 0), "getting CUDA device 0");
  check(d.cuDevicePrimaryCtxRetain(&ctx, dev), "retaining the primary context of CUDA device 0");
  check(d.cuCtxSetCurrent(ctx), "making the primary context of CUDA device 0 current");
  return ctx;
}

}  // namespace flexc::jit

// ---- the public device API (flexc/device.h)
namespace flexc {

using jit::check;
using jit::current_context;
using jit::driver;
using jit::DriverApi;
using jit::loaded;

bool gpu_available() {
  static const bool available = [] {
    const jit::Loaded& l = loaded();
    int n = 0;
    return l.error.empty() && l.api.cuDeviceGetCount(&n) == CUDA_SUCCESS && n > 0;
  }();
  return available;
}

int device_count() {
  if (!gpu_available()) return 0;
  int n = 0;
  check(driver("counting CUDA devices").cuDeviceGetCount(&n), "counting CUDA devices");
  return n;
}

void use_device(int ordinal) {
  const std::string doing = fmt::format("making CUDA device {} current", ordinal);
  const DriverApi& d = driver(doing);
  const int n = device_count();
  if (ordinal < 0 || ordinal >= n)
    throw Error(fmt::format("{}: there are {} devices (0 .. {})", doing, n, n - 1));
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  check(d.cuDeviceGet(&dev, ordinal), doing);
  check(d.cuDevicePrimaryCtxRetain(&ctx, dev), doing);
  check(d.cuCtxSetCurrent(ctx), doing);
}

int current_device() {
  current_context();
  CUdevice dev = 0;
  check(driver("querying the current device").cuCtxGetDevice(&dev), "querying the current device");
  return static_cast<int>(dev);
}

std::string current_arch() {
  current_context();
  const DriverApi& d = driver("querying the GPU's architecture");
  CUdevice dev = 0;
  int major = 0, minor = 0;
  check(d.cuCtxGetDevice(&dev), "querying the current context's device");
  check(d.cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev),
        "querying the GPU's compute capability");
  check(d.cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev),
        "querying the GPU's compute capability");
  return fmt::format("sm_{}{}", major, minor);
}

// ---- DeviceBuffer

DeviceBuffer::DeviceBuffer(size_t bytes) : size_(bytes) {
  const std::string doing = fmt::format("allocating {} bytes of GPU memory", bytes);
  const DriverApi& d = driver(doing);
  current_context();
  CUdeviceptr p = 0;
  check(d.cuMemAlloc(&p, bytes ? bytes : 1), doing);
  ptr_ = p;
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_) loaded().api.cuMemFree(ptr_);  // nothing useful to do with an error here
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), size_(o.size_) {
  o.ptr_ = 0;
  o.size_ = 0;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_) loaded().api.cuMemFree(ptr_);
    ptr_ = o.ptr_;
    size_ = o.size_;
    o.ptr_ = 0;
    o.size_ = 0;
  }
  return *this;
}

static void check_range(size_t offset, size_t bytes, size_t size, const char* doing) {
  if (offset > size || bytes > size - offset)
    throw Error(fmt::format("{} {} bytes at offset {} of a {}-byte GPU buffer: out of range", doing,
                            bytes, offset, size));
}

void DeviceBuffer::upload(const void* src, size_t bytes, size_t offset, CUstream_st* stream) {
  check_range(offset, bytes, size_, "copying");
  const DriverApi& d = driver("copying to the GPU");
  const std::string doing = fmt::format("copying {} bytes to the GPU", bytes);
  check(stream ? d.cuMemcpyHtoDAsync(ptr_ + offset, src, bytes, stream)
               : d.cuMemcpyHtoD(ptr_ + offset, src, bytes),
        doing);
}

void DeviceBuffer::download(void* dst, size_t bytes, size_t offset, CUstream_st* stream) const {
  check_range(offset, bytes, size_, "copying");
  const DriverApi& d = driver("copying from the GPU");
  const std::string doing = fmt::format("copying {} bytes from the GPU", bytes);
  check(stream ? d.cuMemcpyDtoHAsync(dst, ptr_ + offset, bytes, stream)
               : d.cuMemcpyDtoH(dst, ptr_ + offset, bytes),
        doing);
}

void DeviceBuffer::fill(uint8_t byte, CUstream_st* stream) {
  const DriverApi& d = driver("filling GPU memory");
  check(stream ? d.cuMemsetD8Async(ptr_, byte, size_, stream) : d.cuMemsetD8(ptr_, byte, size_),
        "filling GPU memory");
}

// ---- Stream, EventTimer

Stream::Stream() : Stream(StreamPriority::Normal) {}

Stream::Stream(StreamPriority priority) {
  const DriverApi& d = driver("creating a CUDA stream");
  current_context();
  if (priority == StreamPriority::Normal) {
    check(d.cuStreamCreate(&s_, CU_STREAM_NON_BLOCKING), "creating a CUDA stream");
    return;
  }
  int least = 0, greatest = 0;  // greatest is the most negative
  check(d.cuCtxGetStreamPriorityRange(&least, &greatest), "asking the stream priority range");
  check(d.cuStreamCreateWithPriority(&s_, CU_STREAM_NON_BLOCKING, greatest),
        "creating a CUDA stream");
}

Stream::~Stream() {
  if (s_) loaded().api.cuStreamDestroy(s_);
}

void Stream::synchronize() const {
  check(driver("waiting for a CUDA stream").cuStreamSynchronize(s_), "waiting for a CUDA stream");
}

EventTimer::EventTimer() {
  const DriverApi& d = driver("creating CUDA events");
  current_context();
  check(d.cuEventCreate(&start_, CU_EVENT_DEFAULT), "creating a CUDA event");
  const CUresult r = d.cuEventCreate(&stop_, CU_EVENT_DEFAULT);
  if (r != CUDA_SUCCESS) {
    d.cuEventDestroy(start_);  // the destructor does not run for a throwing constructor
    start_ = nullptr;
    check(r, "creating a CUDA event");
  }
}

EventTimer::~EventTimer() {
  if (start_) loaded().api.cuEventDestroy(start_);
  if (stop_) loaded().api.cuEventDestroy(stop_);
}

void EventTimer::start(CUstream_st* stream) {
  check(driver("recording a CUDA event").cuEventRecord(start_, stream), "recording a CUDA event");
}

void EventTimer::stop(CUstream_st* stream) {
  check(driver("recording a CUDA event").cuEventRecord(stop_, stream), "recording a CUDA event");
}

double EventTimer::elapsed_ms() const {
  const DriverApi& d = driver("timing with CUDA events");
  check(d.cuEventSynchronize(stop_), "waiting for a CUDA event");
  float ms = 0;
  check(d.cuEventElapsedTime(&ms, start_, stop_), "reading a CUDA event timer");
  return ms;
}

void synchronize_device() {
  check(driver("waiting for the GPU").cuCtxSynchronize(), "waiting for the GPU");
}

}  // namespace flexc
