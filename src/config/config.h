#pragma once
// Strict TOML recipes. A recipe is validated against ONE schema table (schema.cpp):
// unknown sections/keys, wrong types, out-of-range values and bad enum choices are
// UserErrors (exit 2) of the form `FILE:LINE:COL: KEY: message`. Every key has a
// default (except required ones), so after load() every schema key has a value.
//
// The TOML is read once, here, into the typed recipe (recipe.h) that Config is:
//
//   Config c = Config::load("configs/resnet20_fmnist.toml", {"optim.lr=0.05"});
//   int64_t bs = c.train.batch_size;
//   if (c.given(c.train.grad_accum)) ...        // written in the recipe or an override
//   c.assign(c.train.grad_accum, int64_t(2));   // validated like an override
//
// Code outside config/ names no key string: it reads fields, and asks key_of(field) for
// the name to put in a message. The string accessors (c.i("train.batch_size")) are for
// config/ itself and for tests; a key that is not in the schema, or the accessor of another
// type, is a bug in dtrain (RuntimeFault). Write fields through assign(), not directly:
// to_toml() and hash() read the fields, so a direct write would go unvalidated.
#include <concepts>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "config/recipe.h"

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

template <class T>
concept RecipeFieldType = std::same_as<T, int64_t> || std::same_as<T, double> || std::same_as<T, bool> ||
                          std::same_as<T, std::string> || std::same_as<T, std::vector<int64_t>> ||
                          std::same_as<T, std::vector<double>>;

class Config : public Recipe {
 public:
  using Value = std::variant<int64_t, double, bool, std::string, std::vector<int64_t>,
                             std::vector<double>>;

  // Parse file; apply overrides "section.key=value" (value in TOML syntax, bare strings
  // allowed, e.g. optim.name=adamw), then `device` (the CLI's --device: run.device; "" = the
  // recipe's); validate against the schema; fill defaults. Throws UserError.
  static Config load(const std::string& path, const std::vector<std::string>& overrides = {},
                     const std::string& device = "");
  static Config parse(const std::string& toml_text, const std::string& source_name,
                      const std::vector<std::string>& overrides = {}, const std::string& device = "");

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

  // The typed side: `field` must be a field of this Config (else RuntimeFault).
  template <RecipeFieldType T>
  std::string_view key_of(const T& field) const { return key_at(&field); }  // "train.grad_accum"
  template <RecipeFieldType T>
  bool given(const T& field) const { return !origin_at(&field).empty(); }
  template <RecipeFieldType T>
  const std::string& origin_of(const T& field) const { return origin_at(&field); }
  template <RecipeFieldType T>
  const KeySpec& spec_of(const T& field) const { return config_schema()[index_at(&field)]; }
  template <RecipeFieldType T>
  void assign(const T& field, const std::type_identity_t<T>& value) { assign_at(&field, Value(value)); }

  std::string to_toml() const;  // resolved recipe, every key, re-parseable
  std::string hash() const;     // sha256 hex of to_toml()
  const std::string& source() const { return source_; }

 private:
  Config() = default;
  Value value(std::string_view key, ValueType want) const;
  Value value_at(size_t k) const;      // schema key k's field as a Value
  void store(size_t k, Value v);       // into schema key k's field (the types agree)
  size_t index_at(const void* field) const;
  std::string_view key_at(const void* field) const;
  const std::string& origin_at(const void* field) const;
  void assign_at(const void* field, Value v);
  void apply_override(const std::string& ov, const std::string& label);
  void finish();  // defaults that depend on the source, required keys, cross checks

  std::string source_;
  std::vector<std::string> origins_;  // indexed like config_schema(); "" = default
  friend class ConfigBuilder;
};

// A first failing cross-key rule (schema.cpp): key to blame and the message, or empty key.
struct CrossCheckFailure {
  std::string key, message;
};
CrossCheckFailure config_cross_check(const Config& c);

// lora.target_modules as a list (comma-separated, spaces trimmed, duplicates dropped), and the
// module names LoRA may target in model.arch's family (Hugging Face's names).
std::vector<std::string> lora_targets(const std::string& list);
const std::vector<std::string>& lora_family_modules(const std::string& arch);

// Human-readable reference of every key: type, default, range/choices, help (Markdown).
std::string config_reference();

}  // namespace dtrain
