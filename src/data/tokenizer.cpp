#include "data/tokenizer.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <climits>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include "core/error.h"

namespace dtrain {
namespace {

// ---------------------------------------------------------------- UTF-8 and classes
struct Cp {
  char32_t c;
  size_t begin, end;  // byte range in the text
};

std::vector<Cp> decode_utf8(std::string_view s) {
  std::vector<Cp> out;
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char b = static_cast<unsigned char>(s[i]);
    int len = b < 0x80 ? 1 : (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : (b >> 3) == 30 ? 4 : 0;
    char32_t c = 0;
    bool ok = len > 0 && i + size_t(len) <= s.size();
    if (ok) {
      c = len == 1 ? b : len == 2 ? (b & 0x1f) : len == 3 ? (b & 0x0f) : (b & 0x07);
      for (int k = 1; k < len && ok; ++k) {
        const unsigned char cb = static_cast<unsigned char>(s[i + size_t(k)]);
        ok = (cb >> 6) == 2;
        c = (c << 6) | (cb & 0x3f);
      }
    }
    if (!ok) len = 1, c = 0xFFFD;  // invalid byte: one "other" symbol (its bytes still encode)
    out.push_back({c, i, i + size_t(len)});
    i += size_t(len);
  }
  return out;
}

bool in_ranges(char32_t c, const std::pair<char32_t, char32_t>* r, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (c >= r[i].first && c <= r[i].second) return true;
  return false;
}

// Python `regex` \s
bool is_space(char32_t c) {
  return (c >= 9 && c <= 13) || c == 32 || (c >= 0x1c && c <= 0x1f) || c == 0x85 || c == 0xa0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 ||
         c == 0x202f || c == 0x205f || c == 0x3000;
}

// \p{N}: ASCII digits plus the common non-ASCII decimal digits / number forms.
bool is_number(char32_t c) {
  static const std::pair<char32_t, char32_t> r[] = {
      {'0', '9'},       {0xb2, 0xb3},     {0xb9, 0xb9},     {0xbc, 0xbe},     {0x660, 0x669},
      {0x6f0, 0x6f9},   {0x7c0, 0x7c9},   {0x966, 0x96f},   {0x9e6, 0x9ef},   {0xa66, 0xa6f},
      {0xae6, 0xaef},   {0xb66, 0xb6f},   {0xbe6, 0xbf2},   {0xc66, 0xc6f},   {0xce6, 0xcef},
      {0xd66, 0xd78},   {0xe50, 0xe59},   {0xed0, 0xed9},   {0xf20, 0xf33},   {0x1040, 0x1049},
      {0x2070, 0x2070}, {0x2074, 0x2079}, {0x2080, 0x2089}, {0x2150, 0x2189}, {0x2460, 0x249b},
      {0x24ea, 0x24ff}, {0x2776, 0x2793}, {0x3007, 0x3007}, {0x3021, 0x3029}, {0xff10, 0xff19}};
  return in_ranges(c, r, sizeof(r) / sizeof(r[0]));
}

// \p{L}: ASCII letters and the main letter blocks (Latin, Greek, Cyrillic, Armenian,
// Hebrew, Arabic, Indic letters, Thai, Georgian, Hangul, kana, CJK ideographs, ...).
bool is_letter(char32_t c) {
  if (c < 0x80) return (c | 0x20) >= 'a' && (c | 0x20) <= 'z';
  static const std::pair<char32_t, char32_t> r[] = {
      {0xaa, 0xaa},       {0xb5, 0xb5},       {0xba, 0xba},       {0xc0, 0xd6},
      {0xd8, 0xf6},       {0xf8, 0x2c1},      {0x2c6, 0x2d1},     {0x2e0, 0x2e4},
      {0x370, 0x374},     {0x376, 0x37d},     {0x386, 0x386},     {0x388, 0x3ff},
      {0x400, 0x481},     {0x48a, 0x52f},     {0x531, 0x556},     {0x561, 0x587},
      {0x5d0, 0x5ea},     {0x620, 0x64a},     {0x671, 0x6d3},     {0x904, 0x939},
      {0x958, 0x961},     {0x985, 0x9b9},     {0xa05, 0xa39},     {0xa85, 0xab9},
      {0xb05, 0xb39},     {0xb85, 0xbb9},     {0xc05, 0xc39},     {0xc85, 0xcb9},
      {0xd05, 0xd3a},     {0xe01, 0xe30},     {0xe40, 0xe46},     {0x10a0, 0x10ff},
      {0x1100, 0x1248},   {0x1e00, 0x1fbc},   {0x1fc2, 0x1fcc},   {0x1fd0, 0x1fdb},
      {0x1fe0, 0x1fec},   {0x1ff2, 0x1ffc},   {0x2071, 0x2071},   {0x207f, 0x207f},
      {0x2c00, 0x2ce4},   {0x3041, 0x3096},   {0x309d, 0x309f},   {0x30a1, 0x30fa},
      {0x30fc, 0x30ff},   {0x3105, 0x312f},   {0x3131, 0x318e},   {0x3400, 0x4dbf},
      {0x4e00, 0x9fff},   {0xa000, 0xa48c},   {0xac00, 0xd7a3},   {0xf900, 0xfaff},
      {0xff21, 0xff3a},   {0xff41, 0xff5a},   {0xff66, 0xffdc},   {0x20000, 0x2fa1f}};
  return in_ranges(c, r, sizeof(r) / sizeof(r[0]));
}

enum class Cls { Letter, Number, Space, Other };
Cls cls(char32_t c) {
  if (is_letter(c)) return Cls::Letter;
  if (is_number(c)) return Cls::Number;
  if (is_space(c)) return Cls::Space;
  return Cls::Other;
}

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
    for (const std::string& piece : gpt2_pretokenize(text)) {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = cache_.find(piece);
      if (it == cache_.end()) {
        if (cache_.size() >= (size_t(1) << 20)) cache_.clear();  // bounded on any corpus
        it = cache_.emplace(piece, bpe(piece)).first;
      }
      out.insert(out.end(), it->second.begin(), it->second.end());
    }
    return out;
  }

  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string out;
    for (int32_t id : ids) {
      if (id < 0 || size_t(id) >= decoder_.size())
        user_error("gpt2 tokenizer: token id {} is outside [0, {})", id, decoder_.size());
      for (const Cp& c : decode_utf8(decoder_[size_t(id)])) {
        auto b = sym_byte_.find(utf8(c.c));
        if (b != sym_byte_.end()) out.push_back(char(b->second));
      }
    }
    return out;
  }

 private:
  std::vector<int32_t> bpe(const std::string& piece) const {
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
  std::vector<std::string> decoder_;
  int eot_ = -1;
  mutable std::mutex mu_;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache_;
};

}  // namespace

// 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
std::vector<std::string> gpt2_pretokenize(std::string_view text) {
  const std::vector<Cp> cps = decode_utf8(text);
  const size_t n = cps.size();
  std::vector<std::string> out;
  auto emit = [&](size_t b, size_t e) {
    out.emplace_back(text.substr(cps[b].begin, cps[e - 1].end - cps[b].begin));
  };
  auto run = [&](size_t i, Cls c) {
    while (i < n && cls(cps[i].c) == c) ++i;
    return i;
  };
  size_t i = 0;
  while (i < n) {
    const char32_t c = cps[i].c;
    if (c == '\'' && i + 1 < n) {
      static const char* const kSuffix[] = {"s", "t", "re", "ve", "m", "ll", "d"};
      size_t len = 0;
      for (const char* suf : kSuffix) {
        const size_t L = std::char_traits<char>::length(suf);
        bool ok = true;
        for (size_t k = 0; ok && k < L; ++k) ok = i + 1 + k < n && cps[i + 1 + k].c == char32_t(suf[k]);
        if (ok) {
          len = L + 1;
          break;
        }
      }
      if (len) {
        emit(i, i + len);
        i += len;
        continue;
      }
    }
    const Cls k0 = cls(c);
    const bool sp = c == ' ' && i + 1 < n && cls(cps[i + 1].c) != Cls::Space;
    if (k0 != Cls::Space || sp) {
      const size_t s = sp ? i + 1 : i;
      const Cls k = cls(cps[s].c);
      size_t e = s;
      if (k == Cls::Other) {
        while (e < n && cls(cps[e].c) == Cls::Other) ++e;
      } else {
        e = run(s, k);
      }
      emit(i, e);
      i = e;
      continue;
    }
    // whitespace run: \s+(?!\S) leaves the last one when a non-space follows; \s+ otherwise
    size_t e = run(i, Cls::Space);
    if (e < n && e - i > 1) --e;
    emit(i, e);
    i = e;
  }
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
