// Config: parses a TOML recipe with toml++, validates it against the schema (schema.cpp),
// applies --set overrides and fills defaults. Every problem is a one-line UserError
// `FILE:LINE:COL: KEY: message`.
#include "config/config.h"

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
#include "config/recipe_table.h"
#include "config/toml_values.h"

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

using namespace config_detail;


// ---- building a Config ----

class ConfigBuilder {
 public:
  static Config make(const std::string& text, const std::string& source,
                     const std::vector<std::string>& overrides, const std::string& device) {
    Config c;
    c.source_ = source;
    const auto& defs = default_values();
    for (size_t k = 0; k < defs.size(); ++k) c.store(k, defs[k]);
    c.origins_.assign(defs.size(), "");
    toml::table root;
    try {
      root = toml::parse(std::string_view(text), std::string_view(source));
    } catch (const toml::parse_error& e) {
      throw UserError(fmt::format("{}: {}", pos_prefix(source, e.source().begin), one_line(std::string(e.description()))));
    }
    walk(c, root);
    std::vector<std::string> all = overrides;  // --device last: it wins over a --set of run.device
    if (!device.empty()) all.push_back("run.device=" + device);
    for (size_t k = 0; k < all.size(); ++k)
      c.apply_override(all[k], k < overrides.size() ? "--set " + log::printable(all[k]) : std::string("--device"));
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
        c.store(size_t(idx), std::move(val));
        c.origins_[size_t(idx)] = pos_prefix(c.source_, kp2);
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
                     const std::vector<std::string>& overrides, const std::string& device) {
  return ConfigBuilder::make(toml_text, source_name, overrides, device);
}

Config Config::load(const std::string& path, const std::vector<std::string>& overrides, const std::string& device) {
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
  return parse(text, path, overrides, device);
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
  store(size_t(idx), std::move(val));
  origins_[size_t(idx)] = label;
}

void Config::finish() {
  if (origins_[size_t(config_schema_index("run.name"))].empty()) {
    std::string stem = std::filesystem::path(source_).stem().string();
    run.name = stem.empty() ? std::string("run") : stem;
  }
  const auto& schema = config_schema();
  for (size_t k = 0; k < schema.size(); ++k)
    if (schema[k].required && origins_[k].empty()) {
      std::vector<std::string_view> ch(schema[k].choices.begin(), schema[k].choices.end());
      user_error("{}: {}: missing required key{}", source_, schema[k].key,
                 ch.empty() ? "" : fmt::format(" (one of {})", fmt::join(ch, ", ")));
    }
  // GPT and U-Net evaluate on "val" unless told otherwise (their converters write train/val);
  // resolved here so that the config.toml a run saves names the split it used
  if (!given(data.eval_split)) data.eval_split = model.kind == "gpt" || model.kind == "unet" ? "val" : "test";
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

void Config::assign_at(const void* field, Value v) { set(key_at(field), toml_value(v)); }

// ---- the fields ----

namespace {
FieldRef field_ref(const Recipe& r, size_t k) {
  return recipe_fields()[schema_field_index()[k]].ref(const_cast<Recipe&>(r));
}
const void* address(const FieldRef& f) {
  return std::visit([](auto* p) -> const void* { return p; }, f);
}
}  // namespace

Config::Value Config::value_at(size_t k) const {
  return std::visit([](auto* p) -> Value { return *p; }, field_ref(*this, k));
}

void Config::store(size_t k, Value v) {
  std::visit(
      [&](auto* p) {
        using T = std::remove_pointer_t<decltype(p)>;
        DTRAIN_CHECK(std::holds_alternative<T>(v), "config key {}: a value of another type", config_schema()[k].key);
        *p = std::get<T>(std::move(v));
      },
      field_ref(*this, k));
}

size_t Config::index_at(const void* field) const {
  for (size_t k = 0; k < config_schema().size(); ++k)
    if (address(field_ref(*this, k)) == field) return k;
  fault("Config: not a field of this recipe");
}
std::string_view Config::key_at(const void* field) const { return config_schema()[index_at(field)].key; }
const std::string& Config::origin_at(const void* field) const { return origins_[index_at(field)]; }

// ---- accessors by key (config/ and tests) ----

Config::Value Config::value(std::string_view key, ValueType want) const {
  int idx = config_schema_index(key);
  DTRAIN_CHECK(idx >= 0, "'{}' is not a config key", key);
  ValueType have = config_schema()[idx].type;
  DTRAIN_CHECK(have == want || (want == ValueType::Float && have == ValueType::Int),
               "config key {} is {}, read as {}", key, value_type_name(have), value_type_name(want));
  DTRAIN_CHECK(size_t(idx) < origins_.size(), "config not loaded");
  return value_at(size_t(idx));
}

int64_t Config::i(std::string_view key) const { return std::get<int64_t>(value(key, ValueType::Int)); }
double Config::f(std::string_view key) const {
  const Value v = value(key, ValueType::Float);
  return std::holds_alternative<int64_t>(v) ? double(std::get<int64_t>(v)) : std::get<double>(v);
}
bool Config::b(std::string_view key) const { return std::get<bool>(value(key, ValueType::Bool)); }
const std::string& Config::s(std::string_view key) const {
  (void)value(key, ValueType::String);  // checks the key and its type
  return *std::get<std::string*>(field_ref(*this, size_t(config_schema_index(key))));
}
std::vector<int64_t> Config::iv(std::string_view key) const {
  return std::get<std::vector<int64_t>>(value(key, ValueType::IntArray));
}
std::vector<double> Config::fv(std::string_view key) const {
  return std::get<std::vector<double>>(value(key, ValueType::FloatArray));
}

const std::string& Config::origin(std::string_view key) const {
  int idx = config_schema_index(key);
  DTRAIN_CHECK(idx >= 0 && size_t(idx) < origins_.size(), "'{}' is not a config key", key);
  return origins_[size_t(idx)];
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
    out += fmt::format("{} = {}\n", leaf_of(schema[k].key), toml_value(value_at(k)));
  }
  return out;
}

std::string Config::hash() const {
  std::string t = to_toml();
  return sha256_hex(t.data(), t.size());
}

}  // namespace dtrain
