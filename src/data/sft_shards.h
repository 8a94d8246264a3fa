#pragma once
// Fine-tuning (SFT) shards: llm.c token shards (token_shards.h), each with a side file beside it
// that holds what a plain token stream cannot: the documents and the loss mask
// (docs/finetune.md). train_000000.bin is an ordinary llm.c shard (the token loader and any
// llm.c tool read it as plain tokens: the documents one after another); train_000000.sft is:
//
//   int32  header[256]   little-endian: [0] magic 0x54465344 ("DSFT" in a hex dump),
//                        [1] version 1, [2] token count (equal to the .bin's), [3] document
//                        count D, [4] mask encoding (1: one uint8 per token), the rest 0
//   uint32 starts[D + 1] document d is tokens [starts[d], starts[d+1]); starts[0] = 0,
//                        starts[D] = the token count; strictly increasing (no empty document)
//   uint8  mask[tokens]  1: the token is a target (the loss of predicting it counts), 0: not
//
// One JSONL row is one document; a document never crosses shards. The mask belongs to the
// token as a target: in a window, the prediction of token t+1 from tokens ..t counts when
// mask[t+1] is 1 (and, with documents kept apart, t+1 is not a document's first token).
#include <cstdint>
#include <string>
#include <vector>

namespace dtrain {

constexpr int32_t kSftMagic = 0x54465344;
constexpr int32_t kSftVersion = 1;
constexpr int32_t kSftMaskBytes = 1;  // header[4]: one uint8 per token

struct SftSide {
  std::vector<uint32_t> starts;  // D + 1 offsets
  std::vector<uint8_t> mask;     // one per token
  size_t documents() const { return starts.empty() ? 0 : starts.size() - 1; }
};

// "DIR/train_000000.sft" for "DIR/train_000000.bin".
std::string sft_side_path(const std::string& token_shard);
// Writes the side file (RuntimeFault on I/O failure; DTRAIN_CHECK on a malformed SftSide).
void write_sft_side(const std::string& path, const SftSide& s);
// Reads and validates a side file against its shard's token count: UserError naming the file and
// what is wrong (magic, version, counts, offsets, a mask value other than 0 or 1, truncation).
SftSide read_sft_side(const std::string& path, size_t tokens);

}  // namespace dtrain
