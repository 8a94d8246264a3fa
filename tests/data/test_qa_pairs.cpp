// `dtrain data qa` (data/qa_pairs.h): question/answer pairs from fortune files, for fine-tuning.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "process_work_dir.h"
#include "run_cmd.h"
#include "core/fsutil.h"
#include "data/qa_pairs.h"

using namespace dtrain;

TEST_CASE("data qa: entries with a Q: and an A: line become pairs - in either order - continuation lines joined") {
  const std::string text =
      "FORTUNE PROVIDES QUESTIONS FOR THE GREAT ANSWERS: #15\n"
      "A:\tThe Royal Canadian Mounted Police.\n"
      "Q:\tWhat was the greatest achievement\n"
      "\tin taxidermy?\n"
      "%\n"
      "Q: Why did the chicken\r\n"
      "   cross the road?\r\n"
      "A: To get to the other side.\r\n"
      "%\n"
      "A proverb without a question.\n"
      "%\n"
      "Q: A question without an answer?\n"
      "%\n"
      "Q:\n"
      "A: an empty question\n"
      "%\n"
      "Q: Did he pick the dog up by the ears?\n"
      "A: No.\n"
      "Q: What was he doing with the dog's ears?\n"
      "A: Picking them up in the air.\n"
      "Q: A last question without its answer?\n";
  const auto p = data::qa_pairs(text);
  REQUIRE(p.size() == 4);
  CHECK(p[2].question == "Did he pick the dog up by the ears?");
  CHECK(p[2].answer == "No.");
  CHECK(p[3].question == "What was he doing with the dog's ears?");
  CHECK(p[3].answer == "Picking them up in the air.");
  CHECK(p[0].question == "What was the greatest achievement in taxidermy?");
  CHECK(p[0].answer == "The Royal Canadian Mounted Police.");
  CHECK(p[1].question == "Why did the chicken cross the road?");
  CHECK(p[1].answer == "To get to the other side.");
}

TEST_CASE("data qa: writes train.jsonl and val.jsonl that data sft reads - no pair or a bad file exits 2") {
  const std::string work = process_work_dir("test_qa_pairs");
  std::filesystem::create_directories(work);
  std::string text;
  for (int i = 0; i < 25; ++i) text += "Q: question " + std::to_string(i) + "?\nA: answer " + std::to_string(i) + "\n%\n";
  text += "Q: question 3?\nA: answer 3\n";  // a repeated pair is kept once
  fs::write_file(work + "/f.u8", text);
  const std::string bin = dtrain_bin();
  auto r = run_cmd(bin + " data qa " + work + "/f.u8 --out " + work + "/qa --val-every 5");
  REQUIRE_MESSAGE(r.code == 0, r.all());
  CHECK(r.all().find("25 pairs from 1 file(s): 20 in") != std::string::npos);
  std::ifstream v(work + "/qa/val.jsonl");
  std::string line;
  int n = 0;
  while (std::getline(v, line)) {
    const auto j = nlohmann::json::parse(line);
    CHECK(j.at("prompt") == "question " + std::to_string(5 * n + 4) + "?");
    ++n;
  }
  CHECK(n == 5);
  r = run_cmd(bin + " data sft " + work + "/qa/train.jsonl --tokenizer byte --template plain --out " + work + "/shards");
  CHECK_MESSAGE(r.code == 0, r.all());
  fs::write_file(work + "/none.u8", "just a fortune\n%\nanother\n");
  r = run_cmd(bin + " data qa " + work + "/none.u8 --out " + work + "/qa2");
  CHECK(r.code == 2);
  CHECK(r.all().find("no question/answer pair") != std::string::npos);
  fs::write_file(work + "/latin1", std::string("Q: caf\xe9?\nA: yes\n"));
  r = run_cmd(bin + " data qa " + work + "/latin1 --out " + work + "/qa3");
  CHECK(r.code == 2);
  CHECK(r.all().find("not UTF-8") != std::string::npos);
  r = run_cmd(bin + " data qa " + work + "/missing --out " + work + "/qa4");
  CHECK(r.code == 2);
}
