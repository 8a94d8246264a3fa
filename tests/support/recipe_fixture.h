#pragma once
// A small GPT recipe on synthetic data and the expectation of a one-line user error (exit 2),
// shared by the tests of the recipe's rules and of the parallel layout.
#include <doctest/doctest.h>

#include <functional>
#include <string>

#include "core/error.h"

namespace recipe_fixture {

inline const std::string kGpt =
    "[run]\nseed = 3\n[model]\nkind = \"gpt\"\nn_layer = 4\nn_head = 4\nn_embd = 32\nblock_size = 16\n"
    "vocab_size = 64\n[data]\nkind = \"synthetic\"\n[train]\nbatch_size = 2\nmax_steps = 2\n";

// The message of the UserError `f` throws (checked: exit code 2, one line); fails the test when
// it throws none.
inline std::string user_error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const dtrain::UserError& e) {
    CHECK(e.exit_code() == 2);
    const std::string m = e.what();
    CHECK_MESSAGE(m.find('\n') == std::string::npos, m);
    return m;
  }
  FAIL("expected a UserError");
  return "";
}

inline bool has(const std::string& m, const std::string& part) { return m.find(part) != std::string::npos; }

}  // namespace recipe_fixture
