#include "data/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <nlohmann/json.hpp>
#include <pcre2.h>

#include <algorithm>
#include <climits>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <unordered_map>

#include "core/error.h"

namespace dtrain {
namespace {

// ---------------------------------------------------------------- GPT-2 pre-tokenizer
// GPT-2's pattern (OpenAI's encoder.py; tiktoken's "gpt2" splits the same way), matched by PCRE2
// over the whole of Unicode (PCRE2_UCP: \p{L} and \p{N} are the general categories). \s is
// written as \p{White_Space}, what Python's `regex` and Rust's `regex` (tiktoken) mean by it;
// PCRE2's UCP \s also takes U+180E MONGOLIAN VOWEL SEPARATOR, a format character since Unicode
// 6.3. Every character is a letter, a number, a space or none of these, so a match always starts
// where the last one ended: the pattern is anchored. The compiled pattern is read-only and shared
// by all threads; each thread has its own match data.
constexpr char kGpt2Pattern[] =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\p{White_Space}\p{L}\p{N}]+)"
    R"(|\p{White_Space}+(?!\P{White_Space})|\p{White_Space}+)";

class Gpt2Splitter {
 public:
  static const Gpt2Splitter& get() {
    static const Gpt2Splitter s;
    return s;
  }
  Gpt2Splitter(const Gpt2Splitter&) = delete;
  Gpt2Splitter& operator=(const Gpt2Splitter&) = delete;
  ~Gpt2Splitter() { pcre2_code_free(code_); }

  // Calls f(piece) for the pieces of `text` in order; they cover it exactly.
  template <class F>
  void split(std::string_view text, F&& f) const {
    // PCRE2 matches valid UTF-8 only: a byte outside a well-formed sequence becomes \x01 (a
    // control character: neither letter, number nor space), one symbol per byte; the pieces are
    // cut from the original bytes.
    std::string fixed;
    std::string_view subject = text;
    if (size_t bad = first_invalid_utf8(text); bad != text.size()) {
      fixed = replace_invalid_utf8(text, bad);
      subject = fixed;
    }
    pcre2_match_data* md = match_data();
    const auto* s = reinterpret_cast<PCRE2_SPTR>(subject.data());
    for (size_t at = 0; at < subject.size();) {
      const int rc = pcre2_match(code_, s, subject.size(), at, PCRE2_NO_UTF_CHECK, md, nullptr);
      const size_t end = rc > 0 ? pcre2_get_ovector_pointer(md)[1] : at;
      if (end <= at) fault("gpt2 tokenizer: PCRE2 found no piece at byte {} ({})", at, message(rc));
      f(text.substr(at, end - at));
      at = end;
    }
  }

 private:
  Gpt2Splitter() {
    int err = 0;
    PCRE2_SIZE off = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(kGpt2Pattern), PCRE2_ZERO_TERMINATED,
                          PCRE2_UTF | PCRE2_UCP | PCRE2_ANCHORED, &err, &off, nullptr);
    if (!code_) fault("gpt2 tokenizer: PCRE2 rejects the pattern at {}: {}", off, message(err));
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // where JIT is unavailable pcre2_match interprets
  }
  // This thread's match data (one ovector pair is all the pattern needs).
  pcre2_match_data* match_data() const {
    struct MatchData {
      pcre2_match_data* md;
      explicit MatchData(const pcre2_code* c) : md(pcre2_match_data_create_from_pattern(c, nullptr)) {
        if (!md) fault("gpt2 tokenizer: out of memory for PCRE2 match data");
      }
      ~MatchData() { pcre2_match_data_free(md); }
    };
    thread_local MatchData data(code_);
    return data.md;
  }
  static std::string message(int code) {
    PCRE2_UCHAR buf[256];
    return pcre2_get_error_message(code, buf, sizeof buf) < 0 ? std::to_string(code)
                                                               : reinterpret_cast<const char*>(buf);
  }
  // Length of the well-formed UTF-8 sequence at s[i] (Unicode table 3-7), 0 when none starts there.
  static size_t utf8_len(std::string_view s, size_t i) {
    const auto b = [&](size_t k) { return i + k < s.size() ? static_cast<unsigned char>(s[i + k]) : 0u; };
    const unsigned b0 = b(0);
    auto cont = [&](size_t k, unsigned lo = 0x80, unsigned hi = 0xbf) { return b(k) >= lo && b(k) <= hi; };
    if (b0 < 0x80) return 1;
    if (b0 < 0xc2) return 0;
    if (b0 < 0xe0) return cont(1) ? 2 : 0;
    if (b0 < 0xf0) {
      const bool ok1 = b0 == 0xe0 ? cont(1, 0xa0) : b0 == 0xed ? cont(1, 0x80, 0x9f) : cont(1);
      return ok1 && cont(2) ? 3 : 0;
    }
    if (b0 < 0xf5) {
      const bool ok1 = b0 == 0xf0 ? cont(1, 0x90) : b0 == 0xf4 ? cont(1, 0x80, 0x8f) : cont(1);
      return ok1 && cont(2) && cont(3) ? 4 : 0;
    }
    return 0;
  }
  static size_t first_invalid_utf8(std::string_view s) {
    for (size_t i = 0; i < s.size();) {
      if (static_cast<unsigned char>(s[i]) < 0x80) {
        ++i;
        continue;
      }
      const size_t n = utf8_len(s, i);
      if (n == 0) return i;
      i += n;
    }
    return s.size();
  }
  static std::string replace_invalid_utf8(std::string_view s, size_t from) {
    std::string out(s);
    for (size_t i = from; i < s.size();) {
      const size_t n = utf8_len(s, i);
      if (n == 0) out[i] = '\x01';
      i += n ? n : 1;
    }
    return out;
  }

  pcre2_code* code_ = nullptr;
};

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
std::string utf8(char32_t c) {
  std::string s;
  if (c < 0x80) s.push_back(char(c));
  else if (c < 0x800) s += {char(0xc0 | (c >> 6)), char(0x80 | (c & 0x3f))};
  else s += {char(0xe0 | (c >> 12)), char(0x80 | ((c >> 6) & 0x3f)), char(0x80 | (c & 0x3f))};
  return s;
}

class Gpt2Tokenizer final : public Tokenizer {
 public:
  explicit Gpt2Tokenizer(const std::string& dir) {
    // bytes_to_unicode (OpenAI encoder.py): printable bytes map to themselves, the rest
    // to 256 + n in byte order.
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool keep = (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
      byte_sym_[size_t(b)] = utf8(keep ? char32_t(b) : char32_t(256 + n++));
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

  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int32_t> out;
    out.reserve(text.size() / 4);
    Gpt2Splitter::get().split(text, [&](std::string_view piece) {
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
  Gpt2Splitter::get().split(text, [&](std::string_view piece) { out.emplace_back(piece); });
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
  user_error("--tokenizer: expected 'byte' or 'gpt2', got '{}'", kind);
}

}  // namespace dtrain
