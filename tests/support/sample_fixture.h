#pragma once
// `dtrain sample`'s greedy text, as the interop tests compare it with transformers'.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <string>

#include "run_cmd.h"

// `bin sample` greedy text (prompt included) from checkpoint `ck`, as hex bytes; the text
// itself into *text.
inline std::string greedy_hex(const std::string& bin, const std::string& ck, const std::string& prompt, int tokens,
                              std::string* text = nullptr) {
  auto sm = run_cmd(bin + " sample --checkpoint " + ck + " --prompt '" + prompt + "' --tokens " +
                    std::to_string(tokens) + " --temperature 0");
  REQUIRE_MESSAGE(sm.code == 0, sm.all());
  std::string t = sm.out;
  REQUIRE(!t.empty());
  t.pop_back();  // the newline after the text
  std::string hex;
  for (unsigned char c : t) hex += fmt::format("{:02x}", c);
  if (text) *text = t;
  return hex;
}
