#pragma once
// `dtrain data sft FILE.jsonl... --tokenizer T --template NAME --out DIR [--split NAME]
// [--skip-bad]` (docs/finetune.md): JSONL rows of {"prompt": ..., "completion": ...} or
// {"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]} rendered with a
// built-in chat template (chat_template.h) and written as SFT shards (sft_shards.h):
// OUT/<split>_000000.bin + .sft, ..., the tokenizer's files, tokenizer_config.json with the
// template's Jinja as "chat_template", and manifest.json.
#include <cstdint>
#include <string>
#include <vector>

#include "data/chat_template.h"

namespace dtrain {
class Tokenizer;
}

namespace dtrain::data {

struct SftSpec {
  std::vector<std::string> inputs;  // JSONL files, read in order
  std::string out, tokenizer = "byte", vocab, template_name, split = "train";
  bool skip_bad = false;  // count and skip bad rows instead of exiting 2 on the first
  int64_t shard_tokens = 100000000;
};

// One JSONL line read into messages ({"prompt", "completion"}: a user and an assistant message).
// Returns why the row is bad ("" when it is good): not UTF-8, not JSON, not an object, missing or
// mistyped keys, an unknown role, an empty completion, or messages that cannot be trained on
// (sft::validate_messages).
std::string parse_sft_row(const std::string& line, std::vector<sft::Message>& messages);

// The end-of-text token the plain template writes: tokenizer_config.json's eos_token beside a
// tokenizer.json (as transformers reads it), else the tokenizer's <|endoftext|> /
// <|end_of_text|>; "" when none.
std::string sft_eos(const std::string& tokenizer_arg, const Tokenizer& tok);

// Runs the command. A bad row is a UserError "data sft: FILE:LINE: why" unless skip_bad.
void sft_convert(const SftSpec& spec);

}  // namespace dtrain::data
