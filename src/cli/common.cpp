// Helpers shared by the command registrars.
#include "cli/command.h"

#include <filesystem>

#include "backend/backend.h"
#include "core/error.h"
#include "core/fsutil.h"
#include "config/config.h"

namespace dtrain::cli {

CLI::App* add_recipe_command(CLI::App& app, RecipeArgs& a, const std::string& name, const std::string& about,
                             const std::string& config_help, bool config_required) {
  auto* c = app.add_subcommand(name, about);
  auto* config = c->add_option("config", a.config, config_help)->type_name("CONFIG");
  if (config_required) config->required();
  return c;
}

void add_recipe_options(CLI::App* c, std::vector<std::string>& overrides, std::string& device) {
  c->add_option("--set", overrides, "override a recipe key: section.key=value (repeatable)")
      ->type_name("KEY=VALUE")
      ->allow_extra_args(false);
  c->add_option("--device", device, "run on this device (overrides run.device)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
}

void set_footer(CLI::App* c, const std::string& about, std::initializer_list<const char*> examples) {
  std::string text = about.empty() ? "Examples:" : about + "\n\nExamples:";
  for (const char* l : examples) text += std::string("\n  ") + l;
  c->footer(text);
}

void set_examples(CLI::App* c, std::initializer_list<const char*> lines) { set_footer(c, "", lines); }

void refuse_model_parallel(const Config& cfg, const std::string& command, const std::string& why) {
  for (const int64_t* size : {&cfg.parallel.pipeline, &cfg.parallel.tensor})
    if (*size > 1) user_error("{}: {} = {}: {}; set {} = 1", command, cfg.key_of(*size), *size, why, cfg.key_of(*size));
  if (cfg.parallel.sequence)
    user_error("{}: parallel.sequence = true: {} (sequence parallelism also needs parallel.tensor > 1); set "
               "parallel.sequence = false", command, why);
}

void prepare_process(char** argv) { select_blas_kernels(argv); }

void write_output_file(const std::string& option, const std::string& path, const std::string& text) {
  namespace stdfs = std::filesystem;
  std::error_code ec;
  const auto st = stdfs::status(path, ec);
  if (stdfs::exists(st) && !stdfs::is_regular_file(st))
    user_error("{} {}: exists and is not a regular file", option, path);
  try {
    fs::write_file_atomic(path, text);
  } catch (const RuntimeFault& e) {
    user_error("{} {}: cannot write it ({})", option, path, e.what());
  }
}

}  // namespace dtrain::cli
