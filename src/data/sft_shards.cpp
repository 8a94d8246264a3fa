#include "data/sft_shards.h"

#include <fstream>

#include "core/error.h"

namespace dtrain {

std::string sft_side_path(const std::string& token_shard) {
  const std::string ext = ".bin";
  if (token_shard.size() >= ext.size() && token_shard.compare(token_shard.size() - ext.size(), ext.size(), ext) == 0)
    return token_shard.substr(0, token_shard.size() - ext.size()) + ".sft";
  return token_shard + ".sft";
}

void write_sft_side(const std::string& path, const SftSide& s) {
  const size_t n = s.mask.size();
  DTRAIN_CHECK(s.starts.size() >= 1 && s.starts.front() == 0 && s.starts.back() == n, "sft side {}: offsets", path);
  DTRAIN_CHECK(n <= size_t(INT32_MAX) && s.starts.size() - 1 <= size_t(INT32_MAX), "sft side {}: {} tokens", path, n);
  int32_t header[256] = {};
  header[0] = kSftMagic;
  header[1] = kSftVersion;
  header[2] = int32_t(n);
  header[3] = int32_t(s.starts.size() - 1);
  header[4] = kSftMaskBytes;
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) fault("sft side file {}: cannot open for writing", path);
  f.write(reinterpret_cast<const char*>(header), sizeof(header));
  f.write(reinterpret_cast<const char*>(s.starts.data()), std::streamsize(s.starts.size() * sizeof(uint32_t)));
  f.write(reinterpret_cast<const char*>(s.mask.data()), std::streamsize(n));
  f.flush();
  if (!f) fault("sft side file {}: write failed", path);
}

SftSide read_sft_side(const std::string& path, size_t tokens) {
  std::ifstream f(path, std::ios::binary);
  if (!f) user_error("sft side file {}: cannot open (the .sft file beside the token shard)", path);
  int32_t h[256];
  f.read(reinterpret_cast<char*>(h), sizeof(h));
  if (f.gcount() != std::streamsize(sizeof(h))) user_error("sft side file {}: truncated header", path);
  if (h[0] != kSftMagic) user_error("sft side file {}: bad magic {:#x} (expected {:#x})", path, uint32_t(h[0]), kSftMagic);
  if (h[1] != kSftVersion) user_error("sft side file {}: unsupported version {} (expected {})", path, h[1], kSftVersion);
  if (h[2] < 0 || size_t(h[2]) != tokens)
    user_error("sft side file {}: describes {} tokens, its shard holds {}", path, h[2], tokens);
  if (h[3] < 1 && tokens > 0) user_error("sft side file {}: {} documents", path, h[3]);
  if (h[4] != kSftMaskBytes) user_error("sft side file {}: unknown mask encoding {}", path, h[4]);
  SftSide s;
  s.starts.resize(size_t(std::max(h[3], 0)) + 1);
  s.mask.resize(tokens);
  f.read(reinterpret_cast<char*>(s.starts.data()), std::streamsize(s.starts.size() * sizeof(uint32_t)));
  f.read(reinterpret_cast<char*>(s.mask.data()), std::streamsize(tokens));
  if (!f) user_error("sft side file {}: truncated ({} documents, {} tokens declared)", path, h[3], tokens);
  char extra;
  if (f.read(&extra, 1); f.gcount() != 0) user_error("sft side file {}: trailing bytes", path);
  if (s.starts.front() != 0 || s.starts.back() != tokens)
    user_error("sft side file {}: document offsets run from {} to {}, expected 0 to {}", path, s.starts.front(),
               s.starts.back(), tokens);
  for (size_t d = 1; d < s.starts.size(); ++d)
    if (s.starts[d] <= s.starts[d - 1])
      user_error("sft side file {}: document {} is empty or out of order (offsets {} then {})", path, d - 1,
                 s.starts[d - 1], s.starts[d]);
  for (size_t i = 0; i < tokens; ++i)
    if (s.mask[i] > 1) user_error("sft side file {}: mask value {} at token {} (expected 0 or 1)", path, s.mask[i], i);
  return s;
}

}  // namespace dtrain
