// flexc: the command-line kernel generator. Each subcommand lives in tools/cli/<name>.cpp.
#include <algorithm>
#include <cstdio>
#include <exception>

#include "cli/command.h"
#include "flexc/error.h"

namespace flexc::cli {
std::vector<Command>& commands() {
  static std::vector<Command> all;
  return all;
}
}  // namespace flexc::cli

int main(int argc, char** argv) {
  CLI::App app{"flexc: a JIT compiler for attention variants (score_mod / mask_mod)"};
  app.set_version_flag("--version", "flexc " FLEXC_VERSION);
  app.require_subcommand(1);
  auto& cmds = flexc::cli::commands();
  std::sort(cmds.begin(), cmds.end(),
            [](const auto& a, const auto& b) { return std::string_view(a.name) < b.name; });
  for (auto& c : cmds) c.add(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const flexc::Error& e) {
    std::fprintf(stderr, "flexc: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "flexc: internal error: %s\n", e.what());
    return 3;
  }
  return 0;
}
