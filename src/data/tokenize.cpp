// `dtrain data tokenize`: text files -> llm.c token shards (data/token_shards.h).
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

#include "core/error.h"
#include "core/failpoint.h"
#include "core/log.h"
#include "core/progress.h"
#include "data/token_shards.h"
#include "data/tokenizer.h"

namespace dtrain {

namespace {

namespace fs = std::filesystem;

// An ASCII character that is not white space (a byte >= 0x80 may belong to a Unicode space,
// which GPT-2's \s matches, so it never counts).
bool ascii_solid(char c) {
  const auto u = static_cast<unsigned char>(c);
  return u < 0x80 && std::isspace(u) == 0;
}

// Where a piece of text may end so that encoding the pieces one by one gives the ids of the
// whole: after a lone '\n' between two non-space ASCII characters. GPT-2's pre-tokenizer
// then makes that '\n' a token of its own, whether the text goes on or ends there, and the
// next token starts right after it. (A longer whitespace run before the end of a piece would
// be one token there but two in the whole text.) The last such position at or before
// `target`, else the first after it; npos when there is none.
size_t cut_point(const std::string& text, size_t target) {
  auto ok = [&](size_t p) { return p >= 2 && text[p - 1] == '\n' && ascii_solid(text[p]) && ascii_solid(text[p - 2]); };
  for (size_t p = std::min(target, text.size() - 1); p >= 2; --p)
    if (ok(p)) return p;
  for (size_t p = target + 1; p < text.size(); ++p)
    if (ok(p)) return p;
  return std::string::npos;
}

// The documents as pieces, in order: a document's first piece starts it, its last ends it.
struct Piece {
  bool doc_start = false, doc_end = false;
  std::string text;
};

// Every token in order, spooled to a file beside the shards, so memory stays a few pieces
// whatever the corpus size; the shards are cut from it once the total is known. Tokens are
// uint16, or uint32 (wide) for a vocabulary beyond 65536 ids.
class TokenSpool {
 public:
  TokenSpool(std::string path, bool wide)
      : path_(std::move(path)), wide_(wide), f_(path_, std::ios::binary | std::ios::trunc) {
    if (!f_) fault("data tokenize: cannot create {}", path_);
  }
  ~TokenSpool() {
    f_.close();
    std::error_code ec;
    fs::remove(path_, ec);
  }
  void append(const std::vector<int32_t>& t) {
    if (wide_) {
      f_.write(reinterpret_cast<const char*>(t.data()), std::streamsize(t.size() * 4));
    } else {
      std::vector<uint16_t> u16(t.begin(), t.end());
      f_.write(reinterpret_cast<const char*>(u16.data()), std::streamsize(u16.size() * 2));
    }
    if (!f_) fault("data tokenize: cannot write {}", path_);
    n_ += t.size();
  }
  size_t size() const { return n_; }
  // Tokens [begin, begin + n) as a shard at `path`.
  void write_shard(const std::string& path, size_t begin, size_t n) {
    if (wide_) write<uint32_t>(path, begin, n);
    else write<uint16_t>(path, begin, n);
  }

 private:
  template <class T>
  void write(const std::string& path, size_t begin, size_t n) {
    f_.flush();
    std::ifstream in(path_, std::ios::binary);
    in.seekg(std::streamoff(begin * sizeof(T)));
    std::vector<T> t(n);
    in.read(reinterpret_cast<char*>(t.data()), std::streamsize(n * sizeof(T)));
    if (size_t(in.gcount()) != n * sizeof(T)) fault("data tokenize: cannot read back {}", path_);
    write_token_shard(path, t.data(), n);
  }

  std::string path_;
  bool wide_;
  std::ofstream f_;
  size_t n_ = 0;
};

class Encoder {
 public:
  Encoder(const data::TokenizeSpec& a, int workers) {
    toks_.push_back(make_tokenizer(a.tokenizer, a.vocab));
    for (int i = 1; i < workers; ++i) toks_.push_back(toks_[0]->clone());  // a cache each
    // what marks a document: the post-processor's template, else <|endoftext|> before it
    const Tokenizer::Template t = toks_[0]->special_template();
    before_ = t.before, after_ = t.after;
    if (t.empty() && toks_[0]->eot() >= 0) before_ = {toks_[0]->eot()};
  }
  const Tokenizer& tokenizer() const { return *toks_[0]; }
  const std::vector<int32_t>& before() const { return before_; }
  const std::vector<int32_t>& after() const { return after_; }
  // Encodes the pieces on the worker threads and appends their ids, in order, to `out`.
  void run(std::vector<Piece>& pieces, TokenSpool& out) {
    std::vector<std::vector<int32_t>> ids(pieces.size());
    const size_t w = std::min(toks_.size(), pieces.size());
    std::vector<std::thread> th;
    for (size_t t = 0; t < w; ++t)
      th.emplace_back([&, t] {
        for (size_t i = t; i < pieces.size(); i += w) ids[i] = toks_[t]->encode(pieces[i].text);
      });
    for (auto& x : th) x.join();
    std::vector<int32_t> all;
    for (size_t i = 0; i < pieces.size(); ++i) {
      all.clear();
      if (pieces[i].doc_start) all.insert(all.end(), before_.begin(), before_.end());
      all.insert(all.end(), ids[i].begin(), ids[i].end());
      if (pieces[i].doc_end) all.insert(all.end(), after_.begin(), after_.end());
      out.append(all);
    }
    pieces.clear();
  }

 private:
  std::vector<std::unique_ptr<Tokenizer>> toks_;
  std::vector<int32_t> before_, after_;
};

// The text files an INPUT names: a file as it is; a directory's regular files in byte order of
// their names (not recursive), less those that are binary (a NUL byte in the first 8 KiB, as
// git decides, e.g. strfile's .dat indexes beside fortunes) and those already taken under
// another name (a symlink such as fortunes' art.u8 -> art). A path that does not exist or a
// directory with no text file is a user error naming it.
std::vector<std::string> input_files(const std::vector<std::string>& inputs) {
  std::vector<std::string> files;
  std::vector<fs::path> seen;
  auto take = [&](const fs::path& p) {
    std::error_code ec;
    const fs::path real = fs::canonical(p, ec);
    if (!ec && std::find(seen.begin(), seen.end(), real) != seen.end()) return false;
    if (!ec) seen.push_back(real);
    files.push_back(p.string());
    return true;
  };
  for (const auto& in : inputs) {
    std::error_code ec;
    if (!fs::is_directory(in, ec)) {
      if (!fs::exists(in, ec)) user_error("data tokenize: input {} does not exist", in);
      take(in);
      continue;
    }
    std::vector<fs::path> entries;
    for (const auto& e : fs::directory_iterator(in, ec))
      if (e.is_regular_file(ec)) entries.push_back(e.path());
    if (ec) user_error("data tokenize: cannot list input directory {}: {}", in, ec.message());
    std::sort(entries.begin(), entries.end());
    size_t taken = 0, binary = 0;
    for (const auto& e : entries) {
      std::ifstream f(e, std::ios::binary);
      std::string head(8192, '\0');
      f.read(head.data(), std::streamsize(head.size()));
      head.resize(size_t(f.gcount()));
      if (head.find('\0') != std::string::npos) {
        ++binary;
        continue;
      }
      taken += take(e) ? 1 : 0;
    }
    if (taken == 0) user_error("data tokenize: input directory {} holds no text file ({} binary)", in, binary);
    log::info("data tokenize: {}: {} text files ({} binary, {} aliases skipped)", in, taken, binary,
              entries.size() - taken - binary);
  }
  return files;
}

}  // namespace

std::vector<std::string> data::copy_tokenizer_files(const CopyTokenizer& a, const Tokenizer& tok) {
  std::vector<std::pair<std::string, std::string>> files;  // source, name
  if (tok.name() == "gpt2") {
    const Gpt2VocabFiles vf = find_gpt2_vocab(a.vocab);
    files = {{vf.encoder, fs::path(vf.encoder).filename().string()},
             {vf.merges, fs::path(vf.merges).filename().string()}};
  } else if (tok.name() == "tokenizer.json") {
    const std::string tj = find_hf_tokenizer(a.tokenizer);
    files = {{tj, "tokenizer.json"}};
    if (const fs::path cfg = fs::path(tj).parent_path() / "tokenizer_config.json";
        fs::path(tj).filename() == "tokenizer.json" && fs::is_regular_file(cfg))
      files.emplace_back(cfg.string(), "tokenizer_config.json");
  }
  std::error_code ec;
  std::vector<std::string> names;
  for (const char* stale :
       {"encoder.json", "vocab.bpe", "vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json"}) {
    const fs::path p = fs::path(a.out) / stale;
    const bool ours = std::any_of(files.begin(), files.end(), [&](const auto& f) { return f.second == stale; });
    const bool source =
        std::any_of(files.begin(), files.end(), [&](const auto& f) { return fs::equivalent(f.first, p, ec); });
    if (!ours && !source && fs::remove(p, ec))
      log::info("{}: removed {} (an earlier run's tokenizer file)", a.who, p.string());
  }
  for (const auto& [src, name] : files) {
    const fs::path dst = fs::path(a.out) / name;
    if (!fs::equivalent(src, dst, ec)) fs::copy_file(src, dst, fs::copy_options::overwrite_existing, ec);
    if (ec) fault("{}: cannot copy {} to {}: {}", a.who, src, dst.string(), ec.message());
    names.push_back(name);
  }
  if (tok.name() == "tokenizer.json" && files.size() == 1) {
    // without one, AutoTokenizer would build the tokenizer class of the checkpoint's config.json
    // (GPT-2's, which adds <|endoftext|> where the vocabulary has none); this keeps tokenizer.json as it is
    std::ofstream cfg(fs::path(a.out) / "tokenizer_config.json");
    cfg << "{\n  \"tokenizer_class\": \"PreTrainedTokenizerFast\"\n}\n";
    if (!cfg) fault("{}: cannot write {}/tokenizer_config.json", a.who, a.out);
    names.push_back("tokenizer_config.json");
  }
  return names;
}

void data::tokenize_files(const data::TokenizeSpec& spec) {
  data::TokenizeSpec a = spec;
  if (!a.inputs.empty()) a.inputs = input_files(a.inputs);
  if (a.inputs.empty()) user_error("data tokenize: give at least one INPUT text file");
  if (a.out.empty()) user_error("data tokenize: --out DIR is required");
  if (!(a.val_fraction >= 0.0 && a.val_fraction < 1.0))
    user_error("--val-fraction: expected a value in [0, 1), got {}", a.val_fraction);
  if (a.shard_tokens < 1024 || a.shard_tokens > int64_t(INT32_MAX))
    user_error("--shard-tokens: expected 1024 to {}, got {}", INT32_MAX, a.shard_tokens);
  const int workers = a.workers > 0 ? a.workers : std::max(1, int(std::thread::hardware_concurrency()));
  // Piece size: a few MB (tests make it tiny to cut the text often).
  size_t piece = size_t(4) << 20;
  if (const auto* p = failpoint::get(failpoint::Point::TokenizePiece)) piece = std::max<size_t>(2, size_t((*p)[0]));
  Encoder enc(a, workers);
  const Tokenizer& tok = enc.tokenizer();
  const bool cut = tok.cuts_after_lone_newline();
  if (!cut)
    log::info("data tokenize: this tokenizer's pre-tokenizer may join text across lines: each file is encoded whole");
  if (enc.before().empty() && enc.after().empty() && tok.name() != "byte")
    log::warn("data tokenize: the tokenizer has no <|endoftext|> and adds no special tokens: the documents follow each "
              "other unmarked");
  const bool wide = tok.vocab_size() > 65536;
  std::error_code ec;
  fs::create_directories(a.out, ec);
  if (ec) user_error("data tokenize: cannot create --out {}: {}", a.out, ec.message());
  TokenSpool all((fs::path(a.out) / ".tokens.tmp").string(), wide);
  std::vector<Piece> pending;
  size_t pending_bytes = 0;
  auto flush_if = [&](bool force) {
    if (force || pending_bytes >= piece * size_t(workers) * 2) {
      enc.run(pending, all);
      pending_bytes = 0;
    }
  };
  std::vector<char> block(std::max<size_t>(piece, 1 << 16));
  int64_t input_bytes = 0;
  for (const auto& in : a.inputs)
    if (const auto n = fs::file_size(in, ec); !ec) input_bytes += int64_t(n);
  Progress progress("tokenize", input_bytes, "bytes");
  for (const auto& in : a.inputs) {
    std::ifstream f(in, std::ios::binary);
    if (!f) user_error("data tokenize: cannot open input {}", in);
    std::string buf;
    bool first = true;
    auto emit = [&](std::string text, bool last) {
      pending_bytes += text.size();
      pending.push_back({first, last, std::move(text)});
      first = false;
      flush_if(false);
    };
    while (f) {
      f.read(block.data(), std::streamsize(block.size()));
      buf.append(block.data(), size_t(f.gcount()));
      progress.add(int64_t(f.gcount()));
      while (cut && buf.size() > piece) {
        const size_t p = cut_point(buf, piece);
        if (p == std::string::npos) break;  // no cut yet: read on
        emit(buf.substr(0, p), false);
        buf.erase(0, p);
      }
    }
    if (f.bad()) user_error("data tokenize: cannot read input {}", in);
    emit(std::move(buf), true);
  }
  flush_if(true);
  progress.finish();

  const size_t nval = size_t(std::ceil(a.val_fraction * double(all.size())));
  for (const auto& e : fs::directory_iterator(a.out, ec)) {  // shards of an earlier run would be read too
    const std::string n = e.path().filename().string();
    if ((n.rfind("train_", 0) == 0 || n.rfind("val_", 0) == 0) && e.path().extension() == ".bin") fs::remove(e.path());
  }
  all.write_shard((fs::path(a.out) / "val_000000.bin").string(), 0, nval);
  std::vector<std::string> train_files;
  const size_t ntrain = all.size() - nval;
  for (size_t off = 0; off < ntrain || train_files.empty(); off += size_t(a.shard_tokens)) {
    const std::string name = fmt::format("train_{:06d}.bin", train_files.size());
    all.write_shard((fs::path(a.out) / name).string(), nval + off, std::min(size_t(a.shard_tokens), ntrain - off));
    train_files.push_back(name);
  }
  // The tokenizer's files travel with the shards: the trainer puts them into every checkpoint
  // (Hugging Face's names) and `dtrain sample` finds them without --vocab.
  const std::vector<std::string> vocab_files = copy_tokenizer_files({a.tokenizer, a.vocab, a.out, "data tokenize"}, tok);
  nlohmann::json m;
  m["format"] = wide ? "llm.c token shards (magic 20240801, version 7, uint32 tokens)"
                     : "llm.c token shards (magic 20240520, version 1, uint16 tokens)";
  m["tokenizer"] = tok.name();
  m["vocab_size"] = tok.vocab_size();
  m["eot"] = tok.eot();
  if (!enc.before().empty() || !enc.after().empty())
    m["document_tokens"] = {{"before", enc.before()}, {"after", enc.after()}};
  if (!vocab_files.empty()) m["vocab_files"] = vocab_files;
  m["inputs"] = a.inputs;
  m["train"] = {{"files", train_files}, {"tokens", ntrain}};
  m["val"] = {{"files", {"val_000000.bin"}}, {"tokens", nval}};
  std::ofstream mf(fs::path(a.out) / "manifest.json");
  mf << m.dump(2) << "\n";
  if (!mf) fault("data tokenize: cannot write {}/manifest.json", a.out);
  log::console(fmt::format("tokenized {} file(s) with {} on {} thread(s): {} train tokens in {} shard(s) + {} val "
                           "tokens -> {}",
                           a.inputs.size(), tok.name(), workers, ntrain, train_files.size(), nval, a.out));
}

}  // namespace dtrain
