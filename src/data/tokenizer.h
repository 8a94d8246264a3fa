#pragma once
// Tokenizers: byte-level (ids 0..255, no special tokens) and GPT-2 byte-level BPE loaded
// from OpenAI's encoder.json + vocab.bpe. GPT-2's pre-tokenizer pattern runs in PCRE2 (JIT)
// with Unicode properties (Debian's PCRE2 10.42: Unicode 14.0); any bytes encode: a byte
// outside a well-formed UTF-8 sequence is one symbol that is neither letter, number nor space.
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::string name() const = 0;                 // "byte" | "gpt2"
  virtual int vocab_size() const = 0;                   // 256 | 50257
  virtual int eot() const = 0;                          // end-of-text id, -1 when none
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;  // UserError on bad id
};

std::unique_ptr<Tokenizer> make_byte_tokenizer();
// GPT-2's two vocabulary files in `dir`: OpenAI's encoder.json + vocab.bpe, else Hugging
// Face's vocab.json + merges.txt (the same contents); empty paths when neither pair is there.
struct Gpt2VocabFiles {
  std::string encoder, merges;
  bool found() const { return !encoder.empty(); }
};
Gpt2VocabFiles find_gpt2_vocab(const std::string& dir);
// dir holds one of those pairs; UserError naming the file when missing/malformed.
std::unique_ptr<Tokenizer> load_gpt2_tokenizer(const std::string& dir);
// kind "byte" | "gpt2" (vocab_dir required for gpt2).
std::unique_ptr<Tokenizer> make_tokenizer(const std::string& kind, const std::string& vocab_dir);

// GPT-2 pre-tokenization (exposed for tests): the pieces of `text` in order.
std::vector<std::string> gpt2_pretokenize(std::string_view text);

}  // namespace dtrain
