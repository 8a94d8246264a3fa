// The test binary's main: doctest's, plus the skip bookkeeping of tests/support/skip.h. A test case
// that called SKIP_TEST() counts as skipped when it ran no assertion; the exit code is
// kSkipExitCode when every test case that ran was skipped (ctest runs one test case per
// process, so a skipped case shows as skipped there), and 1 when a test case skipped after
// running assertions (its checks and its skip would both be hidden).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <string>

#include "skip.h"

namespace {

struct SkipCounts {
  int started = 0, skipped = 0, misplaced = 0;
  bool current = false;  // the running test case called mark_skipped()
  std::string name;
};
SkipCounts& counts() {
  static SkipCounts c;
  return c;
}

struct SkipListener : doctest::IReporter {
  explicit SkipListener(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats&) override {}
  void test_case_start(const doctest::TestCaseData& tc) override {
    counts().started++;
    counts().current = false;
    counts().name = tc.m_name;
  }
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats& st) override {
    if (!counts().current) return;
    if (st.numAssertsCurrentTest == 0 && st.failure_flags == 0) {
      counts().skipped++;
      return;
    }
    counts().misplaced++;
    std::fprintf(stderr,
                 "error: test case \"%s\" skipped after %d assertions: a skip must come before the "
                 "first check (move the checks that run everywhere into a test case of their own)\n",
                 counts().name.c_str(), st.numAssertsCurrentTest);
  }
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};
REGISTER_LISTENER("dtrain_skips", 1, SkipListener);

}  // namespace

void dtrain::testing::mark_skipped() { counts().current = true; }

int main(int argc, char** argv) {
  doctest::Context ctx(argc, argv);
  const int rc = ctx.run();
  if (ctx.shouldExit() || rc != 0) return rc;
  const SkipCounts& c = counts();
  if (c.misplaced > 0) return 1;
  if (c.started > 0 && c.skipped == c.started) return dtrain::testing::kSkipExitCode;
  return 0;
}
