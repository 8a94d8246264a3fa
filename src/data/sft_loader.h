#pragma once
// SftLoader: fine-tuning batches from SFT shards (sft_shards.h: llm.c token shards, each with a
// .sft side file of documents and a loss mask), one document (one JSONL row) per example.
//
//  * A row of T tokens holds one example followed by padding, or, packed, several whole
//    examples one after another (best-fit decreasing, computed once over the split: the
//    examples longest first, each into the fullest row it fits, else a new row), then padding.
//  * targets[t] is the token after t in the same example when the side file's mask makes it a
//    target, else kIgnoreTarget (core/targets.h): prompts, an example's last token, padding.
//  * positions[t] is t's position in its example (0 at its first token; padding counts as a
//    document of its own), what the model's set_positions takes with documents = true.
//  * An example longer than T is refused (a UserError naming it), split into pieces of T tokens
//    (each piece a document of its own; its last token's target is the next piece's first),
//    or truncated to its first T tokens, as SftOverflow says.
//  * Training order: epoch e is the rows in an order shuffled from (seed, e); the global row
//    sequence is epoch after epoch, and batch k is rows k*B .. k*B + B - 1 of it, so one process
//    with grad_accum N * A reads what N ranks read with A. Evaluation: the rows in order, the
//    last batch completed with empty rows (no targets).
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "data/token_shards.h"

namespace dtrain {

enum class SftOverflow { Refuse, Split, Truncate };

struct SftLoaderOptions {
  int batch = 1, seq_len = 1;
  bool packing = false;
  SftOverflow overflow = SftOverflow::Refuse;
  uint64_t seed = 0;
  bool shuffle = true;   // false: evaluation order
  std::string refusal;   // appended to a refused example's message: what to change in the recipe
};

// What one batch holds.
struct SftBatch {
  int64_t targets = 0;  // tokens that are targets
  int64_t tokens = 0;   // tokens that are not padding
};

class SftLoader {
 public:
  // files: token shards, each with its side file (UserError naming a missing or bad one).
  SftLoader(std::vector<std::string> files, int vocab_size, const SftLoaderOptions& o);

  // Batch k: inputs, targets, positions [B*T] each.
  SftBatch batch(uint64_t k, int32_t* inputs, int32_t* targets, int32_t* positions) const;
  // The targets and tokens of batches [first, first + count) (what a step's loss is averaged
  // over), without making them.
  SftBatch totals(uint64_t first, uint64_t count) const;

  int64_t rows() const { return int64_t(rows_.size()); }  // rows per epoch
  int64_t examples() const { return int64_t(examples_.size()); }
  int64_t tokens() const { return tokens_; }    // the examples' tokens (after splitting or truncating)
  int64_t targets() const { return targets_; }  // their targets
  int64_t eval_batches() const;                 // ceil(rows / B)

 private:
  struct Example {
    uint32_t shard = 0;
    int64_t begin = 0, end = 0;  // its tokens [begin, end) of the shard
    int64_t doc_end = 0;         // where its document ends (a split piece's target runs past end)
    int64_t targets = 0;
  };
  struct Row {
    std::vector<int64_t> examples;
    int64_t targets = 0, tokens = 0;
  };
  int64_t row_at(uint64_t global_row) const;  // the epoch row at a global row index; -1: none (evaluation)
  const std::vector<int64_t>& order(uint64_t epoch) const;
  void fill_row(int64_t row, int32_t* in, int32_t* tg, int32_t* pos, SftBatch& b) const;
  int32_t token(const Example& e, int64_t i) const;
  bool is_target(const Example& e, int64_t i) const;

  SftLoaderOptions o_;
  std::vector<TokenShard> shards_;
  std::vector<std::vector<uint8_t>> masks_;
  std::vector<Example> examples_;
  std::vector<Row> rows_;
  int64_t tokens_ = 0, targets_ = 0;
  mutable std::map<uint64_t, std::vector<int64_t>> orders_;  // epoch -> row order (the last few)
};

}  // namespace dtrain
