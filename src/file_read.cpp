#include "file_read.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "flexc/error.h"

namespace flexc::detail {

std::string human_size(uint64_t n) {
  const char* units[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  uint64_t whole = n;
  while (whole >= 1024 && u < 6) whole /= 1024, ++u;
  if (u == 0) return fmt::format("{} {}", n, n == 1 ? "byte" : "bytes");
  const double v = static_cast<double>(n) / static_cast<double>(uint64_t{1} << (10 * u));
  return v == static_cast<double>(whole) ? fmt::format("{} {}", whole, units[u])
                                         : fmt::format("{:.1f} {}", v, units[u]);
}

std::string read_regular_file(const std::filesystem::path& path, uint64_t max_bytes,
                              std::string_view what) {
  const auto fail = [&](const std::string& why) {
    return Error(fmt::format("cannot read {} {}: {}", what, path.string(), why));
  };
  // O_NONBLOCK: opening a FIFO must not wait for a writer; fstat below then refuses it.
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw fail(std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { close(fd); }
  } closer{fd};
  struct stat st {};
  if (fstat(fd, &st) != 0) throw fail(std::strerror(errno));
  if (S_ISDIR(st.st_mode)) throw fail("it is a directory");
  if (!S_ISREG(st.st_mode)) throw fail("it is not a regular file (a device, FIFO or socket)");
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size > max_bytes)
    throw fail(fmt::format("it holds {}, over the limit of {}", human_size(size),
                           human_size(max_bytes)));
  std::string text(size, '\0');
  size_t got = 0;
  while (got < size) {
    const ssize_t r = read(fd, text.data() + got, size - got);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw fail(std::strerror(errno));
    if (r == 0) break;  // shrank while being read: use what is there
    got += static_cast<size_t>(r);
  }
  text.resize(got);
  return text;
}

}  // namespace flexc::detail
