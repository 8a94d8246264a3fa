#pragma once
// Strict TOML recipes. A recipe is validated against ONE schema table (schema.cpp):
// unknown sections/keys, wrong types, out-of-range values and bad enum choices are
// UserErrors (exit 2) of the form `FILE:LINE:COL: KEY: message`. Every key has a
// default (except required ones), so after load() every schema key has a value.
//
//   Config c = Config::load("configs/resnet20_fmnist.toml", {"optim.lr=0.05"});
//   int64_t bs = c.i("train.batch_size");
//
// Accessors take the full key path ("section.key"). Asking for a key that is not in
// the schema, or with the accessor of another type, is a bug in dtrain (RuntimeFault).
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace dtrain {

enum class ValueType { Int, Float, Bool, String, IntArray, FloatArray };
const char* value_type_name(ValueType t);  // "int", "float", ..., "int-array"

// Closed/open numeric bounds; for arrays they apply to every element.
struct Range {
  double lo = -std::numeric_limits<double>::infinity();
  double hi = std::numeric_limits<double>::infinity();
  bool lo_open = false, hi_open = false;
};

struct KeySpec {
  std::string_view key;       // "train.batch_size"
  ValueType type;
  std::string_view def;       // default as a TOML literal ("128", "\"sgd\"", "[]")
  Range range;
  std::vector<std::string_view> choices;  // string enums; empty = any string
  bool required = false;
  std::string_view help;
};

// The schema, in the order sections and keys are written by to_toml().
const std::vector<KeySpec>& config_schema();
int config_schema_index(std::string_view key);  // -1 when not a schema key
std::vector<std::string_view> config_sections();  // "run", "model", ...

class Config {
 public:
  using Value = std::variant<int64_t, double, bool, std::string, std::vector<int64_t>,
                             std::vector<double>>;

  // Parse file; apply overrides "section.key=value" (value in TOML syntax, bare strings
  // allowed, e.g. optim.name=adamw); validate against the schema; fill defaults.
  // Throws UserError.
  static Config load(const std::string& path, const std::vector<std::string>& overrides = {});
  static Config parse(const std::string& toml_text, const std::string& source_name,
                      const std::vector<std::string>& overrides = {});

  int64_t i(std::string_view key) const;
  double f(std::string_view key) const;  // float keys (int keys are converted too)
  bool b(std::string_view key) const;
  const std::string& s(std::string_view key) const;
  std::vector<int64_t> iv(std::string_view key) const;
  std::vector<double> fv(std::string_view key) const;

  bool is_set(std::string_view key) const;  // given in the file or an override
  // Where a key's value came from: "FILE:LINE:COL", "--set k=v", or "" for a default.
  const std::string& origin(std::string_view key) const;
  // Sets one key, validated like an override (then the cross-key checks run again).
  void set(std::string_view key, const std::string& toml_value);

  std::string to_toml() const;  // resolved recipe, every key, re-parseable
  std::string hash() const;     // sha256 hex of to_toml()
  const std::string& source() const { return source_; }

 private:
  struct Entry {
    Value v;
    std::string origin;  // "" = default
  };
  Config() = default;
  const Entry& entry(std::string_view key, ValueType want) const;
  void apply_override(const std::string& ov, const std::string& label);
  void finish();  // defaults that depend on the source, required keys, cross checks

  std::string source_;
  std::vector<Entry> entries_;  // indexed like config_schema()
  friend class ConfigBuilder;
};

// A first failing cross-key rule (schema.cpp): key to blame and the message, or empty key.
struct CrossCheckFailure {
  std::string key, message;
};
CrossCheckFailure config_cross_check(const Config& c);

// Human-readable reference of every key: type, default, range/choices, help (Markdown).
std::string config_reference();

}  // namespace dtrain
