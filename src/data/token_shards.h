#pragma once
// Token shards in llm.c's format: a header of 256 little-endian int32 (magic 20240520,
// version 1, token count, rest 0) followed by the tokens as uint16 (llm.c's "gpt-2" shards);
// llm.c's "llama-3" shards (magic 20240801, version 7, uint32 tokens) hold vocabularies beyond
// 65536. Both are read; `data tokenize` writes the first when every id fits 16 bits (a
// vocabulary of at most 65536 ids), else the second. A TokenLoader samples
// contiguous windows of T+1 tokens (inputs = first T, targets = last T) per rank,
// deterministically from (seed, rank, batch index, row), with a saveable position.
#include <cstdint>
#include <string>
#include <vector>

namespace dtrain {

constexpr int32_t kTokenShardMagic = 20240520;
constexpr int32_t kTokenShardVersion = 1;
constexpr int32_t kTokenShardMagicU32 = 20240801;  // llm.c's write_datafile(..., "llama-3")
constexpr int32_t kTokenShardVersionU32 = 7;

// One shard's tokens as its file stores them: u16, or u32 for a llama-3 shard (wide).
struct TokenShard {
  std::vector<uint16_t> u16;
  std::vector<uint32_t> u32;
  bool wide = false;
  size_t size() const { return wide ? u32.size() : u16.size(); }
};

// Writes path (RuntimeFault on I/O failure): uint16 tokens as a "gpt-2" shard, uint32 tokens
// as a "llama-3" shard.
void write_token_shard(const std::string& path, const std::vector<uint16_t>& tokens);
void write_token_shard(const std::string& path, const uint16_t* tokens, size_t n);
void write_token_shard(const std::string& path, const uint32_t* tokens, size_t n);
// Reads and validates a shard: UserError naming the file and the value for a wrong magic,
// version, a size that does not match the header, or a token id >= vocab_size.
TokenShard read_token_shard(const std::string& path, int vocab_size);

class TokenLoader {
 public:
  // files: shards (validated on load, all held in memory); windows never cross shards.
  // UserError when no shard holds at least T+1 tokens.
  TokenLoader(std::vector<std::string> files, int vocab_size, int batch, int seq_len, int rank,
              int world_size, uint64_t seed);

  // Random windows: row i of batch `position()` on this rank starts at a uniform valid offset
  // drawn from Rng(seed, stream_id(rank, position, i)). Fills inputs/targets [B*T].
  void next(int32_t* inputs, int32_t* targets);
  uint64_t position() const { return pos_; }  // batches drawn so far (checkpointed)
  void set_position(uint64_t p) { pos_ = p; }

  // Evaluation: non-overlapping windows in file order, batch k of this rank covers windows
  // (k*world + rank)*B ... ; eval_batches() is how many full batches every rank has.
  int64_t eval_batches() const;
  void eval_batch(int64_t k, int32_t* inputs, int32_t* targets) const;

  int64_t total_tokens() const;

 private:
  void window(size_t shard, int64_t start, int32_t* in, int32_t* tg) const;
  std::vector<std::string> files_;
  std::vector<TokenShard> shards_;
  std::vector<int64_t> start_prefix_;  // cumulative valid start positions per shard
  int B_, T_, rank_, world_;
  uint64_t seed_, pos_ = 0;
};

// `dtrain data tokenize INPUT... --out DIR --tokenizer byte|gpt2|TOKENIZER_JSON [--vocab DIR]
// --val-fraction F --shard-tokens N --workers W`: each input file is one document, encoded
// without special tokens (Hugging Face's add_special_tokens=False) and then marked: a
// tokenizer.json whose post-processor adds tokens (Llama 3's <|begin_of_text|>) puts them around
// it, as encode(document) with add_special_tokens=True does; otherwise <|endoftext|> precedes it
// when the vocabulary has one (GPT-2, as llm.c). Files are read in pieces of a few MB cut where
// the pre-tokenizer cuts anyway (after a lone newline between two non-space characters; GPT-2's
// and Llama 3's patterns), so the ids equal one encode() of the whole text, and W threads encode
// the pieces (a tokenizer.json whose pre-tokenizer may not cut there is encoded a whole file at a
// time). The first val_fraction of the tokens go to OUT/val_000000.bin, the rest to
// OUT/train_000000.bin, train_000001.bin, ... of at most N tokens each (llm.c's fineweb uses
// 10^8), uint16 or, beyond 65536 ids, uint32; the tokenizer's files are copied beside them and
// OUT/manifest.json describes them. Returns 0.
class Tokenizer;
namespace data {
struct TokenizeSpec {
  std::vector<std::string> inputs;
  std::string out, tokenizer = "byte", vocab;
  double val_fraction = 0.1;
  int64_t shard_tokens = 100000000;
  int workers = 0;  // 0: every core
};
void tokenize_files(const TokenizeSpec& args);

// The tokenizer's files, copied into `out` under Hugging Face's names (the trainer copies them
// into every checkpoint, `dtrain sample` finds them): GPT-2's pair, or tokenizer.json with the
// tokenizer_config.json beside it (one naming PreTrainedTokenizerFast when there is none);
// tokenizer files of an earlier run that this tokenizer does not use are removed. Returns the
// names written. `who` starts the log and error lines ("data tokenize").
struct CopyTokenizer {
  std::string tokenizer, vocab, out, who;
};
std::vector<std::string> copy_tokenizer_files(const CopyTokenizer& a, const Tokenizer& tok);
}  // namespace data

}  // namespace dtrain
