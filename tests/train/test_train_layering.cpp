// The train layer's inner order: a Task works on a Runtime (session/runtime.h), and the
// Session (session/session.h, a Runtime with the task, optimizer and schedule) is built on
// top of the tasks. No task source may reach session.h through its includes, or the two
// depend on each other again.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <vector>

namespace {

namespace stdfs = std::filesystem;
const stdfs::path kSrc = stdfs::path(DTRAIN_SOURCE_DIR) / "src";

// The project headers `file` includes (paths relative to src/), and theirs, transitively;
// `via` receives, for every header reached, the file that included it first.
std::set<std::string> reached(const std::string& file, std::map<std::string, std::string>& via) {
  static const std::regex inc(R"re(^\s*#\s*include\s*"([^"]+)")re");
  std::set<std::string> seen;
  std::vector<std::string> todo{file};
  while (!todo.empty()) {
    const std::string f = todo.back();
    todo.pop_back();
    std::ifstream in(kSrc / f);
    std::string line;
    std::smatch m;
    while (std::getline(in, line))
      if (std::regex_search(line, m, inc) && stdfs::exists(kSrc / m[1].str()) && seen.insert(m[1].str()).second) {
        via[m[1].str()] = f;
        todo.push_back(m[1].str());
      }
  }
  return seen;
}

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("no task source reaches session/session.h through its includes") {
    std::vector<std::string> tasks;
    for (const auto& e : stdfs::directory_iterator(kSrc / "train")) {
      const std::string n = e.path().filename().string();
      if (n.rfind("task", 0) == 0 || n.rfind("image_task", 0) == 0) tasks.push_back("train/" + n);
    }
    REQUIRE_MESSAGE(tasks.size() >= 5, "the task sources under " << (kSrc / "train").string());
    for (const std::string& t : tasks) {
      std::map<std::string, std::string> via;
      const auto headers = reached(t, via);
      std::string chain = "session/session.h";
      if (headers.count(chain))
        for (std::string h = chain; h != t; h = via[h]) chain = via[h] + " -> " + chain;
      CHECK_MESSAGE(headers.count("session/session.h") == 0, "an include chain: " << chain);
      // nor names the Session (a forward declaration would hide the same dependency)
      std::ifstream in(kSrc / t);
      static const std::regex session_type(R"(\bSession\b)");
      std::string line;
      for (int no = 1; std::getline(in, line); ++no) {
        const std::string code = line.substr(0, line.find("//"));
        CHECK_MESSAGE(!std::regex_search(code, session_type), t << ":" << no << " names the Session: " << line);
      }
    }
  }
}
