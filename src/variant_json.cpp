// A JSON variant config (schema in docs/variants.md) -> VariantConfig. Only JSON syntax, types
// and keys are checked here; what the values mean is checked by build_variant.
#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <unordered_set>

#include "dsl/diagnostics.h"
#include "dsl/frontend.h"
#include "variant_impl.h"

namespace flexc::detail {
namespace {

using nlohmann::json;

constexpr size_t kMaxNesting = 32;  // levels of JSON objects and lists

// nlohmann's messages start "[json.exception.parse_error.101] parse error at line 1, column 2: ";
// the position is given separately, so keep only what went wrong.
std::string json_message(const char* what) {
  std::string_view s = what;
  if (const auto p = s.find("] "); p != std::string_view::npos) s.remove_prefix(p + 2);
  if (s.starts_with("parse error"))
    if (const auto p = s.find(": "); p != std::string_view::npos) s.remove_prefix(p + 2);
  return std::string(s);
}

// Where the parser is: the open objects and lists, for paths in messages ("captures[1].dtype").
class ParsePath {
 public:
  struct Frame {
    bool array;
    size_t index;
    std::string key;
    std::unordered_set<std::string> keys;
  };
  std::vector<Frame> frames;

  void next_element() {
    if (!frames.empty() && frames.back().array) ++frames.back().index;
  }
  // The path of the value the first `n` frames point at; "(top level)" for none.
  std::string path(size_t n) const {
    std::string p;
    for (size_t i = 0; i < n; ++i)
      p += frames[i].array ? fmt::format("[{}]", frames[i].index)
                           : (p.empty() ? "" : ".") + frames[i].key;
    return p.empty() ? "(top level)" : p;
  }
};

// nlohmann keeps the last of duplicate keys silently; a config with two "mask_mod"s is an error.
// The callback also tracks where the parser is (in `at`, which outlives the parse), to name the
// value in messages.
class DuplicateKeyCheck {
 public:
  DuplicateKeyCheck(std::string_view origin, ParsePath& at) : origin_(origin), at_(&at) {}

  bool operator()(int, json::parse_event_t event, json& parsed) {
    using E = json::parse_event_t;
    std::vector<ParsePath::Frame>& frames = at_->frames;
    switch (event) {
      case E::object_start:
      case E::array_start:
        if (frames.size() >= kMaxNesting)
          config_error(origin_, at_->path(frames.size()),
                       fmt::format("JSON nested more than {} levels deep", kMaxNesting));
        frames.push_back({event == E::array_start, 0, {}, {}});
        break;
      case E::key: {
        ParsePath::Frame& f = frames.back();
        f.key = parsed.get<std::string>();
        if (!f.keys.insert(f.key).second)
          config_error(origin_, at_->path(frames.size() - 1),
                       fmt::format("duplicate key {}", in_quotes(f.key)));
        break;
      }
      case E::object_end:
      case E::array_end:
        frames.pop_back();
        at_->next_element();
        break;
      case E::value:
        at_->next_element();
        break;
    }
    return true;
  }

 private:
  std::string_view origin_;
  ParsePath* at_;
};

// The offset of the JSON number token `number` outside strings, or npos.
size_t find_number(std::string_view text, std::string_view number) {
  const auto part_of_number = [](char c) {
    return (c >= '0' && c <= '9') || c == '.' || c == 'e' || c == 'E' || c == '+' || c == '-';
  };
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    if (in_string) {
      if (text[i] == '\\')
        ++i;
      else if (text[i] == '"')
        in_string = false;
    } else if (text[i] == '"') {
      in_string = true;
    } else if (text.substr(i, number.size()) == number &&
               (i == 0 || !part_of_number(text[i - 1])) &&
               (i + number.size() == text.size() || !part_of_number(text[i + number.size()]))) {
      return i;
    }
  }
  return std::string_view::npos;
}

json parse_json(std::string_view text, std::string_view origin) {
  if (text.size() > kMaxConfigBytes)
    throw Error(fmt::format("{}: the config is {} bytes; the limit is {}", origin, text.size(),
                            kMaxConfigBytes));
  const auto at = [&](size_t offset) {
    const dsl::LineCol lc = dsl::line_col(text, static_cast<uint32_t>(offset));
    return fmt::format("{}:{}:{}", origin, lc.line, lc.col);
  };
  // nlohmann's parser stops at a NUL byte as if the text ended there.
  if (const size_t nul = text.find('\0'); nul != std::string_view::npos)
    throw Error(fmt::format("{}: invalid JSON: a NUL byte (a config is text)", at(nul)));
  ParsePath where;
  try {
    return json::parse(text.begin(), text.end(), DuplicateKeyCheck(origin, where));
  } catch (const json::parse_error& e) {
    throw Error(fmt::format("{}: invalid JSON: {}", at(e.byte > 0 ? e.byte - 1 : 0),
                            json_message(e.what())));
  } catch (const json::out_of_range& e) {  // a number past a double's range ("1e400")
    // nlohmann gives no position for it: find the number it quotes.
    const std::string msg = json_message(e.what());
    const size_t q0 = msg.find('\''), q1 = msg.rfind('\'');
    const size_t offset = q0 < q1 && q1 != std::string::npos
                              ? find_number(text, std::string_view(msg).substr(q0 + 1, q1 - q0 - 1))
                              : std::string_view::npos;
    throw Error(fmt::format("{}: {}: invalid JSON: {}",
                            offset == std::string_view::npos ? std::string(origin) : at(offset),
                            where.path(where.frames.size()), msg));
  } catch (const json::exception& e) {
    throw Error(fmt::format("{}: invalid JSON: {}", origin, json_message(e.what())));
  }
}

std::string child(const std::string& path, std::string_view key) {
  return path.empty() ? std::string(key) : fmt::format("{}.{}", path, key);
}
std::string element(const std::string& path, size_t i) { return fmt::format("{}[{}]", path, i); }

class Reader {
 public:
  explicit Reader(std::string_view origin) : origin_(origin) {}

  // Rejects unknown keys (suggesting the closest allowed one) and missing required ones.
  void keys(const json& obj, const std::string& path, const std::vector<std::string>& allowed,
            const std::vector<std::string>& required) const {
    for (const auto& [key, value] : obj.items()) {
      if (std::find(allowed.begin(), allowed.end(), key) != allowed.end()) continue;
      // Keys that do not read as path components are shown quoted (and clipped).
      const std::string shown = dsl::is_identifier(key) && key.size() <= 64 ? key : in_quotes(key);
      fail(child(path, shown), fmt::format("unknown key{}; expected one of {}",
                                           did_you_mean(key, allowed), fmt::join(allowed, ", ")));
    }
    for (const std::string& key : required)
      if (!obj.contains(key))
        fail(path.empty() ? "(top level)" : path, fmt::format("missing key {}", in_quotes(key)));
  }

  const json& object(const json& j, const std::string& path) const {
    if (!j.is_object()) fail(path, "expected an object, got " + what(j));
    return j;
  }
  const json& array(const json& j, const std::string& path) const {
    if (!j.is_array()) fail(path, "expected a list, got " + what(j));
    return j;
  }
  std::string string(const json& j, const std::string& path) const {
    if (!j.is_string()) fail(path, "expected a string, got " + what(j));
    return j.get<std::string>();
  }
  double number(const json& j, const std::string& path) const {
    if (!j.is_number()) fail(path, "expected a number, got " + what(j));
    return j.get<double>();
  }

  // An expression: a string, or a list of strings taken as its lines.
  std::string expression(const json& j, const std::string& path) const {
    if (j.is_string()) return j.get<std::string>();
    if (!j.is_array() || j.empty())
      fail(path,
           "expected an expression (a string, or a list of strings: its lines), got " + what(j));
    std::string text;
    for (size_t i = 0; i < j.size(); ++i) text += (i ? "\n" : "") + string(j[i], element(path, i));
    return text;
  }

  // The JSON nesting limit bounds this recursion.
  MaskConfig mask(const json& j, const std::string& path) {
    using K = MaskConfig::Kind;
    if (++mask_terms_ > kMaxMaskTerms)
      fail(path, fmt::format("the mask_mod has more than {} terms (expressions, \"@name\" "
                             "references, and / or / not objects); combine fewer, or write "
                             "one expression",
                             kMaxMaskTerms));
    if (j.is_string()) {
      const std::string s = j.get<std::string>();
      if (s.starts_with('@')) return {K::Ref, s.substr(1), path, {}};
      return {K::Expr, s, path, {}};
    }
    if (j.is_array()) return {K::Expr, expression(j, path), path, {}};
    if (!j.is_object())
      fail(path,
           "expected a mask: an expression, \"@name\" of a catalogue entry, or an object "
           "{\"and\": [...]}, {\"or\": [...]} or {\"not\": ...}; got " +
               what(j));
    keys(j, path, {"and", "or", "not"}, {});
    if (j.size() != 1)
      fail(path,
           fmt::format("expected exactly one of \"and\", \"or\", \"not\", got {} keys", j.size()));
    const std::string key = j.begin().key();
    const json& value = j.begin().value();
    const std::string sub = child(path, key);
    if (key == "not") return {K::Not, {}, path, {mask(value, sub)}};
    if (!value.is_array() || value.empty())
      fail(sub, "expected a non-empty list of masks, got " + what(value));
    MaskConfig out{key == "and" ? K::And : K::Or, {}, path, {}};
    for (size_t i = 0; i < value.size(); ++i) out.items.push_back(mask(value[i], element(sub, i)));
    return out;
  }

  CaptureSpec capture(const json& j, const std::string& path) const {
    keys(object(j, path), path, {"name", "dtype", "shape"}, {"name", "dtype", "shape"});
    CaptureSpec c{
        string(j["name"], child(path, "name")), string(j["dtype"], child(path, "dtype")), {}};
    const std::string shape = child(path, "shape");
    const json& dims = array(j["shape"], shape);
    for (size_t i = 0; i < dims.size(); ++i) {
      // Numbers keep their JSON spelling; build_variant says what is wrong with "2.5" or "-1".
      if (dims[i].is_number())
        c.dims.push_back(dims[i].dump());
      else if (dims[i].is_string())
        c.dims.push_back(dims[i].get<std::string>());
      else
        fail(element(shape, i),
             "expected a positive integer or one of \"B\", \"H\", \"Q_LEN\", \"KV_LEN\", got " +
                 what(dims[i]));
    }
    return c;
  }

  Precision precision(const json& j, const std::string& path) const {
    const std::string p = string(j, path);
    std::vector<std::string> names;
    for (const auto& [name, q] : kPrecisionNames) {
      if (p == name) return q;
      names.emplace_back(name);
    }
    fail(path, fmt::format("expected one of {}, got {}{}", fmt::join(names, ", "), in_quotes(p),
                           did_you_mean(p, names)));
  }

  ParamSpec param(const json& j, const std::string& path) const {
    keys(object(j, path), path, {"name", "type", "default", "kind"}, {"name", "type", "default"});
    ParamSpec p;
    p.name = string(j["name"], child(path, "name"));
    p.type = string(j["type"], child(path, "type"));
    p.default_value = number(j["default"], child(path, "default"));
    if (j.contains("kind")) {
      const std::string kind = string(j["kind"], child(path, "kind"));
      if (kind != "runtime" && kind != "const")
        fail(child(path, "kind"),
             fmt::format("expected one of runtime, const, got {}{}", in_quotes(kind),
                         did_you_mean(kind, {"runtime", "const"})));
      p.is_const = kind == "const";
    }
    return p;
  }

 private:
  [[noreturn]] void fail(const std::string& path, std::string_view msg) const {
    config_error(origin_, path, msg);
  }
  // How a wrong value is named in a message.
  static std::string what(const json& j) {
    if (j.is_string()) return "the string " + in_quotes(j.get<std::string>());
    if (j.is_object()) return "an object";
    if (j.is_array()) return j.empty() ? "an empty list" : "a list";
    return j.dump();  // number, true / false, null
  }

  std::string_view origin_;
  size_t mask_terms_ = 0;
};

}  // namespace

VariantConfig parse_variant_json(std::string_view text, std::string_view origin) {
  const json j = parse_json(text, origin);
  Reader r(origin);
  if (j.is_object() && j.contains("kind") && j["kind"] == "linear")
    config_error(origin, "kind",
                 "a linear-attention config (\"kind\": \"linear\"): load it as a "
                 "flexc::LinearVariant (docs/linear.md)");
  r.keys(r.object(j, "(top level)"), "",
         {"name", "description", "score_mod", "mask_mod", "captures", "params", "precision"},
         {"name"});
  VariantConfig c;
  c.name = r.string(j["name"], "name");
  if (j.contains("description")) c.description = r.string(j["description"], "description");
  if (j.contains("score_mod")) c.score_mod = r.expression(j["score_mod"], "score_mod");
  if (j.contains("mask_mod")) c.mask = r.mask(j["mask_mod"], "mask_mod");
  if (j.contains("precision")) c.precision = r.precision(j["precision"], "precision");
  if (j.contains("captures")) {
    const json& list = r.array(j["captures"], "captures");
    for (size_t i = 0; i < list.size(); ++i)
      c.captures.push_back(r.capture(list[i], element("captures", i)));
  }
  if (j.contains("params")) {
    const json& list = r.array(j["params"], "params");
    for (size_t i = 0; i < list.size(); ++i)
      c.params.push_back(r.param(list[i], element("params", i)));
  }
  return c;
}

LinearConfig parse_linear_json(std::string_view text, std::string_view origin) {
  const json j = parse_json(text, origin);
  Reader r(origin);
  r.keys(r.object(j, "(top level)"), "",
         {"name", "kind", "description", "gate", "log_decay", "feature_map", "scale"},
         {"name", "kind", "gate"});
  if (r.string(j["kind"], "kind") != "linear")
    config_error(origin, "kind", fmt::format("expected \"linear\", got {}",
                                             in_quotes(j["kind"].get<std::string>())));
  LinearConfig c;
  c.name = r.string(j["name"], "name");
  if (j.contains("description")) c.description = r.string(j["description"], "description");
  c.gate = r.string(j["gate"], "gate");
  const std::vector<std::string> gates = {"per_dim", "per_step", "per_head", "none"};
  if (std::find(gates.begin(), gates.end(), c.gate) == gates.end())
    config_error(origin, "gate",
                 fmt::format("expected one of {}, got {}{}", fmt::join(gates, ", "),
                             in_quotes(c.gate), did_you_mean(c.gate, gates)));
  if (c.gate == "per_head" && !j.contains("log_decay"))
    config_error(origin, "(top level)",
                 "missing key \"log_decay\": a per_head gate is the log of a fixed decay, an "
                 "expression of h (e.g. \"log(1 - exp2(-5 - h))\")");
  if (j.contains("log_decay")) {
    if (c.gate != "per_head")
      config_error(origin, "log_decay",
                   fmt::format("only a per_head gate has a log_decay; this gate is {}",
                               in_quotes(c.gate)));
    c.log_decay = r.expression(j["log_decay"], "log_decay");
  }
  if (j.contains("feature_map")) c.feature_map = r.expression(j["feature_map"], "feature_map");
  if (j.contains("scale")) {
    const double v = r.number(j["scale"], "scale");
    if (!(v > 0)) config_error(origin, "scale", fmt::format("must be > 0, got {}", v));
    c.scale = v;
  }
  return c;
}

bool is_linear_json(std::string_view text) {
  const json j = json::parse(text.begin(), text.end(), nullptr, false);
  return j.is_object() && j.contains("kind") && j["kind"] == "linear";
}

}  // namespace flexc::detail
