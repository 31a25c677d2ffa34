// Subcommands of the `flexc` CLI register themselves here, one file each under tools/cli/.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <vector>

namespace flexc::cli {

// `add` attaches a subcommand (with its callback) to the app.
struct Command {
  const char* name;
  std::function<void(CLI::App&)> add;
};
std::vector<Command>& commands();

struct Register {
  Register(const char* name, std::function<void(CLI::App&)> add) {
    commands().push_back({name, std::move(add)});
  }
};

}  // namespace flexc::cli
