#pragma once
// A Hugging Face tokenizer.json read and checked (hf_tokenizer_json.cpp) into what dtrain's
// byte-level BPE (hf_tokenizer.cpp) runs. What `tokenizers` 0.20 does with each part:
//   added_tokens   split out of the text before anything else, non-normalized ones first, each
//                  pass leftmost-longest (Aho-Corasick); ids assigned as tokenizers assigns them
//   normalizer     none (null, or an empty Sequence)
//   pre_tokenizer  Split (Regex or String pattern, every behavior, invert), Digits, ByteLevel
//                  (add_prefix_space, use_regex: GPT-2's pattern), a Sequence of them; ByteLevel
//                  once, last
//   model          BPE over byte-level symbols: vocab, merges ("a b" or ["a", "b"]),
//                  ignore_merges, unk_token / fuse_unk; no dropout, prefix/suffix or byte_fallback
//   post_processor null, ByteLevel (offsets only), TemplateProcessing (its single-text
//                  template), a Sequence of them
//   decoder        ByteLevel
// truncation and padding are ignored, as transformers' tokenizer(text) ignores them.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace dtrain::hf {

enum class Behavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

// One pre-tokenizer step: a split by a pattern, or the ByteLevel step (always the last).
struct PreStep {
  bool byte_level = false, digits = false;
  std::string pattern;  // PCRE2 syntax (or the literal text when `literal`)
  bool literal = false, invert = false;
  Behavior behavior = Behavior::Isolated;
  bool add_prefix_space = false, use_regex = true;  // ByteLevel
  std::string source;                               // the pattern as tokenizer.json gives it
};

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool single_word = false, lstrip = false, rstrip = false, normalized = true, special = false;
};

struct Spec {
  std::string file;
  std::vector<std::pair<std::string, int32_t>> vocab;  // byte-level symbols -> id
  std::vector<std::pair<int32_t, int32_t>> merges;     // (left id, right id) in rank order
  std::vector<int32_t> merged;                         // merges[r]'s result id
  bool ignore_merges = false, fuse_unk = false;
  std::string unk_token;          // "" = none
  std::vector<AddedToken> added;  // as listed, ids as tokenizers gives them
  std::vector<PreStep> pre;
  std::vector<int32_t> before, after;  // the post-processor's template
};

// UserError "<file>: <where>: <what>" for anything malformed or unsupported.
Spec read_tokenizer_json(const std::string& file);

}  // namespace dtrain::hf
