#pragma once
// Pre-tokenizer patterns in PCRE2 (UTF + UCP, JIT): the matches of a pattern over any bytes, in
// the order and with the empty-match rule of the onig crate's find_iter, which Hugging Face's
// `tokenizers` splits with; and the translation of Oniguruma's syntax (tokenizer.json's patterns)
// into PCRE2's. A compiled pattern is read-only: threads share it, each call has its own match
// data.
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dtrain {

// GPT-2's pattern (OpenAI's encoder.py; tiktoken's "gpt2" and the ByteLevel pre-tokenizer of
// `tokenizers` split the same way). \s is written \p{White_Space}, what Python's `regex`, Rust's
// `regex` (tiktoken) and Oniguruma mean by it; PCRE2's own UCP \s also takes U+180E MONGOLIAN
// VOWEL SEPARATOR, a format character since Unicode 6.3.
extern const char* const kGpt2Pattern;

class PcreRegex {
 public:
  // `pattern` in PCRE2's syntax, compiled with UTF, UCP and MULTILINE (^ and $ at line ends, as
  // Oniguruma's Ruby syntax has them); literal: matched as plain text. Throws
  // std::invalid_argument with PCRE2's message and the offset when PCRE2 rejects it.
  explicit PcreRegex(const std::string& pattern, bool literal = false);
  ~PcreRegex();
  PcreRegex(const PcreRegex&) = delete;
  PcreRegex& operator=(const PcreRegex&) = delete;

  // The matches [begin, end) of `text`, left to right: each search starts where the last match
  // ended; an empty match right after a match is skipped, and after an empty match the search
  // moves on by one character (the onig crate's FindMatches). A byte outside a well-formed UTF-8
  // sequence is matched as one \x01 (neither letter, number nor space).
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view text) const;
  // Whether the pattern matches text (valid UTF-8) starting exactly at `at`.
  bool matches_at(std::string_view text, size_t at) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> p_;
};

// A pattern in Oniguruma's syntax (what `tokenizers` compiles tokenizer.json's patterns with) in
// PCRE2's: \s \S -> White_Space, \d \D -> Nd, \w -> [\p{L}\p{M}\p{Nd}\p{Pc}] (Oniguruma's word
// characters), \h \H -> hex digits, \uHHHH -> \x{HHHH}; the rest is the syntax both share.
// Throws std::invalid_argument naming what has no PCRE2 form here (nested classes, &&, \W or \H
// inside a class).
std::string oniguruma_to_pcre2(const std::string& pattern);

}  // namespace dtrain
