#include "data/tokenizer.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <climits>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <unordered_map>

#include "core/error.h"
#include "data/pcre_regex.h"
#include "data/utf8.h"

namespace dtrain {
namespace {

// ---------------------------------------------------------------- GPT-2 pre-tokenizer
// GPT-2's pattern (pcre_regex.h) over the whole of Unicode (PCRE2_UCP: \p{L} and \p{N} are the
// general categories). Every character is a letter, a number, a space or none of these, so the
// matches cover the text. One compiled pattern, shared by all threads.
const PcreRegex& gpt2_regex() {
  static const PcreRegex re(kGpt2Pattern);
  return re;
}

// Calls f(piece) for the pieces of `text` in order; they cover it exactly.
template <class F>
void gpt2_split(std::string_view text, F&& f) {
  size_t at = 0;
  for (const auto& [b, e] : gpt2_regex().find_all(text)) {
    if (b != at) fault("gpt2 tokenizer: GPT-2's pattern left bytes {} to {} unmatched", at, b);
    f(text.substr(b, e - b));
    at = e;
  }
  if (at != text.size()) fault("gpt2 tokenizer: GPT-2's pattern left bytes {} to {} unmatched", at, text.size());
}

// Hash for unordered_map<std::string, ...> lookups by string_view.
struct StrHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

// ---------------------------------------------------------------- byte tokenizer
class ByteTokenizer final : public Tokenizer {
 public:
  std::string name() const override { return "byte"; }
  int vocab_size() const override { return 256; }
  int eot() const override { return -1; }
  std::unique_ptr<Tokenizer> clone() const override { return std::make_unique<ByteTokenizer>(); }
  std::vector<int32_t> encode(std::string_view t) const override {
    std::vector<int32_t> out(t.size());
    for (size_t i = 0; i < t.size(); ++i) out[i] = static_cast<unsigned char>(t[i]);
    return out;
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string s;
    for (int32_t id : ids) {
      if (id < 0 || id > 255) user_error("byte tokenizer: token id {} is outside [0, 256)", id);
      s.push_back(char(id));
    }
    return s;
  }
};

// ---------------------------------------------------------------- GPT-2 BPE
class Gpt2Tokenizer final : public Tokenizer {
 public:
  explicit Gpt2Tokenizer(const std::string& dir) : dir_(dir) {
    // bytes_to_unicode (OpenAI encoder.py): printable bytes map to themselves, the rest
    // to 256 + n in byte order.
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool keep = (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
      byte_sym_[size_t(b)] = utf8::encode(keep ? char32_t(b) : char32_t(256 + n++));
      sym_byte_[byte_sym_[size_t(b)]] = uint8_t(b);
    }
    const Gpt2VocabFiles vf = find_gpt2_vocab(dir);
    if (!vf.found())
      user_error("gpt2 tokenizer: {} holds neither encoder.json + vocab.bpe (OpenAI's names) nor vocab.json + "
                 "merges.txt (Hugging Face's)",
                 dir);
    const std::string ej = vf.encoder, vb = vf.merges;
    std::ifstream f(ej);
    if (!f) user_error("gpt2 tokenizer: cannot open {}", ej);
    nlohmann::json j;
    try {
      f >> j;
    } catch (const std::exception& e) {
      user_error("gpt2 tokenizer: {} is not valid JSON: {}", ej, e.what());
    }
    if (!j.is_object()) user_error("gpt2 tokenizer: {}: expected an object of token -> id", ej);
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (!it.value().is_number_integer())
        user_error("gpt2 tokenizer: {}: token '{}' has a non-integer id", ej, it.key());
      const int id = it.value().get<int>();
      if (id < 0 || id > 65535) user_error("gpt2 tokenizer: {}: id {} out of range", ej, id);
      encoder_[it.key()] = id;
      if (size_t(id) >= decoder_.size()) decoder_.resize(size_t(id) + 1);
      decoder_[size_t(id)] = it.key();
    }
    // each token's bytes, for decode (a symbol outside bytes_to_unicode adds none)
    bytes_.resize(decoder_.size());
    for (size_t id = 0; id < decoder_.size(); ++id) {
      const std::string& sym = decoder_[id];
      for (size_t i = 0; i < sym.size();) {
        const auto b = static_cast<unsigned char>(sym[i]);
        const size_t n = std::min(sym.size() - i, size_t(b < 0x80 ? 1 : b < 0xe0 ? 2 : b < 0xf0 ? 3 : 4));
        auto it = sym_byte_.find(sym.substr(i, n));
        if (it != sym_byte_.end()) bytes_[id].push_back(char(it->second));
        i += n;
      }
    }
    auto e = encoder_.find("<|endoftext|>");
    eot_ = e == encoder_.end() ? -1 : e->second;
    std::ifstream m(vb);
    if (!m) user_error("gpt2 tokenizer: cannot open {}", vb);
    std::string line;
    int rank = 0, lineno = 0;
    while (std::getline(m, line)) {
      ++lineno;
      if (lineno == 1 && line.rfind("#version", 0) == 0) continue;
      if (line.empty()) continue;
      const size_t sp = line.find(' ');
      if (sp == std::string::npos || sp == 0 || sp + 1 == line.size())
        user_error("gpt2 tokenizer: {}:{}: expected 'a b' merge, got '{}'", vb, lineno, line);
      ranks_[line] = rank++;
    }
    if (rank == 0) user_error("gpt2 tokenizer: {} holds no merges", vb);
  }

  std::string name() const override { return "gpt2"; }
  int vocab_size() const override { return int(decoder_.size()); }
  int eot() const override { return eot_; }
  int32_t added_token_id(std::string_view content) const override {
    return content == "<|endoftext|>" ? eot_ : -1;
  }
  std::unique_ptr<Tokenizer> clone() const override { return std::make_unique<Gpt2Tokenizer>(dir_); }

  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int32_t> out;
    out.reserve(text.size() / 4);
    gpt2_split(text, [&](std::string_view piece) {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = cache_.find(piece);
      if (it == cache_.end()) {
        if (cache_.size() >= (size_t(1) << 20)) cache_.clear();  // bounded on any corpus
        it = cache_.emplace(std::string(piece), bpe(piece)).first;
      }
      out.insert(out.end(), it->second.begin(), it->second.end());
    });
    return out;
  }

  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string out;
    for (int32_t id : ids) {
      if (id < 0 || size_t(id) >= decoder_.size())
        user_error("gpt2 tokenizer: token id {} is outside [0, {})", id, decoder_.size());
      out += bytes_[size_t(id)];
    }
    return out;
  }

 private:
  std::vector<int32_t> bpe(std::string_view piece) const {
    std::vector<std::string> w;
    for (unsigned char b : piece) w.push_back(byte_sym_[b]);
    while (w.size() > 1) {
      int best = INT_MAX;
      size_t at = 0;
      for (size_t i = 0; i + 1 < w.size(); ++i) {
        auto r = ranks_.find(w[i] + " " + w[i + 1]);
        if (r != ranks_.end() && r->second < best) best = r->second, at = i;
      }
      if (best == INT_MAX) break;
      const std::string a = w[at], b = w[at + 1];
      std::vector<std::string> nw;
      for (size_t i = 0; i < w.size();) {
        if (i + 1 < w.size() && w[i] == a && w[i + 1] == b) {
          nw.push_back(a + b);
          i += 2;
        } else {
          nw.push_back(w[i++]);
        }
      }
      w.swap(nw);
    }
    std::vector<int32_t> ids;
    for (const auto& s : w) {
      auto e = encoder_.find(s);
      if (e == encoder_.end()) fault("gpt2 tokenizer: symbol '{}' is not in encoder.json", s);
      ids.push_back(e->second);
    }
    return ids;
  }

  std::string dir_;
  std::string byte_sym_[256];
  std::unordered_map<std::string, uint8_t> sym_byte_;
  std::unordered_map<std::string, int> encoder_, ranks_;
  std::vector<std::string> decoder_, bytes_;  // per id: the token's symbols, its bytes
  int eot_ = -1;
  mutable std::mutex mu_;
  mutable std::unordered_map<std::string, std::vector<int32_t>, StrHash, std::equal_to<>> cache_;
};

}  // namespace

std::vector<std::string> gpt2_pretokenize(std::string_view text) {
  std::vector<std::string> out;
  gpt2_split(text, [&](std::string_view piece) { out.emplace_back(piece); });
  return out;
}

Gpt2VocabFiles find_gpt2_vocab(const std::string& dir) {
  namespace stdfs = std::filesystem;
  std::error_code ec;
  for (const auto& [enc, merges] : {std::pair{"encoder.json", "vocab.bpe"}, std::pair{"vocab.json", "merges.txt"}}) {
    const std::string e = dir + "/" + enc, m = dir + "/" + merges;
    if (stdfs::is_regular_file(e, ec) && stdfs::is_regular_file(m, ec)) return {e, m};
  }
  return {};
}

std::unique_ptr<Tokenizer> make_byte_tokenizer() { return std::make_unique<ByteTokenizer>(); }
std::unique_ptr<Tokenizer> load_gpt2_tokenizer(const std::string& dir) {
  return std::make_unique<Gpt2Tokenizer>(dir);
}
std::unique_ptr<Tokenizer> make_tokenizer(const std::string& kind, const std::string& vocab_dir) {
  if (kind == "byte") return make_byte_tokenizer();
  if (kind == "gpt2") {
    if (vocab_dir.empty())
      user_error("--tokenizer gpt2 needs --vocab DIR (a folder with encoder.json and vocab.bpe, or vocab.json and "
                 "merges.txt)");
    return load_gpt2_tokenizer(vocab_dir);
  }
  std::error_code ec;
  if (std::filesystem::exists(kind, ec)) {
    if (find_hf_tokenizer(kind).empty())
      user_error("--tokenizer {}: the directory holds no tokenizer.json{}", kind,
                 find_gpt2_vocab(kind).found() ? " (for GPT-2's vocabulary files there: --tokenizer gpt2 --vocab DIR)"
                                               : "");
    return load_hf_tokenizer(kind);
  }
  user_error("--tokenizer: expected 'byte', 'gpt2' or a tokenizer.json (the file or a directory holding it), got "
             "'{}' (no such file or directory)",
             kind);
}

std::string find_hf_tokenizer(const std::string& path) {
  namespace stdfs = std::filesystem;
  std::error_code ec;
  if (stdfs::is_directory(path, ec)) {
    const std::string f = (stdfs::path(path) / "tokenizer.json").string();
    return stdfs::is_regular_file(f, ec) ? f : "";
  }
  return stdfs::is_regular_file(path, ec) ? path : "";
}

std::vector<TokenizerFile> tokenizer_files(const std::string& dir) {
  namespace stdfs = std::filesystem;
  std::vector<TokenizerFile> out;
  if (dir.empty()) return out;
  if (const Gpt2VocabFiles vf = find_gpt2_vocab(dir); vf.found()) {
    out.push_back({vf.encoder, "vocab.json"});
    out.push_back({vf.merges, "merges.txt"});
  }
  std::error_code ec;
  for (const char* name : {"tokenizer.json", "tokenizer_config.json"})
    if (const std::string f = (stdfs::path(dir) / name).string(); stdfs::is_regular_file(f, ec))
      out.push_back({f, name});
  return out;
}

}  // namespace dtrain
