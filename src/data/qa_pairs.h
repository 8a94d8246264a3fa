#pragma once
// `dtrain data qa FILE... --out DIR [--val-every N]` (docs/finetune.md): question/answer pairs
// from fortune files (entries separated by lines holding "%", as Debian's fortunes package
// ships them), for fine-tuning. An entry with a line starting "Q:" and one starting "A:" (in
// either order; the lines after a tag, up to the next tag, continue it; text before the first
// tag, such as a title, is left out) is one pair, and an entry of several exchanges (Q, A, Q, A)
// gives each; the parts' lines are trimmed and joined with spaces. Pairs repeated (the same
// question and answer) are kept once. Every N-th pair goes to DIR/val.jsonl, the others to
// DIR/train.jsonl, one {"prompt": Q, "completion": A} row each: the input of `dtrain data sft`.
// With --template (and --tokenizer, --vocab as data sft takes them) it then runs `data sft` on
// both into DIR itself: splits train and val, ready to train on.
#include <cstdint>
#include <string>
#include <vector>

namespace dtrain::data {

struct QaPair {
  std::string question, answer;
};

// The pairs of one fortune file's text, in order.
std::vector<QaPair> qa_pairs(const std::string& text);

struct QaSpec {
  std::vector<std::string> inputs;
  std::string out;
  int64_t val_every = 10;
  std::string tokenizer = "byte", vocab, template_name;  // template_name "": JSONL only
};
// Runs the command: UserError for an unreadable input or no pair at all.
void write_qa_pairs(const QaSpec& spec);

}  // namespace dtrain::data
