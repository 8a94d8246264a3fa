#pragma once
// The typed recipe's field table (config/ only): each field of Recipe bound to its schema key
// through the two names it is declared with (recipe_fields.h), so that a key is spelled once.
#include <string_view>
#include <variant>
#include <vector>

#include "config/recipe.h"

namespace dtrain {

// The alternatives follow ValueType's order: Int, Float, Bool, String, IntArray, FloatArray.
using FieldRef = std::variant<int64_t*, double*, bool*, std::string*, std::vector<int64_t>*,
                              std::vector<double>*>;

struct RecipeField {
  std::string_view key;       // "train.batch_size"
  FieldRef (*ref)(Recipe&);   // the field in a recipe
};

const std::vector<RecipeField>& recipe_fields();

// For schema key k, the index into recipe_fields() of its field. Checked once: every schema key
// has exactly one field of its type and every field is a schema key (else a RuntimeFault).
const std::vector<size_t>& schema_field_index();

}  // namespace dtrain
