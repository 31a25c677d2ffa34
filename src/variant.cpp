// flexc::Variant: declarations checked, expressions parsed into the IR, composition on the IR.
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cfloat>
#include <charconv>
#include <climits>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <unordered_map>

#include "dsl/analysis.h"
#include "dsl/diagnostics.h"
#include "dsl/frontend.h"
#include "embedded.h"
#include "file_read.h"
#include "templates/flexc_hooks.cuh"
#include "variant_impl.h"

namespace flexc {
namespace detail {

std::string in_quotes(std::string_view text) {
  constexpr size_t kMaxShown = 80;  // a message quotes what is wrong, not a whole file
  std::string out = "\"";
  for (unsigned char c : text.substr(0, kMaxShown)) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20 || c == 0x7f) {
      out += fmt::format("\\u{:04x}", c);
    } else {
      out += static_cast<char>(c);
    }
  }
  if (text.size() > kMaxShown) out += "...";
  return out + "\"";
}

std::string did_you_mean(std::string_view got, const std::vector<std::string>& candidates) {
  std::string c = dsl::closest_name(got, candidates);
  if (c.empty() && !got.empty()) {  // a unique completion: "float" -> "float32"
    const auto n = std::count_if(candidates.begin(), candidates.end(),
                                 [&](const std::string& s) { return s.starts_with(got); });
    for (const std::string& s : candidates)
      if (n == 1 && s.starts_with(got)) c = s;
  }
  return c.empty() ? std::string() : fmt::format(" (did you mean {}?)", in_quotes(c));
}

void config_error(std::string_view origin, std::string_view path, std::string_view message) {
  throw Error(fmt::format("{}: {}: {}", origin, path, message));
}

namespace {

// ---- declarations

constexpr dsl::DType kDTypes[] = {dsl::DType::I32, dsl::DType::F32, dsl::DType::BF16,
                                  dsl::DType::F16, dsl::DType::Bool};
constexpr std::pair<std::string_view, dsl::Dim::Kind> kDimSymbols[] = {
    {"B", dsl::Dim::B}, {"H", dsl::Dim::H}, {"Q_LEN", dsl::Dim::QLen}, {"KV_LEN", dsl::Dim::KvLen}};

std::optional<dsl::DType> find_dtype(std::string_view s) {
  for (dsl::DType d : kDTypes)
    if (dsl::dtype_name(d) == s) return d;
  return std::nullopt;
}

std::optional<dsl::Dim> parse_dim(std::string_view s) {
  for (const auto& [symbol, kind] : kDimSymbols)
    if (s == symbol) return dsl::Dim{kind, 0};
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  // Extents reach the kernels as int (FlexcCapture::shape).
  if (ec != std::errc{} || end != s.data() + s.size() || v < 1 || v > INT32_MAX)
    return std::nullopt;
  return dsl::Dim{dsl::Dim::Fixed, v};
}

// Specs are normalized and valid here (see declare()).
dsl::Decls to_decls(const std::vector<CaptureSpec>& captures,
                    const std::vector<ParamSpec>& params) {
  dsl::Decls d;
  for (const CaptureSpec& c : captures) {
    dsl::CaptureDecl cd{c.name, *find_dtype(c.dtype), {}};
    for (const std::string& dim : c.dims) cd.dims.push_back(*parse_dim(dim));
    d.captures.push_back(std::move(cd));
  }
  for (const ParamSpec& p : params)
    d.params.push_back(
        {p.name, p.type == "int" ? dsl::Type::Int : dsl::Type::Float, p.default_value, p.is_const});
  return d;
}

// Runtime params first, each group in declaration order (see VariantImpl).
std::vector<size_t> runtime_first_order(const std::vector<ParamSpec>& params) {
  std::vector<size_t> order(params.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_partition(order.begin(), order.end(), [&](size_t i) { return !params[i].is_const; });
  return order;
}

// Limits of the kernels' argument block (templates/flexc_hooks.cuh). `where` prefixes the
// message: "alibi.json: captures", "and_masks(a, b)".
void check_capture_count(size_t captures, std::string_view where) {
  if (captures > FLEXC_MAX_CAPTURES)
    throw Error(fmt::format("{}: {} captured tensors; at most {} are supported", where, captures,
                            FLEXC_MAX_CAPTURES));
}
void check_param_count(const std::vector<ParamSpec>& params, std::string_view where) {
  // Const params take no kernel argument, but slots are 16-bit in the IR; nobody needs more.
  constexpr size_t kMaxDeclared = 256;
  if (params.size() > kMaxDeclared)
    throw Error(fmt::format("{}: {} params; at most {} may be declared", where, params.size(),
                            kMaxDeclared));
  const auto runtime =
      std::count_if(params.begin(), params.end(), [](const ParamSpec& p) { return !p.is_const; });
  if (runtime > FLEXC_MAX_PARAMS)
    throw Error(
        fmt::format("{}: {} runtime params; at most {} are supported (const params do "
                    "not count)",
                    where, runtime, FLEXC_MAX_PARAMS));
}


void check_decl_name(const std::string& name, std::string_view origin, const std::string& path) {
  if (!dsl::is_identifier(name))
    config_error(origin, path,
                 fmt::format("expected an identifier (letters, digits and '_', not starting with a "
                             "digit), got {}",
                             in_quotes(name)));
  if (dsl::is_reserved_name(name))
    config_error(origin, path,
                 fmt::format("{} is reserved by the language (an input, a built-in function or a "
                             "literal); choose another name",
                             in_quotes(name)));
}

std::vector<std::string> dtype_names() {
  std::vector<std::string> out;
  for (dsl::DType d : kDTypes) out.emplace_back(dsl::dtype_name(d));
  return out;
}

// Checks and normalizes the declarations into `impl` (specs and decls).
void declare(VariantImpl& impl, const std::vector<CaptureSpec>& captures,
             const std::vector<ParamSpec>& params, std::string_view origin) {
  check_capture_count(captures.size(), fmt::format("{}: captures", origin));
  check_param_count(params, fmt::format("{}: params", origin));
  std::unordered_map<std::string, std::string> seen;  // name -> path of its declaration
  auto check_unique = [&](const std::string& name, const std::string& path) {
    const auto [it, added] = seen.emplace(name, path);
    if (!added)
      config_error(origin, path,
                   fmt::format("{} is already declared at {}", in_quotes(name), it->second));
  };

  for (size_t i = 0; i < captures.size(); ++i) {
    const CaptureSpec& c = captures[i];
    const std::string path = fmt::format("captures[{}]", i);
    check_decl_name(c.name, origin, path + ".name");
    check_unique(c.name, path + ".name");
    CaptureSpec out{c.name, c.dtype, {}};
    if (!find_dtype(c.dtype))
      config_error(origin, path + ".dtype",
                   fmt::format("expected one of {}, got {}{}", fmt::join(dtype_names(), ", "),
                               in_quotes(c.dtype), did_you_mean(c.dtype, dtype_names())));
    if (c.dims.empty() || c.dims.size() > static_cast<size_t>(dsl::kMaxArgs))
      config_error(origin, path + ".shape",
                   fmt::format("expected 1 to {} dims, got {}", dsl::kMaxArgs, c.dims.size()));
    for (size_t j = 0; j < c.dims.size(); ++j) {
      const auto dim = parse_dim(c.dims[j]);
      if (!dim)
        config_error(
            origin, fmt::format("{}.shape[{}]", path, j),
            fmt::format("expected a positive integer (int32) or one of B, H, Q_LEN, KV_LEN, "
                        "got {}{}",
                        in_quotes(c.dims[j]),
                        did_you_mean(c.dims[j], {"B", "H", "Q_LEN", "KV_LEN"})));
      out.dims.push_back(dsl::dim_name(*dim));
    }
    impl.capture_specs.push_back(std::move(out));
  }

  std::vector<ParamSpec> checked;
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamSpec& p = params[i];
    const std::string path = fmt::format("params[{}]", i);
    check_decl_name(p.name, origin, path + ".name");
    check_unique(p.name, path + ".name");
    if (p.type != "int" && p.type != "float")
      config_error(origin, path + ".type",
                   fmt::format("expected one of int, float, got {}{}", in_quotes(p.type),
                               did_you_mean(p.type, {"int", "float"})));
    const double v = p.default_value;
    if (p.type == "int" && !(std::trunc(v) == v && v >= INT32_MIN && v <= INT32_MAX))
      config_error(origin, path + ".default",
                   fmt::format("expected an integer in the int32 range for int param {}, got {}",
                               in_quotes(p.name), v));
    if (p.type == "float" && !std::isfinite(static_cast<float>(v)))
      config_error(origin, path + ".default",
                   fmt::format("expected a finite float32 value for float param {}, got {}",
                               in_quotes(p.name), v));
    checked.push_back(p);
  }
  for (size_t i : runtime_first_order(checked)) impl.param_specs.push_back(checked[i]);
  impl.decls = to_decls(impl.capture_specs, impl.param_specs);
}

// ---- merging the declarations of two variants by name

std::string describe(const CaptureSpec& c) {
  return fmt::format("a {} capture [{}]", c.dtype, fmt::join(c.dims, ", "));
}
std::string describe(const ParamSpec& p) {
  return fmt::format("a {} {} param (default {})", p.is_const ? "const" : "runtime", p.type,
                     p.default_value);
}

struct Merged {
  std::vector<CaptureSpec> captures;
  std::vector<ParamSpec> params;
  std::vector<dsl::ImportMap> maps;  // slot renumbering of each side's graphs, side by side
};

// The declarations of all `sides` merged by name; `where(i)` names side i in a conflict.
Merged merge_decls(std::span<const VariantImpl* const> sides,
                   const std::function<std::string(size_t)>& where) {
  Merged m;
  size_t side_index = 0;
  // name -> (is a capture, index in m.captures or m.params)
  std::unordered_map<std::string, std::pair<bool, uint16_t>> index;
  auto conflict = [&](const std::string& name, const std::string& one, const std::string& two) {
    throw Error(fmt::format("{}: conflicting declarations of {}: {} and {}", where(side_index),
                            in_quotes(name), one, two));
  };
  auto describe_existing = [&](std::pair<bool, uint16_t> at) {
    return at.first ? describe(m.captures[at.second]) : describe(m.params[at.second]);
  };
  auto add_capture = [&](const CaptureSpec& c) {
    const auto [it, added] =
        index.emplace(c.name, std::pair{true, static_cast<uint16_t>(m.captures.size())});
    if (added) {
      m.captures.push_back(c);
    } else if (!it->second.first || m.captures[it->second.second].dtype != c.dtype ||
               m.captures[it->second.second].dims != c.dims) {
      conflict(c.name, describe_existing(it->second), describe(c));
    }
    return it->second.second;
  };
  auto add_param = [&](const ParamSpec& p) {
    const auto [it, added] =
        index.emplace(p.name, std::pair{false, static_cast<uint16_t>(m.params.size())});
    if (added) {
      m.params.push_back(p);
    } else if (it->second.first || m.params[it->second.second].type != p.type ||
               m.params[it->second.second].default_value != p.default_value ||
               m.params[it->second.second].is_const != p.is_const) {
      conflict(p.name, describe_existing(it->second), describe(p));
    }
    return it->second.second;
  };
  for (; side_index < sides.size(); ++side_index) {
    const VariantImpl* side = sides[side_index];
    dsl::ImportMap& map = m.maps.emplace_back();
    for (const CaptureSpec& c : side->capture_specs) map.capture_slot.push_back(add_capture(c));
    for (const ParamSpec& p : side->param_specs) map.param_slot.push_back(add_param(p));
    check_capture_count(m.captures.size(), where(side_index));
    check_param_count(m.params, where(side_index));
  }

  const std::vector<size_t> order = runtime_first_order(m.params);
  std::vector<uint16_t> new_slot(order.size());
  std::vector<ParamSpec> params;
  for (size_t i = 0; i < order.size(); ++i) {
    new_slot[order[i]] = static_cast<uint16_t>(i);
    params.push_back(m.params[order[i]]);
  }
  m.params = std::move(params);
  for (dsl::ImportMap& map : m.maps)
    for (uint16_t& slot : map.param_slot) slot = new_slot[slot];
  return m;
}

Merged merge_decls(const VariantImpl& a, const VariantImpl& b, std::string_view context) {
  const VariantImpl* sides[] = {&a, &b};
  return merge_decls(sides, [&](size_t) { return std::string(context); });
}

// ---- mods

dsl::Mod parse(dsl::ModKind kind, std::string_view text, const dsl::Decls& decls,
               std::string origin) {
  try {
    return dsl::parse_mod(kind, text, decls, std::move(origin));
  } catch (const dsl::DslError& e) {
    throw Error(e.what());
  }
}

dsl::Mod identity_score_mod() {
  dsl::Mod m;
  m.kind = dsl::ModKind::Score;
  m.graph.root = m.graph.input(dsl::Input::Score);
  return m;
}

dsl::Mod import_mod(const dsl::Mod& m, const dsl::ImportMap& map) {
  dsl::Mod out;
  out.kind = m.kind;
  out.source = m.source;
  out.origin = m.origin;
  out.graph.root = out.graph.import(m.graph, m.graph.root, map);
  return out;
}

// A mod assembled from several sources refers to none of them: its nodes lose their ranges.
dsl::Mod assembled(dsl::ModKind kind, const dsl::Graph& g, std::string origin) {
  dsl::Mod out;
  out.kind = kind;
  out.origin = std::move(origin);
  for (dsl::Node n : g.nodes()) {
    n.src = {};
    out.graph.add(n);  // g holds no two identical nodes, so ids stay the same
  }
  out.graph.root = g.root;
  return out;
}

void apply_decls(VariantImpl& impl, Merged&& m) {
  impl.capture_specs = std::move(m.captures);
  impl.param_specs = std::move(m.params);
  impl.decls = to_decls(impl.capture_specs, impl.param_specs);
}

bool is_true(const dsl::Mod& mask) { return dsl::is_all_true_mask(mask.graph, mask.graph.root); }
bool is_identity(const dsl::Mod& score) {
  return dsl::is_identity_score(score.graph, score.graph.root);
}

// The masks of two variants combined with `op` (And / Or), declarations merged into `m`.
dsl::Mod combined_mask(dsl::Op op, const VariantImpl& a, const VariantImpl& b, const Merged& m,
                       std::string_view context) {
  if (op == dsl::Op::And && is_true(a.mask)) return import_mod(b.mask, m.maps[1]);
  if (op == dsl::Op::And && is_true(b.mask)) return import_mod(a.mask, m.maps[0]);
  dsl::Graph g;
  const dsl::NodeId ra = g.import(a.mask.graph, a.mask.graph.root, m.maps[0]);
  const dsl::NodeId rb = g.import(b.mask.graph, b.mask.graph.root, m.maps[1]);
  g.root = g.binary(op, ra, rb);
  return assembled(dsl::ModKind::Mask, g, std::string(context));
}

// and_masks / or_masks: at most one side may modify the score, unless both do identically.
VariantImpl combine_masks(dsl::Op op, const VariantImpl& a, const VariantImpl& b,
                          std::string_view context) {
  Merged m = merge_decls(a, b, context);
  VariantImpl out;
  if (is_identity(b.score)) {
    out.score = import_mod(a.score, m.maps[0]);
  } else if (is_identity(a.score)) {
    out.score = import_mod(b.score, m.maps[1]);
  } else {
    out.score = import_mod(a.score, m.maps[0]);
    if (out.score.graph.import(b.score.graph, b.score.graph.root, m.maps[1]) !=
        out.score.graph.root)
      throw Error(
          fmt::format("{}: both variants modify the score ({} and {}); combine the "
                      "masks of variants of which at most one has a score_mod, or "
                      "use compose()",
                      context, in_quotes(a.name), in_quotes(b.name)));
  }
  out.mask = combined_mask(op, a, b, m, context);
  out.precision = combined_precision(a, b);
  apply_decls(out, std::move(m));
  return out;
}

VariantImpl negated(const VariantImpl& a) {
  VariantImpl out = a;
  out.mask.graph.root = out.mask.graph.unary(dsl::Op::Not, a.mask.graph.root);
  return out;
}

// Only the mask of `v`, with only the declarations it reads (a catalogue reference in a config).
VariantImpl mask_only(const VariantImpl& v) {
  const dsl::Deps deps = dsl::dependencies(v.mask.graph, v.mask.graph.root);
  VariantImpl out;
  out.name = v.name;
  dsl::ImportMap map;
  map.capture_slot.assign(v.capture_specs.size(), 0);
  map.param_slot.assign(v.param_specs.size(), 0);
  for (uint16_t slot : deps.captures) {
    map.capture_slot[slot] = static_cast<uint16_t>(out.capture_specs.size());
    out.capture_specs.push_back(v.capture_specs[slot]);
  }
  for (uint16_t slot : deps.params) {  // runtime params only: const ones are folded
    map.param_slot[slot] = static_cast<uint16_t>(out.param_specs.size());
    out.param_specs.push_back(v.param_specs[slot]);
  }
  out.decls = to_decls(out.capture_specs, out.param_specs);
  out.score = identity_score_mod();
  out.mask = import_mod(v.mask, map);
  return out;
}

// The size of the expression at g.root with shared nodes printed inline (as to_text prints it),
// saturated just above `limit`.
size_t expanded_size(const dsl::Graph& g, size_t limit) {
  std::vector<size_t> size(g.size());
  for (dsl::NodeId id = 0; id < g.size(); ++id) {
    size[id] = 1;
    for (dsl::NodeId a : g[id].operands()) size[id] = std::min(size[id] + size[a], limit + 1);
  }
  return size[g.root];
}

// Simplifies both mods and checks the size of what composition may have built: composing
// variants repeatedly can grow a mod's text exponentially while its graph stays small.
Variant finish(VariantImpl impl, std::string_view where) {
  const dsl::Limits limits;
  for (dsl::Mod* m : {&impl.score, &impl.mask}) {
    m->graph = dsl::simplify(m->graph);
    const size_t nodes = m->graph.size();
    const size_t expanded = expanded_size(m->graph, limits.max_expanded_nodes);
    if (nodes > limits.max_nodes || expanded > limits.max_expanded_nodes)
      throw Error(fmt::format(
          "{}: the {} is too large ({} nodes, {}{} when printed; the limits are {} and {})", where,
          m->kind == dsl::ModKind::Score ? "score_mod" : "mask_mod", nodes,
          expanded > limits.max_expanded_nodes ? "over " : "",
          std::min(expanded, limits.max_expanded_nodes), limits.max_nodes,
          limits.max_expanded_nodes));
  }
  impl.facts = dsl::launch_facts(emit_input(impl));
  return VariantAccess::make(std::make_shared<const VariantImpl>(std::move(impl)));
}

// ---- the catalogue

const EmbeddedFile* catalogue_file(std::string_view name) {
  return catalogue_entry("catalogue", name);
}

std::string unknown_entry(std::string_view name) {
  std::vector<std::string> refs;
  for (const std::string& n : Variant::catalogue_names()) refs.push_back("@" + n);
  const std::string ref = fmt::format("@{}", name);
  // "@causal && q_idx > 0" is an easy mistake: a reference is a whole mask of its own.
  const char* whole = dsl::is_identifier(name)
                          ? ""
                          : "; a reference is a mask of its own: combine it with {\"and\": "
                            "[\"@name\", \"expression\"]}";
  return fmt::format("unknown catalogue entry {}{}; the catalogue has {}{}", in_quotes(ref),
                     did_you_mean(ref, refs), fmt::join(refs, ", "), whole);
}

// Catalogue entries may refer to each other; this catches a cycle instead of recursing forever.
thread_local std::vector<std::string> g_loading;

// Catalogue references already built for one config, by name: a config may repeat "@causal".
using BuiltRefs = std::map<std::string, VariantImpl, std::less<>>;

VariantImpl build_mask(const MaskConfig& mc, const VariantImpl& file, std::string_view origin,
                       BuiltRefs& refs) {
  using K = MaskConfig::Kind;
  switch (mc.kind) {
    case K::Expr: {
      VariantImpl p;
      p.capture_specs = file.capture_specs;
      p.param_specs = file.param_specs;
      p.decls = file.decls;
      p.score = identity_score_mod();
      p.mask =
          parse(dsl::ModKind::Mask, mc.text, file.decls, fmt::format("{}: {}", origin, mc.path));
      return p;
    }
    case K::Ref: {
      if (const auto it = refs.find(mc.text); it != refs.end()) return it->second;
      if (!catalogue_file(mc.text)) config_error(origin, mc.path, unknown_entry(mc.text));
      return refs.emplace(mc.text, mask_only(detail::impl_of(Variant::from_catalogue(mc.text))))
          .first->second;
    }
    case K::Not:
      return negated(build_mask(mc.items.at(0), file, origin, refs));
    case K::And:
    case K::Or: {
      if (mc.items.size() == 1) return build_mask(mc.items[0], file, origin, refs);
      // All terms merged and imported into one graph once: folding pairwise would copy the
      // growing left side again for every term (quadratic in the number of terms).
      std::vector<VariantImpl> terms;
      terms.reserve(mc.items.size());
      for (const MaskConfig& item : mc.items) terms.push_back(build_mask(item, file, origin, refs));
      std::vector<const VariantImpl*> sides;
      for (const VariantImpl& t : terms) sides.push_back(&t);
      Merged m = merge_decls(
          sides, [&](size_t i) { return fmt::format("{}: {}", origin, mc.items[i].path); });
      const dsl::Op op = mc.kind == K::And ? dsl::Op::And : dsl::Op::Or;
      dsl::Graph g;
      for (size_t i = 0; i < terms.size(); ++i) {
        const dsl::NodeId r = g.import(terms[i].mask.graph, terms[i].mask.graph.root, m.maps[i]);
        g.root = i == 0 ? r : g.binary(op, g.root, r);
      }
      VariantImpl out;
      out.score = identity_score_mod();
      out.mask = assembled(dsl::ModKind::Mask, g, fmt::format("{}: {}", origin, mc.path));
      apply_decls(out, std::move(m));
      return out;
    }
  }
  throw Error("unreachable mask kind");
}

ModDeps mod_deps(const dsl::Mod& m, const dsl::Decls& decls) {
  const dsl::Deps d = dsl::dependencies(m.graph, m.graph.root);
  ModDeps out;
  out.score = d.reads(dsl::Input::Score);
  out.b = d.reads(dsl::Input::B);
  out.h = d.reads(dsl::Input::H);
  out.q_idx = d.reads(dsl::Input::QIdx);
  out.kv_idx = d.reads(dsl::Input::KvIdx);
  out.q_len = d.reads(dsl::Input::QLen);
  out.kv_len = d.reads(dsl::Input::KvLen);
  for (uint16_t slot : d.params) out.params.push_back(decls.params.at(slot).name);
  for (uint16_t slot : d.captures) out.captures.push_back(decls.captures.at(slot).name);
  return out;
}

Variant named(VariantImpl impl, std::string name, std::string description,
              std::string_view context) {
  impl.name = std::move(name);
  impl.description = std::move(description);
  return finish(std::move(impl), context);
}

}  // namespace

void check_variant_name(const std::string& name, std::string_view origin) {
  const bool ok =
      !name.empty() && name.size() <= 128 &&
      (std::isalpha(static_cast<unsigned char>(name[0])) || name[0] == '_') &&
      std::all_of(name.begin(), name.end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.';
      });
  if (!ok)
    config_error(origin, "name",
                 fmt::format("expected up to 128 letters, digits, '_', '-' or '.', starting with a "
                             "letter or '_', got {}",
                             in_quotes(name)));
}

Variant build_variant(const VariantConfig& config, std::string_view origin) {
  check_variant_name(config.name, origin);
  VariantImpl impl;
  impl.name = config.name;
  impl.description = config.description;
  impl.precision = config.precision;
  declare(impl, config.captures, config.params, origin);
  impl.score = parse(dsl::ModKind::Score, config.score_mod, impl.decls,
                     fmt::format("{}: score_mod", origin));
  BuiltRefs refs;
  const VariantImpl mask = build_mask(config.mask, impl, origin, refs);
  Merged m = merge_decls(impl, mask, fmt::format("{}: {}", origin, config.mask.path));
  impl.score = import_mod(impl.score, m.maps[0]);
  impl.mask = import_mod(mask.mask, m.maps[1]);
  apply_decls(impl, std::move(m));
  return finish(std::move(impl), origin);
}

dsl::Mod parse_float_expression(std::string_view text, std::string_view where) {
  dsl::Mod m = parse(dsl::ModKind::Score, text, dsl::Decls{}, std::string(where));
  m.graph = dsl::simplify(m.graph);
  return m;
}

}  // namespace detail

using detail::VariantImpl;

Variant Variant::from_strings(std::string_view score_mod, std::string_view mask_mod,
                              std::vector<CaptureSpec> captures, std::vector<ParamSpec> params,
                              std::string name) {
  detail::VariantConfig config;
  config.name = std::move(name);
  config.captures = std::move(captures);
  config.params = std::move(params);
  config.score_mod = score_mod;
  config.mask.text = mask_mod;
  return detail::build_variant(config, config.name);
}

Variant Variant::from_json(std::string_view json_text, std::string_view origin) {
  return detail::build_variant(detail::parse_variant_json(json_text, origin), origin);
}

Variant Variant::from_json_file(const std::filesystem::path& path) {
  return from_json(detail::read_regular_file(path, detail::kMaxConfigBytes, "variant config"),
                   path.string());
}

Variant Variant::from_catalogue(std::string_view name) {
  if (name.starts_with('@')) name.remove_prefix(1);
  const detail::EmbeddedFile* f = detail::catalogue_file(name);
  if (!f) throw Error(detail::unknown_entry(name));
  auto& loading = detail::g_loading;
  if (std::find(loading.begin(), loading.end(), name) != loading.end())
    throw Error(
        fmt::format("catalogue reference cycle: {} -> {}", fmt::join(loading, " -> "), name));
  loading.emplace_back(name);
  struct Pop {
    ~Pop() { detail::g_loading.pop_back(); }
  } pop;
  return from_json(f->text, f->name);
}

Variant Variant::load(std::string_view config) {
  return config.starts_with('@') ? from_catalogue(config) : from_json_file(config);
}

std::vector<std::string> Variant::catalogue_names() {
  return detail::catalogue_entries("catalogue");
}

const std::string& Variant::name() const { return impl_->name; }
const std::string& Variant::description() const { return impl_->description; }
const std::vector<CaptureSpec>& Variant::captures() const { return impl_->capture_specs; }
const std::vector<ParamSpec>& Variant::params() const { return impl_->param_specs; }

std::string Variant::score_mod_text() const {
  return dsl::to_text(impl_->score.graph, impl_->score.graph.root, impl_->decls);
}
std::string Variant::mask_mod_text() const {
  return dsl::to_text(impl_->mask.graph, impl_->mask.graph.root, impl_->decls);
}
std::string Variant::score_grad_text() const {
  dsl::Graph g = impl_->score.graph;
  g.root = dsl::derivative_wrt_score(g, g.root);
  const dsl::Graph s = dsl::simplify(g);
  return dsl::to_text(s, s.root, impl_->decls);
}
ModDeps Variant::score_deps() const { return detail::mod_deps(impl_->score, impl_->decls); }
ModDeps Variant::mask_deps() const { return detail::mod_deps(impl_->mask, impl_->decls); }
bool Variant::identity_score() const { return detail::is_identity(impl_->score); }
bool Variant::mask_always_true() const { return detail::is_true(impl_->mask); }
Precision Variant::precision() const { return impl_->precision; }

Variant Variant::renamed(std::string name) const {
  detail::check_variant_name(name, fmt::format("renaming {}", detail::in_quotes(impl_->name)));
  auto copy = std::make_shared<VariantImpl>(*impl_);
  copy->name = std::move(name);
  return Variant(std::move(copy));
}

Variant Variant::with_precision(Precision p) const {
  auto copy = std::make_shared<VariantImpl>(*impl_);
  copy->precision = p;
  // The launch facts depend on it: fast math groups a sum's relative terms into one table,
  // exact keeps each (a kernel launched with fewer tables' bytes than it uses would overrun).
  copy->facts = dsl::launch_facts(detail::emit_input(*copy));
  return Variant(std::move(copy));
}

std::string_view to_string(Precision p) {
  for (const auto& [name, q] : detail::kPrecisionNames)
    if (q == p) return name;
  return "?";
}

Precision parse_precision(std::string_view text, std::string_view what) {
  for (const auto& [name, p] : detail::kPrecisionNames)
    if (text == name) return p;
  throw Error(fmt::format("{}: {} is not a precision; use \"fast\", \"exact\" or \"approx\"", what,
                          detail::in_quotes(text)));
}

Variant and_masks(const Variant& a, const Variant& b) {
  const std::string context = fmt::format("and_masks({}, {})", a.name(), b.name());
  return detail::named(
      detail::combine_masks(dsl::Op::And, detail::impl_of(a), detail::impl_of(b), context),
      a.name() + "_and_" + b.name(),
      fmt::format("mask of '{}' and mask of '{}'", a.name(), b.name()), context);
}

Variant or_masks(const Variant& a, const Variant& b) {
  const std::string context = fmt::format("or_masks({}, {})", a.name(), b.name());
  return detail::named(
      detail::combine_masks(dsl::Op::Or, detail::impl_of(a), detail::impl_of(b), context),
      a.name() + "_or_" + b.name(), fmt::format("mask of '{}' or mask of '{}'", a.name(), b.name()),
      context);
}

Variant not_mask(const Variant& a) {
  return detail::named(detail::negated(detail::impl_of(a)), "not_" + a.name(),
                       fmt::format("negated mask of '{}'", a.name()),
                       fmt::format("not_mask({})", a.name()));
}

Variant compose(const Variant& outer, const Variant& inner) {
  const std::string context = fmt::format("compose({}, {})", outer.name(), inner.name());
  const VariantImpl& o = detail::impl_of(outer);
  const VariantImpl& i = detail::impl_of(inner);
  detail::Merged m = detail::merge_decls(o, i, context);
  VariantImpl out;
  if (detail::is_identity(o.score)) {
    out.score = detail::import_mod(i.score, m.maps[1]);
  } else if (detail::is_identity(i.score)) {
    out.score = detail::import_mod(o.score, m.maps[0]);
  } else {
    dsl::Graph g;
    dsl::ImportMap outer_map = m.maps[0];
    outer_map.input[static_cast<int>(dsl::Input::Score)] =
        g.import(i.score.graph, i.score.graph.root, m.maps[1]);
    g.root = g.import(o.score.graph, o.score.graph.root, outer_map);
    out.score = detail::assembled(dsl::ModKind::Score, g, context);
  }
  out.mask = detail::combined_mask(dsl::Op::And, o, i, m, context);
  out.precision = detail::combined_precision(o, i);
  detail::apply_decls(out, std::move(m));
  return detail::named(std::move(out), outer.name() + "_of_" + inner.name(),
                       fmt::format("score_mod of '{}' applied to that of '{}', masks of both",
                                   outer.name(), inner.name()),
                       context);
}

}  // namespace flexc
