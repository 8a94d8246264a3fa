// dtrain reproduce (a recipe's [expect] table: data preparation, training, verdict, report.md,
// charts) and dtrain report --plot (PNG/SVG charts read back with PIL).
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "obs/plot.h"
#include "obs/reproduce.h"
#include "config/config.h"
#include "run_cmd.h"
#include "test_util.h"

namespace stdfs = std::filesystem;

namespace {

const std::string kBin = dtrain_bin();
const std::string kWork = std::string(DTRAIN_BUILD_DIR) + "/test_reproduce";

// A tiny byte-level GPT whose data (two of dtrain's sources, tokenized) is made by its
// data.prepare command. Everything of `name` lives in WORK/<name>/ (ctest runs the cases as
// parallel processes): the recipe, data/ and runs/.
std::string dir(const std::string& name) { return kWork + "/" + name; }

std::string recipe(const std::string& name, const std::string& expect, const std::string& extra = "") {
  stdfs::remove_all(dir(name));
  stdfs::create_directories(dir(name));
  const std::string src = DTRAIN_SOURCE_DIR;
  const std::string data = dir(name) + "/data";
  std::ostringstream f;
  f << "[run]\nname = \"" << name << "\"\nout_dir = \"" << dir(name) << "/runs\"\nseed = 3\ndevice = \"cpu\"\nthreads = 1\n"
    << "[model]\nkind = \"gpt\"\nn_layer = 1\nn_head = 2\nn_embd = 32\nblock_size = 32\nvocab_size = 256\n"
    << "[data]\nkind = \"tokens\"\npath = \"" << data << "\"\nprepare = \"dtrain data tokenize " << src
    << "/src/session/step.cpp " << src << "/src/session/session.cpp --out " << data
    << " --tokenizer byte --val-fraction 0.2\"\n"
    << "[train]\nbatch_size = 4\nmax_steps = 12\n"
    << "[optim]\nname = \"adamw\"\nlr = 0.003\n"
    << "[eval]\nevery_steps = 4\nmax_batches = 2\n"
    << "[log]\nevery_steps = 2\ntensorboard = false\n"
    << "[checkpoint]\nevery_steps = 0\nkeep_last = 1\n"
    << "[expect]\n" << expect << extra;
  const std::string path = dir(name) + "/recipe.toml";
  std::ofstream(path) << f.str();
  return path;
}

std::string only_run_dir(const std::string& name) {
  for (auto& e : stdfs::directory_iterator(dir(name) + "/runs")) return e.path().string();
  return "";
}

std::vector<nlohmann::json> rows(const std::string& run, const std::string& kind) {
  std::vector<nlohmann::json> out;
  std::ifstream f(run + "/metrics.jsonl");
  std::string line;
  while (std::getline(f, line))
    if (!line.empty()) {
      auto j = nlohmann::json::parse(line);
      if (j["kind"] == kind) out.push_back(j);
    }
  return out;
}

std::string slurp(const std::string& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Each PNG: its size and how many distinct colours it has (a blank image has 1).
nlohmann::json png_facts(const std::string& dir, const std::vector<std::string>& names) {
  std::string list;
  for (auto& n : names) list += "\"" + dir + "/" + n + "\",";
  const std::string out = test_util::run_python(kWork, "import json\nfrom PIL import Image\nr={}\nfor p in [" + list +
                                                           "]:\n  im=Image.open(p).convert('RGB')\n"
                                                           "  r[p.split('/')[-1]]=[im.size[0],im.size[1],len(im.getcolors(1<<20))]\n"
                                                           "print(json.dumps(r))\n");
  return nlohmann::json::parse(out.substr(out.find('{')));
}

const std::vector<std::string> kCharts = {"loss_step.png", "loss_time.png", "eval_step.png", "eval_time.png",
                                          "throughput.png", "step_time.png", "lr.png"};

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("nice_ticks covers the range with 1-2-2.5-5 steps") {
    CHECK(dtrain::nice_ticks(0, 10, 5) == std::vector<double>{0, 2, 4, 6, 8, 10});
    const auto t = dtrain::nice_ticks(0.913, 0.947, 8);
    REQUIRE(t.size() >= 3);
    CHECK(t.front() >= 0.913 - 1e-12);
    CHECK(t.back() <= 0.947 + 1e-12);
    CHECK((t[1] - t[0]) == doctest::Approx(0.005));
    CHECK(dtrain::nice_ticks(1, 1).empty());
    CHECK(dtrain::nice_ticks(-3e-4, 1e-3, 6).size() >= 4);
  }
}

TEST_SUITE("unit") {
  // The README's results table and the recipes' [expect] tables cannot disagree: every row of
  // a recipe run as it is meets its expectation, and every recipe with one has a row.
  TEST_CASE("the README's results table agrees with the recipes' [expect] tables") {
    const std::string root = DTRAIN_SOURCE_DIR;
    std::ifstream f(root + "/README.md");
    std::string line;
    bool in_results = false;
    std::map<std::string, int> rows_of;
    while (std::getline(f, line)) {
      if (line.rfind("## ", 0) == 0) in_results = line.find("Results") != std::string::npos;
      if (!in_results || line.rfind("| `configs/", 0) != 0) continue;
      std::vector<std::string> cells;
      std::stringstream ss(line);
      std::string cell;
      while (std::getline(ss, cell, '|')) cells.push_back(cell);
      REQUIRE(cells.size() >= 4);
      const std::string recipe = cells[1].substr(cells[1].find('`') + 1, cells[1].find(".toml`") + 5 - cells[1].find('`') - 1);
      INFO(line);
      if (cells[1].find("--set") != std::string::npos) continue;  // a variant, not the recipe as it is
      const dtrain::Config cfg = dtrain::Config::load(root + "/" + recipe);
      dtrain::Expectation e;
      e.metric = cfg.s("expect.metric");
      e.target = cfg.f("expect.target");
      e.tolerance = cfg.f("expect.tolerance");
      REQUIRE_MESSAGE(!e.metric.empty(), recipe << " claims a result in the README but has no [expect] table");
      const std::string& res = cells[3];
      const size_t at = res.find_first_of("0123456789");
      REQUIRE(at != std::string::npos);
      double v = std::stod(res.substr(at));
      if (res.find('%', at) < res.find(' ', at + 1)) v /= 100;
      CHECK_MESSAGE(e.reached(v), recipe << ": the README says " << v << ", the recipe expects " << e.metric << " "
                                         << (e.lower_is_better() ? "<= " : ">= ") << e.target);
      // a time budget (expect.budget_s) holds for the training time the row reports ("m:ss")
      if (cfg.f("expect.budget_s") > 0) {
        REQUIRE(cells.size() >= 5);
        const std::string& t = cells[4];
        const size_t colon = t.find(':');
        REQUIRE_MESSAGE((colon != std::string::npos && colon > 0), recipe << ": no m:ss training time in the row");
        const size_t from = t.find_last_not_of("0123456789", colon - 1) + 1;
        const double s = std::stod(t.substr(from, colon - from)) * 60 + std::stod(t.substr(colon + 1, 2));
        CHECK_MESSAGE(s <= cfg.f("expect.budget_s"), recipe << ": the README says " << s
                                                            << " s of training, the budget is " << cfg.f("expect.budget_s"));
      }
      rows_of[recipe]++;
    }
    for (auto& entry : stdfs::directory_iterator(root + "/configs")) {
      if (entry.path().extension() != ".toml") continue;
      const dtrain::Config cfg = dtrain::Config::load(entry.path().string());
      if (cfg.s("expect.metric").empty()) continue;
      CHECK_MESSAGE(rows_of["configs/" + entry.path().filename().string()] > 0,
                    entry.path() << " has an [expect] table but no row in the README's results table");
    }
    CHECK(rows_of.size() >= 4);
  }

  // `dtrain reproduce` runs a recipe's data.prepare itself: every shipped line must be one dtrain
  // command it accepts (no shell syntax), and the splitter refuses what it cannot run.
  TEST_CASE("reproduce: every shipped recipe's data.prepare is one dtrain command") {
    const std::string root = DTRAIN_SOURCE_DIR;
    int n = 0;
    for (auto& entry : stdfs::recursive_directory_iterator(root + "/configs")) {
      if (entry.path().extension() != ".toml") continue;
      const dtrain::Config cfg = dtrain::Config::load(entry.path().string());
      const std::string line = cfg.s("data.prepare");
      if (line.empty()) continue;
      INFO(entry.path() << ": " << line);
      std::vector<std::string> words;
      CHECK_NOTHROW(words = dtrain::prepare_command_words(line, entry.path().string()));
      REQUIRE(words.size() >= 2);
      CHECK(words[0] == "data");
      ++n;
    }
    CHECK(n >= 4);
    const std::vector<std::string> want{"data", "shapes", "--out", "a b", "--count", "2"};
    CHECK(dtrain::prepare_command_words("dtrain data shapes --out 'a b' --count \"2\"", "r") == want);
    for (const char* bad : {"dtrain data tokenize $(ls x) --out y", "dtrain data x | tee y", "rm -rf x",
                            "dtrain data 'unterminated", ""})
      CHECK_THROWS_AS(dtrain::prepare_command_words(bad, "r"), dtrain::UserError);
  }
}

TEST_SUITE("integration") {
  TEST_CASE("reproduce prepares the data - trains and says reproduced - with report.md and charts") {
    const std::string cfg = recipe("repro_ok", "metric = \"eval_loss\"\ntarget = 7.0\nhardware = \"any CPU\"\n");
    auto r = run_cmd(kBin + " reproduce " + shell_quote(cfg));
    REQUIRE_MESSAGE(r.code == 0, r.all());
    CHECK_MESSAGE(r.all().find("reproduce: preparing the data: dtrain data tokenize") != std::string::npos, r.all());
    CHECK_MESSAGE(r.all().find("reproduced: eval_loss <= 7.0000 reached at step 4") != std::string::npos, r.all());
    CHECK(r.all().find("expected on: any CPU") != std::string::npos);
    CHECK(stdfs::exists(dir("repro_ok") + "/data/manifest.json"));
    const std::string run = only_run_dir("repro_ok");
    CHECK(stdfs::path(run).filename().string().rfind("repro_ok-reproduce-", 0) == 0);
    const auto evals = rows(run, "eval");
    REQUIRE(evals.size() == 3);  // steps 4, 8 and the final 12
    double last = -1;
    for (auto& e : evals) {  // every eval row has the run's wall time at its step (the time to target)
      REQUIRE(e.contains("elapsed_s"));
      CHECK(e["elapsed_s"].get<double>() > last);
      last = e["elapsed_s"].get<double>();
    }
    const std::string md = slurp(run + "/report.md");
    CHECK(md.find("**Reproduced**") != std::string::npos);
    CHECK(md.find("![eval_step.png](eval_step.png)") != std::string::npos);
    const auto facts = png_facts(run, kCharts);
    for (auto& c : kCharts) {
      INFO(c << ": " << facts.dump());
      REQUIRE(facts.contains(c));
      CHECK(facts[c][0] == 960);
      CHECK(facts[c][1] == 600);
      CHECK(facts[c][2].get<int>() > 20);  // axes, text, lines: far from blank
      CHECK(stdfs::file_size(run + "/" + c.substr(0, c.size() - 4) + ".svg") > 1000);
    }
    // a second reproduce reuses the prepared data and a reference curve gives the ratios
    stdfs::copy_file(run + "/metrics.jsonl", dir("repro_ok") + "/ref.jsonl", stdfs::copy_options::overwrite_existing);
    std::ofstream(cfg, std::ios::app) << "reference = \"" << dir("repro_ok") << "/ref.jsonl\"\n";
    auto r2 = run_cmd(kBin + " reproduce " + shell_quote(cfg) + " --set run.name=again");
    REQUIRE_MESSAGE(r2.code == 0, r2.all());
    CHECK(r2.all().find("preparing the data") == std::string::npos);
    CHECK_MESSAGE(r2.all().find("x the reference") != std::string::npos, r2.all());
    CHECK(r2.all().find("(reference ") != std::string::npos);
    CHECK(slurp(dir("repro_ok") + "/runs/again/report.md").find("reference run") != std::string::npos);
  }

  TEST_CASE("reproduce exits 1 with the reason when the target or the time budget is missed") {
    auto r = run_cmd(kBin + " reproduce " + shell_quote(recipe("repro_miss", "metric = \"eval_loss\"\ntarget = 0.01\n")));
    CHECK(r.code == 1);
    CHECK_MESSAGE(r.all().find("NOT reproduced: no evaluation reached eval_loss <= 0.0100 (best ") != std::string::npos,
                  r.all());
    CHECK(slurp(only_run_dir("repro_miss") + "/report.md").find("**Not reproduced**") != std::string::npos);
    auto b = run_cmd(kBin + " reproduce " +
                     shell_quote(recipe("repro_slow", "metric = \"eval_loss\"\ntarget = 7.0\nbudget_s = 0.000001\n")));
    CHECK(b.code == 1);
    CHECK_MESSAGE(b.all().find("NOT reproduced: the target was reached at step 4 after ") != std::string::npos, b.all());
    CHECK(b.all().find("over the budget of 0.0 s") != std::string::npos);
    auto s = run_cmd(kBin + " reproduce " +
                     shell_quote(recipe("repro_steps", "metric = \"eval_loss\"\ntarget = 7.0\nbudget_steps = 3\n")));
    CHECK(s.code == 1);
    CHECK_MESSAGE(s.all().find("by step 3") != std::string::npos, s.all());
  }

  TEST_CASE("reproduce refuses recipes it cannot judge - with one line and exit 2") {
    struct Case {
      std::string expect, extra, want;
    };
    const std::vector<Case> cases = {
        {"", "", "no [expect] table (expect.metric): nothing to reproduce"},
        {"metric = \"eval_accuracy\"\ntarget = 0.5\n", "", "expect.metric"},
        {"metric = \"eval_loss\"\n", "", "expect.target"},
        {"metric = \"eval_loss\"\ntarget = 1.0\nreference = \"/nonexistent/ref.jsonl\"\n", "",
         "expect.reference = \"/nonexistent/ref.jsonl\": no such file"},
        {"metric = \"eval_loss\"\ntarget = 1.0\n", "[data]\n", ""},  // a duplicate table: a TOML error
    };
    for (const Case& c : cases) {
      auto r = run_cmd(kBin + " reproduce " + shell_quote(recipe("repro_bad", c.expect, c.extra)));
      INFO(c.expect << " -> " << r.all());
      CHECK(r.code == 2);
      CHECK(r.err.find(c.want) != std::string::npos);
      CHECK_FALSE(stdfs::exists(dir("repro_bad") + "/runs"));
    }
    // data.prepare runs one dtrain command, never a shell line
    const std::string cfg = recipe("repro_shell", "metric = \"eval_loss\"\ntarget = 1.0\n");
    std::string text = slurp(cfg);
    const auto at = text.find("prepare = \"dtrain");
    text.insert(text.find('\n', at) - 1, "; touch /tmp/dtrain_pwned");
    std::ofstream(cfg) << text;
    auto r = run_cmd(kBin + " reproduce " + shell_quote(cfg));
    CHECK(r.code == 2);
    CHECK_MESSAGE(r.err.find("dtrain reproduce runs one dtrain command, without shell syntax (';')") != std::string::npos,
                  r.all());
    CHECK_FALSE(stdfs::exists("/tmp/dtrain_pwned"));
  }

  TEST_CASE("reproduce --list shows the recipes with an [expect] table and where they were measured") {
    const std::string with = recipe("list_with", "metric = \"eval_loss\"\ntarget = 2.5\ntolerance = 0.1\nbudget_s = 60\n"
                                                  "hardware = \"2-core test box\"\n");
    recipe("list_without", "");
    auto r = run_cmd(kBin + " reproduce --list " + shell_quote(with) + " " +
                     shell_quote(dir("list_without")));
    REQUIRE_MESSAGE(r.code == 0, r.all());
    CHECK_MESSAGE(r.out.find("expects eval_loss <= 2.5 (tolerance 0.1) within 60 s") != std::string::npos, r.all());
    CHECK(r.out.find("measured on: 2-core test box") != std::string::npos);
    CHECK(r.out.find("list_without") == std::string::npos);
    auto repo = run_cmd("cd " + shell_quote(DTRAIN_SOURCE_DIR) + " && " + kBin + " reproduce --list");
    REQUIRE_MESSAGE(repo.code == 0, repo.all());
    CHECK_MESSAGE(repo.out.find("configs/resnet20_fmnist.toml") != std::string::npos, repo.all());
  }

  TEST_CASE("report --plot overlays two runs and the reference dashed - PNG and SVG") {
    const std::string cfg = recipe("plot_a", "metric = \"eval_loss\"\ntarget = 7.0\n");
    auto a = run_cmd(kBin + " reproduce " + shell_quote(cfg) + " --set run.name=a");
    REQUIRE_MESSAGE(a.code == 0, a.all());
    auto b = run_cmd(kBin + " train " + shell_quote(cfg) + " --set run.name=b --set optim.lr=0.001");
    REQUIRE_MESSAGE(b.code == 0, b.all());
    const std::string runs = dir("plot_a") + "/runs", out = dir("plot_a") + "/charts_ab";
    auto p = run_cmd(kBin + " report " + runs + "/a " + runs + "/b --plot --plot-dir " + out + " --reference " + runs +
                     "/a/metrics.jsonl");
    REQUIRE_MESSAGE(p.code == 0, p.all());
    const auto facts = png_facts(out, kCharts);
    for (auto& c : kCharts) CHECK(facts[c][2].get<int>() > 20);
    const std::string svg = slurp(out + "/loss_step.svg");
    CHECK(svg.find("stroke-dasharray") != std::string::npos);  // the reference
    // a run without metrics: one line, exit 2
    stdfs::create_directories(runs + "/empty");
    auto e = run_cmd(kBin + " report " + runs + "/empty --plot");
    CHECK(e.code == 2);
    CHECK(e.err.find("metrics.jsonl: not found") != std::string::npos);
  }
}
