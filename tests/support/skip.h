#pragma once
// Skipping a test that cannot run here (no CUDA device, a tool or data set not installed):
//   SKIP_TEST("no " << python);   // prints "SKIPPED: no ..." and returns from the test case
//   GPU_OR_SKIP();                 // SKIP_TEST("no CUDA device") without a CUDA device
// A skip is reported as such, never as a pass: the test binary (tests/main.cpp) exits
// with kSkipExitCode when every test case it ran skipped, and ctest (SKIP_RETURN_CODE)
// lists the test under "The following tests did not run". A skip must come before the test
// case's first assertion: a test case that skips after checking anything fails (split it:
// the part that runs everywhere in a test case of its own).
#include <doctest/doctest.h>

#include "backend/backend.h"

namespace dtrain::testing {
inline constexpr int kSkipExitCode = 77;  // ctest's SKIP_RETURN_CODE (CMakeLists.txt)
void mark_skipped();                      // tests/main.cpp
}  // namespace dtrain::testing

#define SKIP_TEST(why)                     \
  do {                                     \
    MESSAGE("SKIPPED: " << why);           \
    ::dtrain::testing::mark_skipped();     \
    return;                                \
  } while (0)

#define GPU_OR_SKIP()                                            \
  do {                                                           \
    if (::dtrain::cuda_device_count() == 0) SKIP_TEST("no CUDA device"); \
  } while (0)
