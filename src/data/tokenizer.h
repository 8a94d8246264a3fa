#pragma once
// Tokenizers: byte-level (ids 0..255, no special tokens), GPT-2 byte-level BPE loaded from
// OpenAI's encoder.json + vocab.bpe, and Hugging Face's byte-level BPE tokenizer.json (GPT-2,
// Llama 3, SmolLM, ...; hf_tokenizer.cpp). Pre-tokenizer patterns run in PCRE2 (JIT) with Unicode
// properties (Debian's PCRE2 10.42: Unicode 14.0); any bytes encode: a byte outside a
// well-formed UTF-8 sequence is one symbol that is neither letter, number nor space.
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::string name() const = 0;                 // "byte" | "gpt2" | "tokenizer.json"
  virtual int vocab_size() const = 0;                   // 256 | 50257 | max id + 1
  virtual int eot() const = 0;                          // end-of-text id, -1 when none
  // The ids of `text` alone: Hugging Face's encode(text, add_special_tokens=False). Added tokens
  // of a tokenizer.json written in the text are matched as tokenizers matches them.
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // The text of `ids`, special tokens included (skip_special_tokens=False); UserError on an id
  // the tokenizer does not have.
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
  // The ids Hugging Face's encode(text) (add_special_tokens=True) adds around one text: a
  // tokenizer.json's post-processor template (Llama 3: <|begin_of_text|> before it); none else.
  struct Template {
    std::vector<int32_t> before, after;
    bool empty() const { return before.empty() && after.empty(); }
  };
  virtual Template special_template() const { return {}; }
  // The id of the added (special) token whose text is exactly `content` (a tokenizer.json's
  // added_tokens; GPT-2's <|endoftext|>), -1 when the tokenizer has no such token.
  virtual int32_t added_token_id(std::string_view /*content*/) const { return -1; }
  // Whether a text cut right after a lone '\n' between two non-space ASCII characters encodes,
  // piece by piece, to the ids of the whole (true of GPT-2's pattern and Llama 3's; `data
  // tokenize` cuts big files there so that threads share them).
  virtual bool cuts_after_lone_newline() const { return true; }
  // Another tokenizer of the same vocabulary with a cache of its own (one per thread).
  virtual std::unique_ptr<Tokenizer> clone() const = 0;
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

// `path` itself when it is a file, path/tokenizer.json when it is a directory holding one, ""
// otherwise.
std::string find_hf_tokenizer(const std::string& path);
// Hugging Face's tokenizer.json (a file, or a directory holding one) of a byte-level BPE: its
// added tokens, pre-tokenizer (Split with a pattern, ByteLevel, Digits, a Sequence of them), BPE
// model (merges as "a b" or ["a", "b"], ignore_merges), post-processor template and ByteLevel
// decoder. UserError naming the file and what is wrong or unsupported (another model type, a
// normalizer, another pre-tokenizer or post-processor, malformed JSON).
std::unique_ptr<Tokenizer> load_hf_tokenizer(const std::string& path);

// kind "byte" | "gpt2" (vocab_dir required for gpt2) | the path of a tokenizer.json or of a
// directory holding one.
std::unique_ptr<Tokenizer> make_tokenizer(const std::string& kind, const std::string& vocab_dir);

// The tokenizer files in `dir`, each with the name a Hugging Face model directory gives it:
// GPT-2's pair as vocab.json + merges.txt, tokenizer.json, tokenizer_config.json. What a
// checkpoint copies from the token shards (or an imported model) so that
// AutoTokenizer.from_pretrained(<checkpoint>) and `dtrain sample` find them.
struct TokenizerFile {
  std::string src, name;
};
std::vector<TokenizerFile> tokenizer_files(const std::string& dir);

// GPT-2 pre-tokenization (exposed for tests): the pieces of `text` in order.
std::vector<std::string> gpt2_pretokenize(std::string_view text);

}  // namespace dtrain
