// flexc::LocalCommunicators: a ring of this process's GPUs (ncclCommInitAll).
#include <fmt/format.h>

#include <numeric>

#include "flexc/device.h"
#include "flexc/error.h"
#include "flexc/ring.h"
#include "nccl.h"

namespace flexc {

LocalCommunicators::LocalCommunicators(int ranks) {
  constexpr std::string_view what = "flexc::LocalCommunicators";
  const int devices = device_count();
  if (ranks < 1 || ranks > devices)
    throw Error(fmt::format("{}: {} ranks need as many CUDA devices; this machine has {}", what,
                            ranks, devices));
  const nccl::Api& n = nccl::api(what);
  std::vector<int> list(static_cast<size_t>(ranks));
  std::iota(list.begin(), list.end(), 0);
  comms_.assign(size_t(ranks), nullptr);
  nccl::check(n, n.ncclCommInitAll(comms_.data(), ranks, list.data()), what, "ncclCommInitAll");
}

LocalCommunicators::~LocalCommunicators() {
  if (comms_.empty() || comms_[0] == nullptr || aborted_) return;
  const nccl::Api& n = nccl::api("flexc::LocalCommunicators");
  for (ncclComm* c : comms_) n.ncclCommDestroy(c);  // nothing useful to do with an error here
}

void LocalCommunicators::abort() {
  if (comms_.empty() || comms_[0] == nullptr || aborted_.exchange(true)) return;
  const nccl::Api& n = nccl::api("flexc::LocalCommunicators");
  for (ncclComm* c : comms_) n.ncclCommAbort(c);  // frees them too
}

}  // namespace flexc
