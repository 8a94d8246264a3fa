// The typed recipe's field table, checked against the schema (recipe_table.h).
#include <unordered_map>

#include "config/config.h"
#include "config/recipe_fields.h"
#include "config/recipe_table.h"
#include "core/error.h"

namespace dtrain {

const std::vector<RecipeField>& recipe_fields() {
#define DTRAIN_RECIPE_FIELD(sec, name) \
  RecipeField{#sec "." #name, [](Recipe& r) -> FieldRef { return &r.sec.name; }},
  static const std::vector<RecipeField> table = {DTRAIN_RECIPE_FIELDS(DTRAIN_RECIPE_FIELD)};
#undef DTRAIN_RECIPE_FIELD
  return table;
}

const std::vector<size_t>& schema_field_index() {
  static const std::vector<size_t> index = [] {
    const auto& fields = recipe_fields();
    std::unordered_map<std::string_view, size_t> by_key;
    Recipe probe;
    for (size_t f = 0; f < fields.size(); ++f)
      DTRAIN_CHECK(by_key.emplace(fields[f].key, f).second, "recipe field {} is declared twice", fields[f].key);
    const auto& schema = config_schema();
    DTRAIN_CHECK(schema.size() == fields.size(), "the schema has {} keys and the typed recipe {} fields",
                 schema.size(), fields.size());
    std::vector<size_t> out;
    for (const KeySpec& s : schema) {
      auto it = by_key.find(s.key);
      DTRAIN_CHECK(it != by_key.end(), "schema key {} has no field in the typed recipe", s.key);
      const size_t have = fields[it->second].ref(probe).index();
      DTRAIN_CHECK(have == size_t(s.type), "schema key {} is {} but its recipe field is {}", s.key,
                   value_type_name(s.type), value_type_name(ValueType(have)));
      out.push_back(it->second);
    }
    return out;
  }();
  return index;
}

}  // namespace dtrain
