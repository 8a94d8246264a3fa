#pragma once
// Runs a shell command for integration tests: exit code, stdout and stderr separately.
//   CmdResult r = run_dtrain("train missing.toml");
//   CHECK(r.code == 2);
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

struct CmdResult {
  int code = -1;    // exit status; 128 + signal when killed by a signal
  std::string out;  // stdout
  std::string err;  // stderr
  std::string all() const { return out + err; }
  int err_lines() const {
    int n = 0;
    for (char c : err) n += c == '\n';
    return n;
  }
};

// Single-quotes `s` for /bin/sh.
inline std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

inline CmdResult run_cmd(const std::string& cmd) {
  CmdResult r;
  char tmpl[] = "/tmp/dtrain_cmd_err_XXXXXX";
  int fd = mkstemp(tmpl);
  if (fd < 0) return r;
  close(fd);
  std::string full = "( " + cmd + " ) 2>" + shell_quote(tmpl) + " </dev/null";
  FILE* p = popen(full.c_str(), "r");
  if (p) {
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
    int st = pclose(p);
    r.code = WIFEXITED(st) ? WEXITSTATUS(st) : WIFSIGNALED(st) ? 128 + WTERMSIG(st) : -1;
  }
  std::ifstream f(tmpl, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  r.err = ss.str();
  std::remove(tmpl);
  return r;
}

#ifdef DTRAIN_BIN
// The dtrain binary the tests run: $DTRAIN_TEST_BIN when set (a prebuilt pack on another machine,
// scripts/gpu_check.sh), else the one built beside the tests.
inline std::string dtrain_bin() {
  const char* e = std::getenv("DTRAIN_TEST_BIN");
  return e && *e ? std::string(e) : std::string(DTRAIN_BIN);
}
inline CmdResult run_dtrain(const std::string& args) { return run_cmd(shell_quote(dtrain_bin()) + " " + args); }
#endif
