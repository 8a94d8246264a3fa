// Config: parses a TOML recipe with toml++, validates it against the schema (schema.cpp),
// applies --set overrides and fills defaults. Every problem is a one-line UserError
// `FILE:LINE:COL: KEY: message`.
#include "train/config.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <toml++/toml.h>

#include "core/error.h"
#include "core/log.h"
#include "core/sha256.h"

namespace dtrain {

const char* value_type_name(ValueType t) {
  switch (t) {
    case ValueType::Int: return "int";
    case ValueType::Float: return "float";
    case ValueType::Bool: return "bool";
    case ValueType::String: return "string";
    case ValueType::IntArray: return "int-array";
    case ValueType::FloatArray: return "float-array";
  }
  return "?";
}

namespace {

// ---- names and suggestions ----

const char* node_kind(const toml::node& n) {
  switch (n.type()) {
    case toml::node_type::table: return "a table";
    case toml::node_type::array: return "an array";
    case toml::node_type::string: return "a string";
    case toml::node_type::integer: return "an integer";
    case toml::node_type::floating_point: return "a float";
    case toml::node_type::boolean: return "a boolean";
    case toml::node_type::date: return "a date";
    case toml::node_type::time: return "a time";
    case toml::node_type::date_time: return "a date-time";
    default: return "nothing";
  }
}

const char* expected_kind(ValueType t) {
  switch (t) {
    case ValueType::Int: return "an integer";
    case ValueType::Float: return "a number";
    case ValueType::Bool: return "a boolean (true or false)";
    case ValueType::String: return "a string";
    case ValueType::IntArray: return "an array of integers";
    case ValueType::FloatArray: return "an array of numbers";
  }
  return "?";
}

// Optimal string alignment (restricted Damerau-Levenshtein) distance.
size_t edit_distance(std::string_view a, std::string_view b) {
  const size_t n = a.size(), m = b.size();
  std::vector<std::vector<size_t>> d(n + 1, std::vector<size_t>(m + 1));
  for (size_t i = 0; i <= n; ++i) d[i][0] = i;
  for (size_t j = 0; j <= m; ++j) d[0][j] = j;
  for (size_t i = 1; i <= n; ++i)
    for (size_t j = 1; j <= m; ++j) {
      size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[n][m];
}

// How close `typed` is to `cand`: lower is better; nullopt when not a plausible typo.
std::optional<size_t> closeness(std::string_view typed, std::string_view cand) {
  size_t d = edit_distance(typed, cand);
  const size_t slack = typed.size() <= 4 ? 1 : 2;  // "dir" is not a typo of "lr"
  if (d <= slack && d < std::max(typed.size(), cand.size())) return d;
  bool prefix = typed.size() >= 3 && cand.size() >= 3 &&
                (cand.substr(0, typed.size()) == typed || typed.substr(0, cand.size()) == cand);
  if (prefix) return 3;
  // one word of a snake_case key: "dir" for out_dir, "scale" for loss_scale
  if (typed.size() >= 3)
    for (size_t b = 0; b < cand.size();) {
      size_t e = std::min(cand.find('_', b), cand.size());
      if (cand.substr(b, e - b) == typed) return 4;
      b = e + 1;
    }
  return std::nullopt;
}

template <typename Range>
std::string best_match(std::string_view typed, const Range& candidates) {
  std::string best;
  size_t best_d = SIZE_MAX;
  for (std::string_view c : candidates)
    if (auto d = closeness(typed, c); d && *d < best_d) best_d = *d, best = std::string(c);
  return best;
}

std::string_view section_of(std::string_view key) { return key.substr(0, key.find('.')); }
std::string_view leaf_of(std::string_view key) { return key.substr(key.find('.') + 1); }

// Message for a key that is not in the schema: `sec` may be "" (key at the top level).
std::string unknown_key_message(std::string_view sec, std::string_view leaf) {
  std::vector<std::string_view> same, all;
  for (const auto& s : config_schema()) {
    all.push_back(s.key);
    if (section_of(s.key) == sec) same.push_back(leaf_of(s.key));
  }
  std::string hint = best_match(leaf, same);
  if (!hint.empty()) return fmt::format("unknown key (did you mean {}.{}?)", sec, hint);
  // Across sections: the same or a similar key name elsewhere.
  std::string best;
  size_t best_d = SIZE_MAX;
  for (std::string_view k : all)
    if (auto d = closeness(leaf, leaf_of(k)); d && *d < best_d) best_d = *d, best = std::string(k);
  if (sec.empty()) {
    if (!best.empty()) return fmt::format("keys belong in a section (did you mean {}?)", best);
    return fmt::format("unknown key; keys belong in a section: {}",
                       fmt::join(config_sections(), ", "));
  }
  if (!best.empty()) return fmt::format("unknown key (did you mean {}?)", best);
  return fmt::format("unknown key; [{}] has: {}", sec, fmt::join(same, ", "));
}

std::string unknown_section_message(std::string_view sec) {
  auto secs = config_sections();
  std::string hint = best_match(sec, secs);
  if (!hint.empty()) return fmt::format("unknown section (did you mean [{}]?)", hint);
  return fmt::format("unknown section; sections are: {}", fmt::join(secs, ", "));
}

// ---- value conversion and validation ----

std::string fmt_num(double v) { return fmt::format("{}", v); }

// "" when v is in range, else "expected a value >= 1, got -4".
std::string range_problem(const Range& r, double v, const std::string& shown) {
  if (v < r.lo || (r.lo_open && v == r.lo))
    return fmt::format("expected a value {} {}, got {}", r.lo_open ? ">" : ">=", fmt_num(r.lo), shown);
  if (v > r.hi || (r.hi_open && v == r.hi))
    return fmt::format("expected a value {} {}, got {}", r.hi_open ? "<" : "<=", fmt_num(r.hi), shown);
  return "";
}

struct Problem {
  toml::source_position pos{};
  std::string msg;
};

// One scalar element: fills `out` or returns the problem text.
std::string scalar(const KeySpec& s, ValueType t, const toml::node& n, bool validate,
                   Config::Value& out) {
  switch (t) {
    case ValueType::Int: {
      if (!n.is_integer()) return fmt::format("expected an integer, got {}", node_kind(n));
      int64_t v = n.as_integer()->get();
      if (validate) {
        std::string p = range_problem(s.range, double(v), std::to_string(v));
        if (!p.empty()) return p;
      }
      out = v;
      return "";
    }
    case ValueType::Float: {
      double v;
      if (n.is_floating_point()) v = n.as_floating_point()->get();
      else if (n.is_integer()) v = double(n.as_integer()->get());
      else return fmt::format("expected a number, got {}", node_kind(n));
      if (!std::isfinite(v)) return fmt::format("expected a finite number, got {}", fmt_num(v));
      if (validate) {
        std::string p = range_problem(s.range, v, fmt_num(v));
        if (!p.empty()) return p;
      }
      out = v;
      return "";
    }
    case ValueType::Bool:
      if (!n.is_boolean()) return fmt::format("expected a boolean (true or false), got {}", node_kind(n));
      out = n.as_boolean()->get();
      return "";
    case ValueType::String: {
      if (!n.is_string()) return fmt::format("expected a string, got {}", node_kind(n));
      const std::string& v = n.as_string()->get();
      if (validate && !s.choices.empty() &&
          std::find(s.choices.begin(), s.choices.end(), v) == s.choices.end()) {
        std::vector<std::string> shown;
        for (auto c : s.choices) shown.push_back(c.empty() ? "\"\"" : std::string(c));
        std::string hint = best_match(v, s.choices);
        return fmt::format("expected one of {}, got '{}'{}", fmt::join(shown, ", "), v,
                           hint.empty() ? "" : fmt::format(" (did you mean {}?)", hint));
      }
      out = v;
      return "";
    }
    default: break;
  }
  return "internal: not a scalar type";
}

// Converts node `n` for key `s`. On failure returns a Problem (position of the failing
// element when the node has one, else `fallback`).
std::optional<Problem> convert(const KeySpec& s, const toml::node& n, bool validate,
                               toml::source_position fallback, Config::Value& out) {
  auto at = [&](const toml::node& x) { return x.source().begin.line ? x.source().begin : fallback; };
  if (s.type != ValueType::IntArray && s.type != ValueType::FloatArray) {
    std::string p = scalar(s, s.type, n, validate, out);
    if (p.empty()) return std::nullopt;
    return Problem{at(n), p};
  }
  bool ints = s.type == ValueType::IntArray;
  const toml::array* arr = n.as_array();
  if (!arr) {
    std::string hint = n.is_integer() || n.is_floating_point()
                           ? fmt::format(" (write [{}])", n.is_integer() ? std::to_string(n.as_integer()->get())
                                                                          : fmt_num(n.as_floating_point()->get()))
                           : "";
    return Problem{at(n), fmt::format("expected {}, got {}{}", expected_kind(s.type), node_kind(n), hint)};
  }
  std::vector<int64_t> iv;
  std::vector<double> fv;
  for (size_t k = 0; k < arr->size(); ++k) {
    const toml::node& e = *arr->get(k);
    Config::Value ev;
    std::string p = scalar(s, ints ? ValueType::Int : ValueType::Float, e, validate, ev);
    if (!p.empty())
      return Problem{at(e), fmt::format("element [{}]: {}", k, p)};
    if (ints) iv.push_back(std::get<int64_t>(ev));
    else fv.push_back(std::get<double>(ev));
  }
  if (ints) out = std::move(iv);
  else out = std::move(fv);
  return std::nullopt;
}

const std::vector<Config::Value>& default_values() {
  static const std::vector<Config::Value> defs = [] {
    std::vector<Config::Value> out;
    for (const auto& s : config_schema()) {
      toml::table t = toml::parse(fmt::format("v = {}", s.def));
      Config::Value v;
      auto p = convert(s, *t.get("v"), /*validate=*/!s.required, {}, v);
      DTRAIN_CHECK(!p, "schema default of {} is invalid: {}", s.key, p ? p->msg : "");
      out.push_back(std::move(v));
    }
    return out;
  }();
  return defs;
}

std::string pos_prefix(const std::string& src, toml::source_position p) {
  if (!p.line) return src;
  return fmt::format("{}:{}:{}", src, p.line, p.column);
}

std::string one_line(std::string s) {
  std::replace(s.begin(), s.end(), '\n', ' ');
  return s;
}


std::string trim(std::string_view s) {
  size_t b = s.find_first_not_of(" \t"), e = s.find_last_not_of(" \t");
  return b == std::string_view::npos ? "" : std::string(s.substr(b, e - b + 1));
}

// ---- TOML output ----

std::string toml_string(const std::string& s) {
  std::string o = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': o += "\\\""; break;
      case '\\': o += "\\\\"; break;
      case '\n': o += "\\n"; break;
      case '\t': o += "\\t"; break;
      case '\r': o += "\\r"; break;
      default:
        if (c < 0x20 || c == 0x7f) o += fmt::format("\\u{:04X}", unsigned(c));
        else o += char(c);
    }
  }
  return o + "\"";
}

std::string toml_float(double v) {
  std::string s = fmt::format("{}", v);
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}

std::string toml_value(const Config::Value& v) {
  struct V {
    std::string operator()(int64_t x) const { return std::to_string(x); }
    std::string operator()(double x) const { return toml_float(x); }
    std::string operator()(bool x) const { return x ? "true" : "false"; }
    std::string operator()(const std::string& x) const { return toml_string(x); }
    std::string operator()(const std::vector<int64_t>& x) const { return fmt::format("[{}]", fmt::join(x, ", ")); }
    std::string operator()(const std::vector<double>& x) const {
      std::vector<std::string> e;
      for (double d : x) e.push_back(toml_float(d));
      return fmt::format("[{}]", fmt::join(e, ", "));
    }
  };
  return std::visit(V{}, v);
}

}  // namespace

// ---- building a Config ----

class ConfigBuilder {
 public:
  static Config make(const std::string& text, const std::string& source,
                     const std::vector<std::string>& overrides) {
    Config c;
    c.source_ = source;
    const auto& defs = default_values();
    for (const auto& d : defs) c.entries_.push_back({d, ""});
    toml::table root;
    try {
      root = toml::parse(std::string_view(text), std::string_view(source));
    } catch (const toml::parse_error& e) {
      throw UserError(fmt::format("{}: {}", pos_prefix(source, e.source().begin), one_line(std::string(e.description()))));
    }
    walk(c, root);
    for (const auto& ov : overrides) c.apply_override(ov, "--set " + log::printable(ov));
    c.finish();
    return c;
  }

 private:
  // Validates every key of the file; throws the first problem in file order.
  static void walk(Config& c, const toml::table& root) {
    std::vector<std::pair<Problem, std::string>> problems;  // (where+what, key)
    auto add = [&](toml::source_position p, std::string key, std::string msg) {
      problems.push_back({Problem{p, std::move(msg)}, std::move(key)});
    };
    auto secs = config_sections();
    for (auto&& [k, v] : root) {
      std::string sec(k.str());
      toml::source_position kp = k.source().begin;
      bool known = std::find(secs.begin(), secs.end(), sec) != secs.end();
      if (!v.is_table()) {
        if (known) add(kp, sec, fmt::format("expected a table [{}], got {}", sec, node_kind(v)));
        else add(kp, sec, unknown_key_message("", sec));
        continue;
      }
      if (!known) {
        // The table's region starts at its `[header]`; dotted keys give no region.
        add(v.source().begin.line ? v.source().begin : kp, sec, unknown_section_message(sec));
        continue;
      }
      for (auto&& [k2, v2] : *v.as_table()) {
        std::string key = sec + "." + std::string(k2.str());
        toml::source_position kp2 = k2.source().begin;
        int idx = config_schema_index(key);
        if (idx < 0) {
          add(kp2, key, unknown_key_message(sec, k2.str()));
          continue;
        }
        const KeySpec& s = config_schema()[idx];
        Config::Value val;
        if (auto p = convert(s, v2, true, kp2, val)) {
          add(p->pos, key, p->msg);
          continue;
        }
        c.entries_[idx] = {std::move(val), pos_prefix(c.source_, kp2)};
      }
    }
    if (problems.empty()) return;
    auto first = std::min_element(problems.begin(), problems.end(), [](const auto& a, const auto& b) {
      return std::pair(a.first.pos.line, a.first.pos.column) < std::pair(b.first.pos.line, b.first.pos.column);
    });
    std::string more = problems.size() > 1
                           ? fmt::format(" [{} more problem{} in this file]", problems.size() - 1,
                                         problems.size() > 2 ? "s" : "")
                           : "";
    throw UserError(fmt::format("{}: {}: {}{}", pos_prefix(c.source_, first->first.pos), first->second,
                                first->first.msg, more));
  }
};

Config Config::parse(const std::string& toml_text, const std::string& source_name,
                     const std::vector<std::string>& overrides) {
  return ConfigBuilder::make(toml_text, source_name, overrides);
}

Config Config::load(const std::string& path, const std::vector<std::string>& overrides) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) user_error("cannot read recipe {}: {}", path, std::strerror(EISDIR));
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) user_error("cannot read recipe {}: {}", path, std::strerror(errno));
  std::string text;
  char buf[65536];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) {
    text.append(buf, n);
    if (text.size() > (16u << 20)) {  // /dev/zero, a data file: never a recipe
      std::fclose(f);
      user_error("recipe {}: more than 16 MiB: not a recipe", path);
    }
  }
  int err = std::ferror(f) ? errno : 0;
  std::fclose(f);
  if (err) user_error("cannot read recipe {}: {}", path, std::strerror(err));
  return parse(text, path, overrides);
}

void Config::apply_override(const std::string& ov, const std::string& label) {
  size_t eq = ov.find('=');
  if (eq == std::string::npos)
    user_error("{}: expected section.key=value (e.g. train.batch_size=64)", label);
  std::string key = trim(std::string_view(ov).substr(0, eq));
  std::string text = trim(std::string_view(ov).substr(eq + 1));
  int idx = config_schema_index(key);
  if (idx < 0) {
    size_t dot = key.find('.');
    auto secs = config_sections();
    std::string sec = dot == std::string::npos ? "" : key.substr(0, dot);
    bool known = std::find(secs.begin(), secs.end(), sec) != secs.end();
    std::string msg = dot == std::string::npos
                          ? unknown_key_message("", key)
                          : known ? unknown_key_message(sec, key.substr(dot + 1)) : unknown_section_message(sec);
    user_error("{}: {}: {}", label, key, msg);
  }
  const KeySpec& s = config_schema()[idx];
  if (log::printable(text) != text) user_error("{}: {}: expected a one-line value of UTF-8 text", label, key);
  std::optional<toml::table> parsed;
  {
    try {
      parsed = toml::parse(fmt::format("v = {}", text), std::string_view("--set"));
      if (parsed->size() != 1 || !parsed->get("v")) parsed.reset();
    } catch (const toml::parse_error&) {
      parsed.reset();
    }
  }
  // Bare strings: a string key takes the raw text unless it is a quoted TOML string.
  if (s.type == ValueType::String && (!parsed || !parsed->get("v")->is_string()))
    parsed = toml::table{{"v", text}};
  if (!parsed)
    user_error("{}: {}: expected {}, got '{}'", label, key, expected_kind(s.type), text);
  Value val;
  if (auto p = convert(s, *parsed->get("v"), true, {}, val)) user_error("{}: {}: {}", label, key, p->msg);
  entries_[idx] = {std::move(val), label};
}

void Config::finish() {
  int name_idx = config_schema_index("run.name");
  if (entries_[name_idx].origin.empty()) {
    std::string stem = std::filesystem::path(source_).stem().string();
    entries_[name_idx].v = stem.empty() ? std::string("run") : stem;
  }
  const auto& schema = config_schema();
  for (size_t k = 0; k < schema.size(); ++k)
    if (schema[k].required && entries_[k].origin.empty()) {
      std::vector<std::string_view> ch(schema[k].choices.begin(), schema[k].choices.end());
      user_error("{}: {}: missing required key{}", source_, schema[k].key,
                 ch.empty() ? "" : fmt::format(" (one of {})", fmt::join(ch, ", ")));
    }
  // GPT and U-Net evaluate on "val" unless told otherwise (their converters write train/val);
  // resolved here so that the config.toml a run saves names the split it used
  if (const int split_idx = config_schema_index("data.eval_split"); entries_[split_idx].origin.empty())
    entries_[split_idx].v = std::string(s("model.kind") == "gpt" || s("model.kind") == "unet" ? "val" : "test");
  CrossCheckFailure x = config_cross_check(*this);
  if (!x.key.empty()) {
    const std::string& where = origin(x.key);
    user_error("{}: {}: {}", where.empty() ? source_ : where, x.key, x.message);
  }
}

void Config::set(std::string_view key, const std::string& toml_value) {
  Config copy = *this;
  std::string ov = fmt::format("{}={}", key, toml_value);
  copy.apply_override(ov, log::printable(ov));
  CrossCheckFailure x = config_cross_check(copy);
  if (!x.key.empty()) user_error("{}: {}: {}", log::printable(ov), x.key, x.message);
  *this = std::move(copy);
}

// ---- accessors ----

const Config::Entry& Config::entry(std::string_view key, ValueType want) const {
  int idx = config_schema_index(key);
  DTRAIN_CHECK(idx >= 0, "'{}' is not a config key", key);
  ValueType have = config_schema()[idx].type;
  DTRAIN_CHECK(have == want || (want == ValueType::Float && have == ValueType::Int),
               "config key {} is {}, read as {}", key, value_type_name(have), value_type_name(want));
  DTRAIN_CHECK(size_t(idx) < entries_.size(), "config not loaded");
  return entries_[idx];
}

int64_t Config::i(std::string_view key) const { return std::get<int64_t>(entry(key, ValueType::Int).v); }
double Config::f(std::string_view key) const {
  const Value& v = entry(key, ValueType::Float).v;
  return std::holds_alternative<int64_t>(v) ? double(std::get<int64_t>(v)) : std::get<double>(v);
}
bool Config::b(std::string_view key) const { return std::get<bool>(entry(key, ValueType::Bool).v); }
const std::string& Config::s(std::string_view key) const {
  return std::get<std::string>(entry(key, ValueType::String).v);
}
std::vector<int64_t> Config::iv(std::string_view key) const {
  return std::get<std::vector<int64_t>>(entry(key, ValueType::IntArray).v);
}
std::vector<double> Config::fv(std::string_view key) const {
  return std::get<std::vector<double>>(entry(key, ValueType::FloatArray).v);
}

const std::string& Config::origin(std::string_view key) const {
  int idx = config_schema_index(key);
  DTRAIN_CHECK(idx >= 0 && size_t(idx) < entries_.size(), "'{}' is not a config key", key);
  return entries_[idx].origin;
}
bool Config::is_set(std::string_view key) const { return !origin(key).empty(); }

std::string Config::to_toml() const {
  std::string out;
  std::string_view sec;
  const auto& schema = config_schema();
  for (size_t k = 0; k < schema.size(); ++k) {
    std::string_view s = section_of(schema[k].key);
    if (s != sec) {
      out += fmt::format("{}[{}]\n", out.empty() ? "" : "\n", s);
      sec = s;
    }
    out += fmt::format("{} = {}\n", leaf_of(schema[k].key), toml_value(entries_[k].v));
  }
  return out;
}

std::string Config::hash() const {
  std::string t = to_toml();
  return sha256_hex(t.data(), t.size());
}

}  // namespace dtrain
