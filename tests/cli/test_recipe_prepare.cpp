// A recipe names how its data is made (data.prepare): when data.path is missing, dtrain train
// prints that command, and the command pasted into a shell makes data the recipe trains on.
#include <doctest/doctest.h>

#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "run_cmd.h"

namespace stdfs = std::filesystem;

TEST_SUITE("integration") {

TEST_CASE("recipes: missing data prints the recipe's own prepare command and that command works") {
  const std::string work = std::string(DTRAIN_BUILD_DIR) + "/test_recipe_prepare";
  stdfs::remove_all(work);
  stdfs::create_directories(work);
  const std::string bin = shell_quote(dtrain_bin());
  const std::string src = DTRAIN_SOURCE_DIR;
  // the shipped recipes that make their own data say so, each with its own command
  for (auto [recipe, command] : std::vector<std::pair<std::string, std::string>>{
           {"unet_shapes.toml", "dtrain data shapes --out data/shapes --count 2000 --size 64 --classes 4"},
           {"resnet20_fmnist.toml", "dtrain data fashion-mnist --out data/fashion-mnist"},
           {"gpt_fortunes.toml", "dtrain data tokenize /usr/share/games/fortunes --out data/fortunes --tokenizer byte"}}) {
    auto r = run_cmd("cd " + work + " && " + bin + " train " + src + "/configs/" + recipe);
    INFO(recipe << ": " << r.all());
    CHECK(r.code == 2);
    CHECK(r.err.find("does not exist (prepare it with: " + command + ")") != std::string::npos);
  }
  // tiny_unet's command, pasted into a shell (dtrain on the PATH), makes its data
  auto r = run_cmd("cd " + work + " && " + bin + " train " + src + "/configs/tiny_unet.toml");
  REQUIRE(r.code == 2);
  const std::string pre = "(prepare it with: ";
  const size_t at = r.err.find(pre);
  REQUIRE_MESSAGE(at != std::string::npos, r.all());
  const std::string cmd = r.err.substr(at + pre.size(), r.err.find(")\n", at) - at - pre.size());
  CHECK(cmd.rfind("dtrain data shapes ", 0) == 0);
  const std::string path = "PATH=" + shell_quote(stdfs::path(dtrain_bin()).parent_path().string()) + ":$PATH ";
  auto made = run_cmd("cd " + work + " && " + path + "bash -c " + shell_quote(cmd));
  REQUIRE_MESSAGE(made.code == 0, made.all());
  auto trained = run_cmd("cd " + work + " && " + bin + " train " + src +
                         "/configs/tiny_unet.toml --set train.max_steps=2 --set eval.every_steps=0 "
                         "--set run.out_dir=\\\"" + work + "/runs\\\"");
  CHECK_MESSAGE(trained.code == 0, trained.all());
}

}  // TEST_SUITE
