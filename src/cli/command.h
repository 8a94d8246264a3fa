#pragma once
// The dtrain commands. Each cli/<command>.cpp holds one command: its argument struct, its
// CLI11 subcommand (options and the --help examples of that command) and its entry point,
// which drives the library (train/, data/, comm/, ...). main.cpp only builds the app from
// the registrars below and runs the command that was parsed. Nothing else calls into cli/.
// Entry points return the process exit code and may throw dtrain::Error (main maps it: 2
// user error, 1 runtime fault).
#include <CLI/CLI.hpp>

#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

namespace dtrain {
class Config;
}

namespace dtrain::cli {

// The parsed command's entry point, set by its subcommand's callback.
using Run = std::function<int()>;

void add_train(CLI::App& app, Run& run);
void add_eval(CLI::App& app, Run& run);
void add_sample(CLI::App& app, Run& run);
void add_bench(CLI::App& app, Run& run);
void add_inspect(CLI::App& app, Run& run);
void add_data(CLI::App& app, Run& run);
void add_import(CLI::App& app, Run& run);
void add_report(CLI::App& app, Run& run);
void add_reproduce(CLI::App& app, Run& run);
void add_info(CLI::App& app, Run& run);
void add_plan(CLI::App& app, Run& run);
void add_checkpoint(CLI::App& app, Run& run);

// What the commands that read a recipe take: the recipe file, its --set overrides, --device.
struct RecipeArgs {
  std::string config;
  std::vector<std::string> overrides;
  std::string device;
};
// The subcommand `name` of a command that reads a recipe, with its CONFIG positional (required
// unless the command has another mode); the command adds --set and --device after its own
// options (add_recipe_options).
CLI::App* add_recipe_command(CLI::App& app, RecipeArgs& a, const std::string& name, const std::string& about,
                             const std::string& config_help, bool config_required);
// --set KEY=VALUE (repeatable) and --device, shared by the commands that read a recipe.
void add_recipe_options(CLI::App* c, std::vector<std::string>& overrides, std::string& device);
// The footer of a command's --help: `about` (paragraphs), then the "Examples:" lines.
void set_footer(CLI::App* c, const std::string& about, std::initializer_list<const char*> examples);
// A footer of examples alone.
void set_examples(CLI::App* c, std::initializer_list<const char*> lines);
// The entry point of subcommand c, once parsed: cmd(*a).
template <class Args>
void run_when_parsed(CLI::App* c, Run& run, std::shared_ptr<Args> a, int (*cmd)(const Args&)) {
  c->callback([a, cmd, &run] { run = [a, cmd] { return cmd(*a); }; });
}
// What the process sets up before parsing: the CPU BLAS kernels (may re-execute the process,
// see select_blas_kernels in backend/backend.h).
void prepare_process(char** argv);

// For commands that run a recipe's data-parallel layouts only (bench, plan --nproc): a
// UserError "<command>: parallel.<key> = <value>: <why>; set ..." naming the first of
// parallel.pipeline > 1, parallel.tensor > 1, parallel.sequence = true that `cfg` sets.
void refuse_model_parallel(const Config& cfg, const std::string& command, const std::string& why);

// Writes a result file the user named (--json PATH): replaced atomically when it is a regular
// file or absent; a UserError naming `option` when PATH is something else (a directory, a
// device: it was replaced by a file) or cannot be written.
void write_output_file(const std::string& option, const std::string& path, const std::string& text);

}  // namespace dtrain::cli
