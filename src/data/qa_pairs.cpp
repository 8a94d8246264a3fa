#include "data/qa_pairs.h"

#include <fmt/format.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/error.h"
#include "core/fsutil.h"
#include "core/log.h"
#include "data/sft.h"
#include "data/utf8.h"

namespace dtrain::data {

namespace {

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

// An entry's pairs: a "Q:" and an "A:" line in either order make one; a tag that would repeat one
// of a complete pair starts the next (an entry of several exchanges); a part without its other
// half is left out.
void entry_pairs(const std::vector<std::string>& lines, std::vector<QaPair>& out) {
  QaPair p;
  std::string* part = nullptr;
  bool q = false, a = false;
  auto flush = [&] {
    if (q && a && !p.question.empty() && !p.answer.empty()) out.push_back(p);
    p = QaPair{};
    q = a = false;
  };
  for (const std::string& line : lines) {
    const bool tq = line.rfind("Q:", 0) == 0, ta = line.rfind("A:", 0) == 0;
    if ((tq && q) || (ta && a)) flush();
    if (tq || ta) {
      part = tq ? &p.question : &p.answer;
      (tq ? q : a) = true;
      *part = trim(line.substr(2));
    } else if (const std::string t = trim(line); part && !t.empty()) {
      *part += part->empty() ? t : " " + t;
    }
  }
  flush();
}

}  // namespace

std::vector<QaPair> qa_pairs(const std::string& text) {
  std::vector<QaPair> out;
  std::vector<std::string> entry;
  std::istringstream in(text);
  std::string line;
  auto flush = [&] {
    entry_pairs(entry, out);
    entry.clear();
  };
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line == "%") flush();
    else entry.push_back(line);
  }
  flush();
  return out;
}

void write_qa_pairs(const QaSpec& a) {
  std::vector<QaPair> all;
  std::set<std::pair<std::string, std::string>> seen;
  for (const std::string& f : a.inputs) {
    std::error_code ec;
    if (!std::filesystem::is_regular_file(f, ec)) user_error("data qa: {}: not a readable file", f);
    const std::string text = fs::read_file(f);
    if (utf8::first_invalid(text) != text.size()) user_error("data qa: {}: not UTF-8 (Debian's fortunes ship .u8 files that are)", f);
    for (QaPair& p : qa_pairs(text))
      if (seen.insert({p.question, p.answer}).second) all.push_back(std::move(p));
  }
  if (all.empty()) user_error("data qa: no question/answer pair (an entry with a \"Q:\" line and an \"A:\" line) in the inputs");
  std::filesystem::create_directories(a.out);
  std::string train, val;
  int64_t ntrain = 0, nval = 0;
  for (size_t i = 0; i < all.size(); ++i) {
    const std::string row = nlohmann::json{{"prompt", all[i].question}, {"completion", all[i].answer}}.dump() + "\n";
    const bool held_out = a.val_every > 0 && int64_t(i % size_t(a.val_every)) == a.val_every - 1;
    (held_out ? val : train) += row;
    ++(held_out ? nval : ntrain);
  }
  fs::write_file(a.out + "/train.jsonl", train);
  fs::write_file(a.out + "/val.jsonl", val);
  log::console(fmt::format("data qa: {} pairs from {} file(s): {} in {}/train.jsonl, {} in {}/val.jsonl", all.size(),
                           a.inputs.size(), ntrain, a.out, nval, a.out));
  if (a.template_name.empty()) return;
  for (const char* split : {"train", "val"}) {
    if (std::string(split) == "val" && nval == 0) continue;
    SftSpec s;
    s.inputs = {a.out + "/" + split + ".jsonl"};
    s.out = a.out;
    s.tokenizer = a.tokenizer;
    s.vocab = a.vocab;
    s.template_name = a.template_name;
    s.split = split;
    sft_convert(s);
  }
}

}  // namespace dtrain::data
