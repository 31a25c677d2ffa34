// GPU memory, streams and timing for callers that have no CUDA runtime of their own (the flexc
// CLI, benchmarks, C++ programs handing flexc device tensors): small RAII helpers over the CUDA
// Driver API, which flexc loads at run time. No CUDA header is needed to use them; everything runs
// in the current context, or device 0's primary context when there is none.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

struct CUstream_st;
struct CUevent_st;

namespace flexc {

using DevicePtr = unsigned long long;  // CUdeviceptr

// Device memory, freed on destruction. Copies are synchronous unless a stream is given.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // A buffer holding a copy of `host`.
  template <class T>
  static DeviceBuffer from(std::span<const T> host) {
    DeviceBuffer b(host.size_bytes());
    b.upload(host.data(), host.size_bytes());
    return b;
  }
  // The first `n` elements, copied back.
  template <class T>
  std::vector<T> to_vector(size_t n) const {
    std::vector<T> v(n);
    download(v.data(), n * sizeof(T));
    return v;
  }

  void upload(const void* src, size_t bytes, size_t offset = 0, CUstream_st* stream = nullptr);
  void download(void* dst, size_t bytes, size_t offset = 0, CUstream_st* stream = nullptr) const;
  void fill(uint8_t byte, CUstream_st* stream = nullptr);

  DevicePtr ptr() const { return ptr_; }
  void* get() const { return reinterpret_cast<void*>(ptr_); }
  size_t size() const { return size_; }

 private:
  DevicePtr ptr_ = 0;
  size_t size_ = 0;
};

// How the GPU schedules a stream's kernels against other streams' waiting ones: High's start
// first (the CUDA driver's greatest priority), as soon as an SM has room.
enum class StreamPriority { Normal, High };

// A stream of the current context, destroyed with the object.
class Stream {
 public:
  Stream();
  explicit Stream(StreamPriority priority);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  CUstream_st* get() const { return s_; }
  void synchronize() const;

 private:
  CUstream_st* s_ = nullptr;
};

// GPU time between start() and stop() on a stream, from two events.
class EventTimer {
 public:
  EventTimer();
  ~EventTimer();
  EventTimer(const EventTimer&) = delete;
  EventTimer& operator=(const EventTimer&) = delete;
  void start(CUstream_st* stream = nullptr);
  void stop(CUstream_st* stream = nullptr);
  double elapsed_ms() const;  // waits for the stop event

 private:
  CUevent_st *start_ = nullptr, *stop_ = nullptr;
};

// Waits for all work of the current context.
void synchronize_device();

// True when a CUDA driver and at least one device are present.
bool gpu_available();

// The number of CUDA devices (0 without a driver or a device).
int device_count();
// Makes device `ordinal`'s primary context current on the calling thread: flexc's calls from this
// thread then run there (one thread per GPU, as `flexc run --ranks` drives ring attention).
// Throws flexc::Error naming the ordinal when there is no such device.
void use_device(int ordinal);
// The ordinal of the current context's device (device 0's primary context when none is current).
int current_device();

// "sm_90" for the device of the current context. Throws flexc::Error when there is no GPU.
std::string current_arch();

}  // namespace flexc
