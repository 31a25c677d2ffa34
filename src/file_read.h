// Reading a whole file that a user named, bounded: the size is checked before anything is read,
// and only regular files are read (a device such as /dev/zero, a FIFO or a socket would make a
// read unbounded or blocking).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

namespace flexc::detail {

// The file's bytes. Throws flexc::Error "cannot read <what> <path>: <why>" when it cannot be
// opened, is not a regular file, or holds more than `max_bytes` bytes (the message names the limit).
std::string read_regular_file(const std::filesystem::path& path, uint64_t max_bytes,
                              std::string_view what);

// "1 MiB", "512 KiB", "3 GiB", "17 bytes": limits in messages, sized for people.
std::string human_size(uint64_t bytes);

}  // namespace flexc::detail
