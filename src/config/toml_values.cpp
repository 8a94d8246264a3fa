// Reading TOML nodes into schema values and writing them back (toml_values.h).
#include "config/toml_values.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace dtrain::config_detail {


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
static size_t edit_distance(std::string_view a, std::string_view b) {
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
static std::optional<size_t> closeness(std::string_view typed, std::string_view cand) {
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
static std::string best_match(std::string_view typed, const Range& candidates) {
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

static std::string fmt_num(double v) { return fmt::format("{}", v); }

// "" when v is in range, else "expected a value >= 1, got -4".
static std::string range_problem(const Range& r, double v, const std::string& shown) {
  if (v < r.lo || (r.lo_open && v == r.lo))
    return fmt::format("expected a value {} {}, got {}", r.lo_open ? ">" : ">=", fmt_num(r.lo), shown);
  if (v > r.hi || (r.hi_open && v == r.hi))
    return fmt::format("expected a value {} {}, got {}", r.hi_open ? "<" : "<=", fmt_num(r.hi), shown);
  return "";
}


// One scalar element: fills `out` or returns the problem text.
static std::string scalar(const KeySpec& s, ValueType t, const toml::node& n, bool validate,
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

static std::string toml_string(const std::string& s) {
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

static std::string toml_float(double v) {
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


}  // namespace dtrain::config_detail
