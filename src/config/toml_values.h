#pragma once
// config/ only: reading TOML nodes into schema values (with the range, type and choice
// checks and their messages), writing values back as TOML, and the suggestions for unknown
// keys. Config (config.cpp) is built from these.
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <toml++/toml.h>
#include <vector>

#include "config/config.h"

namespace dtrain::config_detail {

// The schema's bounds: none, and the largest int keys (used as C++ ints downstream, or int64)
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kI32 = 2147483647.0;
constexpr double kI64 = 9223372036854775807.0;

struct Problem {
  toml::source_position pos{};
  std::string msg;
};

const char* node_kind(const toml::node& n);  // "a table", "an integer", ...
const char* expected_kind(ValueType t);  // "an integer", "a boolean (true or false)", ...
std::string unknown_key_message(std::string_view sec, std::string_view leaf);
std::string unknown_section_message(std::string_view sec);
// Converts node `n` for key `s` (validated: ranges, choices). On failure a Problem at the
// failing element when it has a position, else at `fallback`.
std::optional<Problem> convert(const KeySpec& s, const toml::node& n, bool validate,
                               toml::source_position fallback, Config::Value& out);
const std::vector<Config::Value>& default_values();  // the schema's, in its order
std::string pos_prefix(const std::string& src, toml::source_position p);  // "FILE:LINE:COL"
std::string one_line(std::string s);
std::string trim(std::string_view s);
std::string toml_value(const Config::Value& v);  // a TOML literal
std::string_view section_of(std::string_view key);  // "train" of "train.batch_size"
std::string_view leaf_of(std::string_view key);     // "batch_size"

}  // namespace dtrain::config_detail
