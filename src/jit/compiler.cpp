#include "compiler.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <chrono>
#include <cstdlib>
#include <filesystem>

#include "dsl/diagnostics.h"
#include "flexc/error.h"
#include "nvrtc_api.h"

namespace flexc::jit {

namespace fs = std::filesystem;

const std::string& nvrtc_identity() {
  static const std::string id = [] {
    const NvrtcApi& api = nvrtc("finding NVRTC");
    int major = 0, minor = 0;
    api.nvrtcVersion(&major, &minor);
    std::error_code ec;
    const uintmax_t bytes = fs::file_size(api.path, ec);
    return fmt::format("nvrtc {}.{} {} ({} bytes)", major, minor, api.path, ec ? 0 : bytes);
  }();
  return id;
}

static bool nvrtc_has_cache() {
  static const bool has = [] {
    int major = 0, minor = 0;
    nvrtc("finding NVRTC").nvrtcVersion(&major, &minor);
    return major > 12 || (major == 12 && minor >= 9);
  }();
  return has;
}

static std::vector<int> supported_archs() {
  const NvrtcApi& api = nvrtc("listing NVRTC's architectures");
  int n = 0;
  api.nvrtcGetNumSupportedArchs(&n);
  std::vector<int> archs(static_cast<size_t>(n));
  if (n > 0) api.nvrtcGetSupportedArchs(archs.data());
  return archs;
}

void check_arch(std::string_view arch) {
  const std::vector<int> archs = supported_archs();
  std::string_view digits = arch;
  bool ok = false;
  for (std::string_view prefix : {"sm_", "compute_"})
    if (digits.starts_with(prefix)) {
      digits.remove_prefix(prefix.size());
      ok = true;
      break;
    }
  if (ok && (digits.ends_with('a') || digits.ends_with('f'))) digits.remove_suffix(1);
  int num = 0;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), num);
  ok = ok && ec == std::errc() && end == digits.data() + digits.size() &&
       std::find(archs.begin(), archs.end(), num) != archs.end();
  if (ok) return;
  std::string known;
  for (int a : archs) known += fmt::format("{}sm_{}", known.empty() ? "" : ", ", a);
  throw Error(fmt::format("cannot compile for '{}': NVRTC targets {} (and sm_90a, compute_XX)",
                          arch, known));
}

static bool is_identifier(std::string_view s) {
  if (s.empty() || std::isdigit(static_cast<unsigned char>(s[0]))) return false;
  return std::all_of(s.begin(), s.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_';
  });
}

std::vector<std::string> nvrtc_options(
    std::string_view arch, const std::vector<std::pair<std::string, std::string>>& defines) {
  check_arch(arch);
  std::vector<std::string> opts = {fmt::format("--gpu-architecture={}", arch), "-std=c++17",
                                   "-default-device", "--extra-device-vectorization"};
  // NVRTC's own cache (12.9 and newer) keeps what flexc's disk cache keeps already, and on some
  // hosts its miss costs a third more than the compile itself (docs/perf.md, JIT).
  if (nvrtc_has_cache()) opts.push_back("--no-cache");
  for (const auto& [name, value] : defines) {
    if (!is_identifier(name) || value.find_first_of("\r\n") != std::string::npos)
      throw Error(
          fmt::format("bad kernel define '{}={}': the name must be an identifier and the "
                      "value one line",
                      name, value));
    opts.push_back(fmt::format("-D{}={}", name, value));
  }
  if (const char* li = std::getenv("FLEXC_LINEINFO"); li && *li && std::string_view(li) != "0")
    opts.push_back("-lineinfo");
  return opts;
}

// ---- log mapping

namespace {

struct LogDiag {
  std::string file, severity, message;
  uint32_t line = 0;
  std::vector<std::string_view> context;  // the source excerpt and caret NVRTC prints
};

// Parses `file(line): severity[ #num]: message`.
bool parse_head(std::string_view s, LogDiag& d) {
  const size_t close = s.find("): ");
  if (close == std::string_view::npos) return false;
  const size_t open = s.rfind('(', close);
  if (open == std::string_view::npos || open == 0) return false;
  const std::string_view num = s.substr(open + 1, close - open - 1);
  const auto [end, ec] = std::from_chars(num.data(), num.data() + num.size(), d.line);
  if (ec != std::errc() || end != num.data() + num.size()) return false;
  std::string_view rest = s.substr(close + 3);
  const size_t colon = rest.find(": ");
  if (colon == std::string_view::npos) return false;
  std::string_view sev = rest.substr(0, colon);
  if (const size_t hash = sev.find(" #"); hash != std::string_view::npos) sev = sev.substr(0, hash);
  if (sev != "error" && sev != "catastrophic error" && sev != "warning") return false;
  d.file = s.substr(0, open);
  d.severity = sev;
  d.message = rest.substr(colon + 2);
  return true;
}

std::string_view nth_line(std::string_view text, uint32_t n) {
  for (uint32_t i = 1; i < n; ++i) {
    const size_t nl = text.find('\n');
    if (nl == std::string_view::npos) return {};
    text.remove_prefix(nl + 1);
  }
  return text.substr(0, text.find('\n'));
}

// A diagnostic at the user's expression when the generated line carries a marker.
std::string explain_generated(const LogDiag& d, const ErrorContext& ctx) {
  const std::string_view line = nth_line(ctx.variant_header, d.line);
  const size_t at = line.find("// @");
  if (at != std::string_view::npos) {
    std::string_view m = line.substr(at + 4);
    const bool score = m.starts_with("score_mod:");
    const dsl::Mod* mod = score ? ctx.score : m.starts_with("mask_mod:") ? ctx.mask : nullptr;
    m.remove_prefix(m.find(':') + 1);
    uint32_t b = 0, e = 0;
    const auto r1 = std::from_chars(m.data(), m.data() + m.size(), b);
    const auto r2 = r1.ptr < m.data() + m.size() && *r1.ptr == ':'
                        ? std::from_chars(r1.ptr + 1, m.data() + m.size(), e)
                        : std::from_chars_result{r1.ptr, std::errc::invalid_argument};
    if (mod && r1.ec == std::errc() && r2.ec == std::errc() && b <= e && e <= mod->source.size() &&
        !mod->source.empty()) {
      dsl::Diagnostic diag{dsl::Severity::Error,
                           {b, e},
                           "the CUDA compiler rejected the code generated for this: " + d.message,
                           ""};
      std::string text = dsl::render(diag, mod->source, mod->origin);
      if (!text.ends_with('\n')) text += '\n';
      return text;
    }
    if (mod)
      return fmt::format("{}: {}: the CUDA compiler rejected the code generated for it: {}\n",
                         mod->origin, d.severity, d.message);
  }
  return fmt::format("{}:{}: {}: {} (in flexc's generated code: a flexc bug)\n  {}\n",
                     kVariantHeader, d.line, d.severity, d.message, line);
}

}  // namespace

std::string explain_nvrtc_log(std::string_view log, const ErrorContext& ctx) {
  std::vector<LogDiag> diags;
  for (size_t pos = 0; pos < log.size();) {
    size_t nl = log.find('\n', pos);
    if (nl == std::string_view::npos) nl = log.size();
    const std::string_view line = log.substr(pos, nl - pos);
    pos = nl + 1;
    LogDiag d;
    if (parse_head(line, d))
      diags.push_back(std::move(d));
    else if (!diags.empty() && !line.empty() &&
             line.find("detected in the compilation") == std::string_view::npos &&
             line != "Compilation terminated.")
      diags.back().context.push_back(line);
  }
  const bool any_error = std::any_of(diags.begin(), diags.end(),
                                     [](const LogDiag& d) { return d.severity != "warning"; });
  std::string out = ctx.what + " failed:\n";
  if (!any_error) return out + std::string(log);  // nothing recognisable: show it whole
  for (const LogDiag& d : diags) {
    if (d.severity == "warning") continue;
    if (d.file == kVariantHeader) {
      out += explain_generated(d, ctx);
      continue;
    }
    const std::string file = d.file.find('/') == std::string::npos ? "templates/" + d.file : d.file;
    out += fmt::format("{}:{}: {}: {}\n", file, d.line, d.severity, d.message);
    for (std::string_view c : d.context) out += fmt::format("{}\n", c);
  }
  return out;
}

// ---- compiling

namespace {

struct Program {
  const NvrtcApi& api;
  nvrtcProgram p = nullptr;
  ~Program() {
    if (p) api.nvrtcDestroyProgram(&p);
  }
  void check(nvrtcResult r, std::string_view doing) const {
    if (r != NVRTC_SUCCESS) throw Error(fmt::format("{}: {}", doing, api.nvrtcGetErrorString(r)));
  }
};

}  // namespace

NvrtcOutput nvrtc_compile(const Unit& unit, const std::vector<std::string>& options,
                          const ErrorContext& ctx) {
  std::vector<const char*> names, texts, opts;
  for (const SourceFile& h : unit.headers) {
    names.push_back(h.name.c_str());
    texts.push_back(h.text.c_str());
  }
  for (const std::string& o : options) opts.push_back(o.c_str());

  const auto t0 = std::chrono::steady_clock::now();
  Program prog{nvrtc(ctx.what)};
  const NvrtcApi& api = prog.api;
  prog.check(api.nvrtcCreateProgram(&prog.p, unit.main.text.c_str(), unit.main.name.c_str(),
                                 static_cast<int>(names.size()), texts.data(), names.data()),
              ctx.what);
  const nvrtcResult r = api.nvrtcCompileProgram(prog.p, static_cast<int>(opts.size()), opts.data());
  NvrtcOutput out;
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  size_t n = 0;
  api.nvrtcGetProgramLogSize(prog.p, &n);
  out.log.assign(n, '\0');
  if (n) api.nvrtcGetProgramLog(prog.p, out.log.data());
  while (!out.log.empty() && out.log.back() == '\0') out.log.pop_back();
  if (r != NVRTC_SUCCESS) {
    if (r != NVRTC_ERROR_COMPILATION)
      throw Error(fmt::format("{}: {}\n{}", ctx.what, api.nvrtcGetErrorString(r), out.log));
    throw Error(explain_nvrtc_log(out.log, ctx));
  }
  prog.check(api.nvrtcGetPTXSize(prog.p, &n), ctx.what);
  out.ptx.resize(n);
  prog.check(api.nvrtcGetPTX(prog.p, out.ptx.data()), ctx.what);
  while (!out.ptx.empty() && out.ptx.back() == '\0') out.ptx.pop_back();
  if (options.front().starts_with("--gpu-architecture=sm_")) {
    prog.check(api.nvrtcGetCUBINSize(prog.p, &n), ctx.what);
    out.cubin.resize(n);
    prog.check(api.nvrtcGetCUBIN(prog.p, out.cubin.data()), ctx.what);
  }
  return out;
}

}  // namespace flexc::jit
