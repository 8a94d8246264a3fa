// Hugging Face byte-level BPE (tokenizer.json) encoding and decoding as `tokenizers` 0.20 does
// them (what each part of the file means: hf_tokenizer_json.h):
//   1. added tokens are split out of the text (non-normalized ones, then normalized ones in what
//      is left), leftmost-longest, with single_word / lstrip / rstrip;
//   2. every other piece goes through the pre-tokenizer steps in order, each splitting the pieces
//      of the one before (the pattern's matches and the gaps between them, by its behavior);
//   3. each resulting piece is BPE-merged over its bytes' symbols: the pair of lowest merge rank
//      first, leftmost among equals (ignore_merges: a piece that is a token is that token).
// Decoding is the ByteLevel decoder: a token whose characters are all byte symbols gives those
// bytes, any other (an added token such as "<|endoftext|>") its own UTF-8.
#include <algorithm>
#include <array>
#include <filesystem>
#include <mutex>
#include <queue>
#include <unordered_map>

#include "core/error.h"
#include "data/hf_tokenizer_json.h"
#include "data/pcre_regex.h"
#include "data/tokenizer.h"
#include "data/utf8.h"

namespace dtrain {
namespace {

struct StrHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using IdMap = std::unordered_map<std::string, int32_t, StrHash, std::equal_to<>>;

// The patterns `data tokenize` may cut after a lone '\n' between two non-space ASCII characters
// (the matches before the cut end there, whether or not text follows, and the next one starts
// there): GPT-2's, Llama 3's and Qwen2's, in tokenizer.json's (Oniguruma's) spelling.
const char* const kCuttablePatterns[] = {
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)",
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)",
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)",
};

// GPT-2's bytes_to_unicode: printable bytes stand for themselves, the others for U+0100 + n in
// byte order. sym[b] is byte b's symbol; byte_of[c] the byte of symbol c (-1: none), c < 0x144.
struct ByteSymbols {
  std::array<std::string, 256> sym;
  std::array<int, 0x144> byte_of{};
  ByteSymbols() {
    byte_of.fill(-1);
    char32_t n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool keep = (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
      const char32_t c = keep ? char32_t(b) : 0x100 + n++;
      sym[size_t(b)] = utf8::encode(c);
      byte_of[c] = b;
    }
  }
  // The bytes a token's symbols stand for; false when a character is no byte symbol.
  bool bytes(std::string_view token, std::string& out) const {
    out.clear();
    for (size_t i = 0; i < token.size();) {
      const size_t n = utf8::seq_len(token, i);
      const char32_t c = n ? utf8::decode(token, i, n) : 0x144;
      if (c >= byte_of.size() || byte_of[c] < 0) return false;
      out.push_back(char(byte_of[c]));
      i += n;
    }
    return true;
  }
};

const ByteSymbols& byte_symbols() {
  static const ByteSymbols s;
  return s;
}

// The start of the character that ends at s[at] (at > 0); n its length, 0 when the bytes there
// are no well-formed character.
size_t char_before(std::string_view s, size_t at, size_t& n) {
  size_t k = at - 1;
  while (k > 0 && at - k < 4 && (static_cast<unsigned char>(s[k]) & 0xc0) == 0x80) --k;
  n = utf8::seq_len(s, k) == at - k ? at - k : 0;
  return k;
}

struct Segment {
  size_t b, e;
  int32_t id;  // an added token's id, -1 for text
};

class HfModel {
 public:
  explicit HfModel(const hf::Spec& s);
  // Calls piece(text) for each pre-tokenized piece and token(id) for each added token, in order.
  template <class P, class T>
  void split(std::string_view text, P&& piece, T&& token) const;
  std::vector<int32_t> bpe(std::string_view piece) const;
  bool whole_token(std::string_view piece, int32_t& id) const;  // ignore_merges
  std::string decode(const std::vector<int32_t>& ids) const;

  std::string file;
  IdMap added_ids;  // added token content -> id
  int vocab_size = 0, eot = -1;
  Tokenizer::Template tmpl;
  bool cuts = true;

 private:
  struct Pass {  // the added tokens matched in one pass, by first byte, longest first
    std::vector<hf::AddedToken> tokens;
    std::array<std::vector<uint32_t>, 256> first;
  };
  void split_added(const Pass& p, std::string_view s, size_t base, std::vector<Segment>& out) const;
  bool word_char_at(std::string_view s, size_t i, size_t n) const;
  template <class F>
  void pre_tokenize(size_t k, std::string_view s, F& emit) const;
  std::vector<std::pair<size_t, size_t>> step_splits(size_t k, std::string_view s) const;

  Pass passes_[2];  // non-normalized, then normalized (no normalizer: both on the raw text)
  PcreRegex word_{R"([\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control}])"};  // Rust's \w
  std::vector<hf::PreStep> steps_;
  std::vector<std::unique_ptr<PcreRegex>> step_re_;
  std::array<int32_t, 256> byte_id_{};
  std::unordered_map<uint64_t, std::pair<uint32_t, int32_t>> merges_;  // (left, right) -> (rank, result)
  IdMap whole_;                                                        // ignore_merges: a token's bytes -> id
  bool ignore_merges_ = false, fuse_unk_ = false;
  std::string unk_token_;
  int32_t unk_id_ = -1;
  std::vector<std::string> bytes_;  // per id: what it decodes to
  std::vector<char> known_;
};

HfModel::HfModel(const hf::Spec& s)
    : file(s.file), steps_(s.pre), ignore_merges_(s.ignore_merges), fuse_unk_(s.fuse_unk), unk_token_(s.unk_token) {
  const ByteSymbols& bs = byte_symbols();
  IdMap vocab;
  for (const auto& [tok, id] : s.vocab) {
    vocab[tok] = id;
    vocab_size = std::max(vocab_size, id + 1);
  }
  for (const auto& t : s.added) {
    vocab_size = std::max(vocab_size, t.id + 1);
    added_ids.emplace(t.content, t.id);
  }
  bytes_.resize(size_t(vocab_size));
  known_.assign(size_t(vocab_size), 0);
  std::string raw;
  for (const auto& [tok, id] : s.vocab) {
    const bool symbols = bs.bytes(tok, raw);
    if (symbols && ignore_merges_) whole_[raw] = id;
    bytes_[size_t(id)] = symbols ? raw : tok;
    known_[size_t(id)] = 1;
  }
  for (int b = 0; b < 256; ++b) {
    auto it = vocab.find(bs.sym[size_t(b)]);
    byte_id_[size_t(b)] = it == vocab.end() ? -1 : it->second;
  }
  if (auto it = vocab.find(unk_token_); !unk_token_.empty() && it != vocab.end()) unk_id_ = it->second;
  for (size_t r = 0; r < s.merges.size(); ++r)
    merges_[uint64_t(uint32_t(s.merges[r].first)) << 32 | uint32_t(s.merges[r].second)] = {uint32_t(r), s.merged[r]};
  // added tokens: special ones first, as tokenizers orders its tries
  for (bool special : {true, false})
    for (const auto& t : s.added)
      if (t.special == special) {
        Pass& p = passes_[t.normalized ? 1 : 0];
        p.first[static_cast<unsigned char>(t.content[0])].push_back(uint32_t(p.tokens.size()));
        p.tokens.push_back(t);
        if (!bs.bytes(t.content, bytes_[size_t(t.id)])) bytes_[size_t(t.id)] = t.content;
        known_[size_t(t.id)] = 1;
        cuts = cuts && !t.lstrip && t.content.find('\n') == std::string::npos;
      }
  for (Pass& p : passes_)
    for (auto& f : p.first)
      std::stable_sort(f.begin(), f.end(),
                       [&](uint32_t a, uint32_t b) { return p.tokens[a].content.size() > p.tokens[b].content.size(); });
  for (const char* name : {"<|endoftext|>", "<|end_of_text|>"}) {
    auto it = std::find_if(s.added.begin(), s.added.end(), [&](const hf::AddedToken& t) { return t.content == name; });
    if (it != s.added.end())
      eot = it->id;
    else if (auto v = vocab.find(name); v != vocab.end())
      eot = v->second;
    if (eot >= 0) break;
  }
  tmpl.before = s.before;
  tmpl.after = s.after;
  for (const auto& v : {s.before, s.after})
    for (int32_t id : v)
      if (id >= vocab_size || !known_[size_t(id)])
        user_error("{}: post_processor: the template's id {} is no token of the vocabulary or added tokens", file, id);
  // pre-tokenizer: each pattern compiled once; where `data tokenize` may cut the text
  bool splits_at_newline = false;
  for (const hf::PreStep& st : steps_) {
    if (st.byte_level && !st.use_regex) {
      step_re_.push_back(nullptr);
    } else {
      try {
        step_re_.push_back(std::make_unique<PcreRegex>(st.pattern, st.literal));
      } catch (const std::invalid_argument& e) {
        user_error("{}: pre_tokenizer: the pattern {} is not supported: {}", file, st.source, e.what());
      }
    }
    const bool known = st.byte_level || (!st.invert && st.behavior == hf::Behavior::Isolated && !st.literal &&
                                         std::find(std::begin(kCuttablePatterns), std::end(kCuttablePatterns),
                                                   st.source) != std::end(kCuttablePatterns));
    splits_at_newline = splits_at_newline || (known && (!st.byte_level || st.use_regex));
    cuts = cuts && (known || st.digits) && !(st.byte_level && st.add_prefix_space);
  }
  cuts = cuts && splits_at_newline;
}

bool HfModel::word_char_at(std::string_view s, size_t i, size_t n) const {
  return n > 0 && word_.matches_at(s.substr(i, n), 0);
}

// tokenizers' AddedVocabulary::find_matches over s (which starts at `base` in the text).
void HfModel::split_added(const Pass& p, std::string_view s, size_t base, std::vector<Segment>& out) const {
  size_t start_offset = 0;
  for (size_t pos = 0; pos < s.size();) {
    size_t start = pos, stop = 0;
    const hf::AddedToken* tok = nullptr;
    for (; start < s.size() && !tok; ++start)  // leftmost, then longest
      for (uint32_t k : p.first[static_cast<unsigned char>(s[start])])
        if (s.compare(start, p.tokens[k].content.size(), p.tokens[k].content) == 0) {
          tok = &p.tokens[k];
          break;
        }
    if (!tok) break;
    --start;
    stop = start + tok->content.size();
    pos = stop;
    size_t n = 0;
    if (tok->single_word) {  // no word character (Rust's \w) right before or after it
      const size_t k = start > 0 ? char_before(s, start, n) : 0;
      const bool before = start > 0 && word_char_at(s, k, n);
      const bool after = stop < s.size() && word_char_at(s, stop, utf8::seq_len(s, stop));
      if (before || after) continue;
    }
    if (tok->lstrip) {  // the white space before it is part of it (less what an earlier match took)
      size_t b = start;
      while (b > 0) {
        const size_t k = char_before(s, b, n);
        if (n == 0 || !utf8::is_white_space(utf8::decode(s, k, n))) break;
        b = k;
      }
      start = std::max(b, start_offset);
    }
    if (tok->rstrip)
      for (; stop < s.size() && (n = utf8::seq_len(s, stop)) > 0 && utf8::is_white_space(utf8::decode(s, stop, n));)
        stop += n;
    if (start_offset < start) out.push_back({base + start_offset, base + start, -1});
    out.push_back({base + start, base + stop, tok->id});
    start_offset = stop;
  }
  if (start_offset < s.size()) out.push_back({base + start_offset, base + s.size(), -1});
}

// The pieces step k keeps of s: its pattern's matches and the gaps between them (flags flipped by
// invert), grouped by the behavior (tokenizers' NormalizedString::split).
std::vector<std::pair<size_t, size_t>> HfModel::step_splits(size_t k, std::string_view s) const {
  struct Part {
    size_t b, e;
    bool match;
  };
  std::vector<Part> parts;
  size_t prev = 0;
  for (const auto& [b, e] : step_re_[k]->find_all(s)) {
    if (prev != b) parts.push_back({prev, b, false});
    parts.push_back({b, e, true});
    prev = e;
  }
  if (prev != s.size()) parts.push_back({prev, s.size(), false});
  const hf::PreStep& st = steps_[k];
  if (st.invert)
    for (Part& p : parts) p.match = !p.match;
  std::vector<std::pair<size_t, size_t>> out;
  bool previous = false;
  switch (st.behavior) {
    case hf::Behavior::Isolated:
      for (const Part& p : parts) out.emplace_back(p.b, p.e);
      break;
    case hf::Behavior::Removed:
      for (const Part& p : parts)
        if (!p.match) out.emplace_back(p.b, p.e);
      break;
    case hf::Behavior::Contiguous:
      for (const Part& p : parts) {
        if (p.match == previous && !out.empty())
          out.back().second = p.e;
        else
          out.emplace_back(p.b, p.e);
        previous = p.match;
      }
      break;
    case hf::Behavior::MergedWithPrevious:
      for (const Part& p : parts) {
        if (p.match && !previous && !out.empty())
          out.back().second = p.e;
        else
          out.emplace_back(p.b, p.e);
        previous = p.match;
      }
      break;
    case hf::Behavior::MergedWithNext:
      for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
        if (it->match && !previous && !out.empty())
          out.back().first = it->b;
        else
          out.emplace_back(it->b, it->e);
        previous = it->match;
      }
      std::reverse(out.begin(), out.end());
      break;
  }
  return out;
}

template <class F>
void HfModel::pre_tokenize(size_t k, std::string_view s, F& emit) const {
  if (s.empty()) return;  // tokenizers drops empty pieces
  if (k == steps_.size()) {
    emit(s);
    return;
  }
  std::string prefixed;
  if (steps_[k].byte_level && steps_[k].add_prefix_space && s[0] != ' ') {
    prefixed = " ";
    prefixed += s;
    s = prefixed;
  }
  if (!step_re_[k]) {
    pre_tokenize(k + 1, s, emit);
    return;
  }
  for (const auto& [b, e] : step_splits(k, s)) pre_tokenize(k + 1, s.substr(b, e - b), emit);
}

template <class P, class T>
void HfModel::split(std::string_view text, P&& piece, T&& token) const {
  std::vector<Segment> first, second;
  split_added(passes_[0], text, 0, first);
  for (const Segment& g : first)
    if (g.id >= 0)
      second.push_back(g);
    else
      split_added(passes_[1], text.substr(g.b, g.e - g.b), g.b, second);
  for (const Segment& g : second)
    if (g.id >= 0)
      token(g.id);
    else
      pre_tokenize(0, text.substr(g.b, g.e - g.b), piece);
}

bool HfModel::whole_token(std::string_view piece, int32_t& id) const {
  if (!ignore_merges_) return false;
  auto it = whole_.find(piece);
  if (it == whole_.end()) return false;
  id = it->second;
  return true;
}

// tokenizers' BPE::merge_word and Word::merge_all, over one piece's bytes.
std::vector<int32_t> HfModel::bpe(std::string_view piece) const {
  struct Sym {
    int32_t c;
    long prev, next;
    bool live;
  };
  std::vector<Sym> w;
  w.reserve(piece.size());
  auto add = [&](int32_t c) {
    const long n = long(w.size());
    if (n > 0) w.back().next = n;
    w.push_back({c, n - 1, -1, true});
  };
  bool unk = false;  // an unknown byte's unk token waits (to be fused with the next)
  for (unsigned char b : piece) {
    if (byte_id_[b] >= 0) {
      if (unk) add(unk_id_), unk = false;
      add(byte_id_[b]);
    } else if (!unk_token_.empty()) {  // without unk_token tokenizers drops the byte
      if (unk_id_ < 0) user_error("{}: model.unk_token \"{}\" is not in model.vocab", file, unk_token_);
      if (unk && !fuse_unk_) add(unk_id_);
      unk = true;
    }
  }
  if (unk) add(unk_id_);
  struct Merge {
    size_t pos;
    uint32_t rank;
    int32_t id;
  };
  auto later = [](const Merge& a, const Merge& b) { return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos; };
  std::priority_queue<Merge, std::vector<Merge>, decltype(later)> queue(later);
  auto lookup = [&](int32_t a, int32_t b) { return merges_.find(uint64_t(uint32_t(a)) << 32 | uint32_t(b)); };
  for (size_t i = 0; i + 1 < w.size(); ++i)
    if (auto m = lookup(w[i].c, w[i + 1].c); m != merges_.end()) queue.push({i, m->second.first, m->second.second});
  while (!queue.empty()) {
    const Merge top = queue.top();
    queue.pop();
    Sym& cur = w[top.pos];
    if (!cur.live || cur.next < 0) continue;
    const Sym right = w[size_t(cur.next)];
    auto m = lookup(cur.c, right.c);
    if (m == merges_.end() || m->second.second != top.id) continue;  // an outdated entry
    cur.c = top.id;
    w[size_t(cur.next)].live = false;
    cur.next = right.next;
    if (right.next >= 0) w[size_t(right.next)].prev = long(top.pos);
    if (cur.prev >= 0)
      if (auto p = lookup(w[size_t(cur.prev)].c, cur.c); p != merges_.end())
        queue.push({size_t(cur.prev), p->second.first, p->second.second});
    if (cur.next >= 0)
      if (auto n = lookup(cur.c, w[size_t(cur.next)].c); n != merges_.end())
        queue.push({top.pos, n->second.first, n->second.second});
  }
  std::vector<int32_t> ids;
  for (const Sym& s : w)
    if (s.live) ids.push_back(s.c);
  return ids;
}

std::string HfModel::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab_size || !known_[size_t(id)])
      user_error("tokenizer {}: token id {} is no token of it (ids 0 to {})", file, id, vocab_size - 1);
    out += bytes_[size_t(id)];
  }
  return out;
}

class HfTokenizer final : public Tokenizer {
 public:
  explicit HfTokenizer(std::shared_ptr<const HfModel> m) : m_(std::move(m)) {}
  std::string name() const override { return "tokenizer.json"; }
  int vocab_size() const override { return m_->vocab_size; }
  int eot() const override { return m_->eot; }
  Template special_template() const override { return m_->tmpl; }
  int32_t added_token_id(std::string_view content) const override {
    auto it = m_->added_ids.find(content);
    return it == m_->added_ids.end() ? -1 : it->second;
  }
  bool cuts_after_lone_newline() const override { return m_->cuts; }
  std::unique_ptr<Tokenizer> clone() const override { return std::make_unique<HfTokenizer>(m_); }
  std::string decode(const std::vector<int32_t>& ids) const override { return m_->decode(ids); }

  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int32_t> out;
    out.reserve(text.size() / 4);
    auto piece = [&](std::string_view p) {
      int32_t id;
      if (m_->whole_token(p, id)) {
        out.push_back(id);
        return;
      }
      std::lock_guard<std::mutex> lock(mu_);
      auto it = cache_.find(p);
      if (it == cache_.end()) {
        if (cache_.size() >= (size_t(1) << 20)) cache_.clear();  // bounded on any corpus
        it = cache_.emplace(std::string(p), m_->bpe(p)).first;
      }
      out.insert(out.end(), it->second.begin(), it->second.end());
    };
    m_->split(text, piece, [&](int32_t id) { out.push_back(id); });
    return out;
  }

 private:
  std::shared_ptr<const HfModel> m_;
  mutable std::mutex mu_;
  mutable std::unordered_map<std::string, std::vector<int32_t>, StrHash, std::equal_to<>> cache_;
};

}  // namespace

std::unique_ptr<Tokenizer> load_hf_tokenizer(const std::string& path) {
  const std::string file = find_hf_tokenizer(path);
  if (file.empty()) user_error("tokenizer {}: neither a tokenizer.json file nor a directory holding one", path);
  return std::make_unique<HfTokenizer>(std::make_shared<const HfModel>(hf::read_tokenizer_json(file)));
}

}  // namespace dtrain
