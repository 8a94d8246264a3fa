// Helpers shared by the command registrars.
#include "cli/command.h"

namespace dtrain::cli {

void add_recipe_options(CLI::App* c, std::vector<std::string>& overrides, std::string& device) {
  c->add_option("--set", overrides, "override a recipe key: section.key=value (repeatable)")
      ->type_name("KEY=VALUE")
      ->allow_extra_args(false);
  c->add_option("--device", device, "run on this device (overrides run.device)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
}

void set_examples(CLI::App* c, std::initializer_list<const char*> lines) {
  std::string text = "Examples:";
  for (const char* l : lines) text += std::string("\n  ") + l;
  c->footer(text);
}

}  // namespace dtrain::cli
