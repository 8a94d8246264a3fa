// tokenizer.json files written here, no Python needed. Malformed ones (not JSON, cut short, not
// UTF-8, wrong types, missing keys, merges of unknown tokens) and those of a kind dtrain does not
// run: one UserError line naming the file and what is wrong, exit 2 from the CLI, never a crash.
// A small valid byte-level BPE: any bytes round-trip, one tokenizer shared by threads encodes as
// one alone, and `data tokenize` puts it beside the shards (an earlier run's tokenizer files go).
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "core/error.h"
#include "data/token_shards.h"
#include "data/tokenizer.h"
#include "run_cmd.h"

using namespace dtrain;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

const std::string kDir = DTRAIN_BUILD_DIR "/test_hf_tokenizer_json";

std::string utf8(char32_t c) {
  std::string s;
  if (c < 0x80)
    s.push_back(char(c));
  else
    s += {char(0xc0 | (c >> 6)), char(0x80 | (c & 0x3f))};  // byte symbols are < U+0800
  return s;
}

// A byte-level BPE: the 256 byte symbols (GPT-2's bytes_to_unicode), a few merges, <|endoftext|>.
json valid_tokenizer() {
  json vocab = json::object();
  int n = 0;
  for (int b = 0; b < 256; ++b) {
    const bool keep = (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
    vocab[utf8(keep ? char32_t(b) : char32_t(256 + n++))] = b;
  }
  const std::vector<std::pair<std::string, std::string>> merges = {
      {"\xc4\xa0", "t"}, {"h", "e"}, {"\xc4\xa0t", "he"}, {"i", "n"}, {"in", "g"}};  // Ġ t, h e, Ġt he, i n, in g
  json m = json::array();
  int id = 256;
  for (const auto& [a, b] : merges) {
    m.push_back({a, b});
    vocab[a + b] = id++;
  }
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens",
           {{{"id", id},
             {"content", "<|endoftext|>"},
             {"single_word", false},
             {"lstrip", false},
             {"rstrip", false},
             {"normalized", false},
             {"special", true}}}},
          {"normalizer", nullptr},
          {"pre_tokenizer",
           {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}}},
          {"post_processor",
           {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", false}, {"use_regex", true}}},
          {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
          {"model",
           {{"type", "BPE"},
            {"dropout", nullptr},
            {"unk_token", nullptr},
            {"continuing_subword_prefix", nullptr},
            {"end_of_word_suffix", nullptr},
            {"fuse_unk", false},
            {"byte_fallback", false},
            {"ignore_merges", false},
            {"vocab", vocab},
            {"merges", m}}}};
}

std::string write(const std::string& name, const std::string& text) {
  const std::string p = kDir + "/" + name;
  fs::create_directories(fs::path(p).parent_path());
  std::ofstream(p, std::ios::binary) << text;
  return p;
}

// The message of load_hf_tokenizer(path)'s UserError ("" when it loads).
std::string load_error(const std::string& path) {
  try {
    load_hf_tokenizer(path);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

// `j` changed by `edit`, written, loaded: the error names the file and holds `what`, on one line.
void check_refused(const std::string& name, const std::string& what, const std::function<void(json&)>& edit) {
  json j = valid_tokenizer();
  edit(j);
  const std::string path = write(name + ".json", j.dump());
  const std::string msg = load_error(path);
  CAPTURE(name);
  CHECK_MESSAGE(msg.rfind(path + ": ", 0) == 0, msg);
  CHECK_MESSAGE(msg.find(what) != std::string::npos, msg);
  CHECK(msg.find('\n') == std::string::npos);
}

// j's pre-tokenizer with a Split step before the ByteLevel one
json with_split(const json& j, const std::string& pattern) {
  const json split = {
      {"type", "Split"}, {"pattern", {{"Regex", pattern}}}, {"behavior", "Isolated"}, {"invert", false}};
  return {{"type", "Sequence"}, {"pretokenizers", {split, j["pre_tokenizer"]}}};
}

}  // namespace

TEST_SUITE("unit") {
TEST_CASE("hf tokenizer: a small byte-level BPE round-trips any bytes and is shared by threads") {
  const std::string path = write("valid.json", valid_tokenizer().dump());
  const auto tok = load_hf_tokenizer(path);
  CHECK(tok->name() == "tokenizer.json");
  CHECK(tok->vocab_size() == 256 + 5 + 1);
  CHECK(tok->eot() == 261);
  CHECK(tok->encode("<|endoftext|>") == std::vector<int32_t>{261});
  std::vector<int32_t> both = tok->encode(" the"), thing = tok->encode(" thing");
  both.insert(both.end(), thing.begin(), thing.end());
  CHECK(tok->encode(" the thing") == both);
  CHECK(tok->encode(" the").size() == 1);  // Ġ t, h e, Ġt he
  CHECK(tok->decode({261}) == "<|endoftext|>");
  CHECK_THROWS_WITH_AS(tok->decode({262}), doctest::Contains("token id 262"), UserError);
  std::mt19937 rng(11);
  std::vector<std::string> texts;
  for (int i = 0; i < 300; ++i) {
    std::string s;
    for (size_t k = 0, n = rng() % 64; k < n; ++k)
      s.push_back(char(rng() % 4 ? "the ing\n'"[rng() % 9] : char(rng())));
    texts.push_back(s);
  }
  std::vector<std::vector<int32_t>> one, many(texts.size());
  for (const auto& s : texts) {
    one.push_back(tok->encode(s));
    CHECK(tok->decode(one.back()) == s);  // invalid UTF-8 too: every byte has its symbol
  }
  std::vector<std::thread> th;
  for (size_t t = 0; t < 3; ++t)
    th.emplace_back([&, t] {
      for (size_t i = t; i < texts.size(); i += 3) many[i] = tok->encode(texts[i]);
    });
  for (auto& x : th) x.join();
  CHECK(many == one);
  // a directory holding tokenizer.json loads it
  fs::create_directories(kDir + "/model_dir");
  fs::copy_file(path, kDir + "/model_dir/tokenizer.json", fs::copy_options::overwrite_existing);
  CHECK(make_tokenizer(kDir + "/model_dir", "")->encode(" the thing") == both);
}

TEST_CASE("hf tokenizer: malformed files are one UserError line naming the file") {
  const std::string good = valid_tokenizer().dump();
  for (const auto& [name, text, what] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"truncated", good.substr(0, good.size() / 2), "not valid JSON"},
           {"empty", "", "not valid JSON"},
           {"garbage", "tokenizer = {", "not valid JSON"},
           {"latin1", "{\"model\": \"caf\xe9\"}", "not valid JSON"},
           {"array", "[1, 2]", "expected a JSON object"},
           {"deep", std::string(100000, '[') + std::string(100000, ']'), "nested deeper than 100 levels"}}) {
    const std::string path = write(name + ".json", text);
    const std::string msg = load_error(path);
    CAPTURE(name);
    CHECK_MESSAGE(msg.rfind(path + ": ", 0) == 0, msg);
    CHECK_MESSAGE(msg.find(what) != std::string::npos, msg);
    CHECK(msg.find('\n') == std::string::npos);
  }
  CHECK(load_error(kDir + "/missing.json").find("neither a tokenizer.json") != std::string::npos);
  fs::create_directories(kDir + "/empty_dir");
  CHECK_THROWS_WITH_AS(make_tokenizer(kDir + "/empty_dir", ""), doctest::Contains("holds no tokenizer.json"),
                       UserError);
  CHECK_THROWS_WITH_AS(make_tokenizer(kDir + "/nowhere", ""), doctest::Contains("no such file"), UserError);
}

TEST_CASE("hf tokenizer: wrong types and missing keys name the key") {
  check_refused("no_model", "missing key \"model\"", [](json& j) { j.erase("model"); });
  check_refused("no_vocab", "model: missing key \"vocab\"", [](json& j) { j["model"].erase("vocab"); });
  check_refused("no_merges_key", "model: missing key \"merges\"", [](json& j) { j["model"].erase("merges"); });
  check_refused("vocab_array", "model.vocab: expected an object",
                [](json& j) { j["model"]["vocab"] = json::array(); });
  check_refused("id_string", "model.vocab[\"!\"]: expected a token id",
                [](json& j) { j["model"]["vocab"]["!"] = "0"; });
  check_refused("id_negative", "expected a token id", [](json& j) { j["model"]["vocab"]["!"] = -1; });
  check_refused("id_huge", "expected a token id (an integer 0 to 16777215), got 2000000000",
                [](json& j) { j["model"]["vocab"]["!"] = 2000000000; });
  check_refused("added_id_huge", "added_tokens[0].id: expected a token id",
                [](json& j) { j["added_tokens"][0]["id"] = int64_t(1) << 40; });
  check_refused("merge_number", "model.merges[1]: expected a pair", [](json& j) { j["model"]["merges"][1] = 7; });
  check_refused("merge_triple", "model.merges[0]", [](json& j) { j["model"]["merges"][0] = {"a", "b", "c"}; });
  check_refused("merge_unknown", "model.merges[2]: token \"zz\" is not in model.vocab", [](json& j) {
    j["model"]["merges"][2] = {"zz", "y"};
  });
  check_refused("merge_result_unknown", "token \"ab\" is not in model.vocab", [](json& j) {
    j["model"]["merges"].push_back({"a", "b"});
  });
  check_refused("legacy_bad", "model.merges[1]: expected two tokens separated by one space", [](json& j) {
    j["model"]["merges"] = {"h e", "in  g"};
  });
  check_refused("legacy_mixed", "model.merges[1]", [](json& j) {
    j["model"]["merges"] = json::array({"h e", json::array({"i", "n"})});
  });
  check_refused("added_no_content", "added_tokens[0]: missing key \"content\"",
                [](json& j) { j["added_tokens"][0].erase("content"); });
  check_refused("added_flag", "added_tokens[0].lstrip: expected true or false",
                [](json& j) { j["added_tokens"][0]["lstrip"] = "yes"; });
  check_refused("added_twice", "listed twice", [](json& j) { j["added_tokens"].push_back(j["added_tokens"][0]); });
  check_refused("pre_no_type", "pre_tokenizer: missing key \"type\"",
                [](json& j) { j["pre_tokenizer"].erase("type"); });
  check_refused("split_no_behavior", "pre_tokenizer.pretokenizers[0]: missing key \"behavior\"", [](json& j) {
    const json split = {{"type", "Split"}, {"pattern", {{"Regex", "\\s+"}}}, {"invert", false}};
    j["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", {split, j["pre_tokenizer"]}}};
  });
  check_refused("split_behavior", "\"Sideways\": expected Removed, Isolated", [](json& j) {
    const json split = {
        {"type", "Split"}, {"pattern", {{"Regex", "x"}}}, {"behavior", "Sideways"}, {"invert", false}};
    j["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", {split, j["pre_tokenizer"]}}};
  });
  check_refused("template_missing", "special token \"<s>\" is not in post_processor.special_tokens", [](json& j) {
    const json single = {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                         {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}};
    j["post_processor"] = {{"type", "TemplateProcessing"}, {"single", single}, {"special_tokens", json::object()}};
  });
  check_refused("version", "version \"2.0\" is not supported", [](json& j) { j["version"] = "2.0"; });
}

TEST_CASE("hf tokenizer: what dtrain does not run is refused and named") {
  check_refused("wordpiece", "model.type \"WordPiece\" is not supported",
                [](json& j) { j["model"]["type"] = "WordPiece"; });
  check_refused("unigram", "model.type \"Unigram\" is not supported",
                [](json& j) { j["model"]["type"] = "Unigram"; });
  check_refused("dropout", "model.dropout 0.1 is not supported", [](json& j) { j["model"]["dropout"] = 0.1; });
  check_refused("byte_fallback", "model.byte_fallback true", [](json& j) { j["model"]["byte_fallback"] = true; });
  check_refused("prefix", "model.continuing_subword_prefix \"##\" is not supported",
                [](json& j) { j["model"]["continuing_subword_prefix"] = "##"; });
  check_refused("nfc", "normalizer NFC is not supported", [](json& j) { j["normalizer"] = {{"type", "NFC"}}; });
  check_refused("normalizers", "normalizer Sequence of \"NFKC\" is not supported", [](json& j) {
    j["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "NFKC"}}}}};
  });
  check_refused("whitespace", "pre_tokenizer Whitespace is not supported", [](json& j) {
    j["pre_tokenizer"] = {{"type", "Whitespace"}};
  });
  check_refused("no_pre", "pre_tokenizer null is not supported", [](json& j) { j["pre_tokenizer"] = nullptr; });
  check_refused("split_only", "pre_tokenizer without ByteLevel is not supported",
                [](json& j) { j["pre_tokenizer"] = with_split(j, "\\s+")["pretokenizers"][0]; });
  check_refused("bytelevel_first", "pre_tokenizer.pretokenizers[1] Digits after ByteLevel is not supported",
                [](json& j) {
                  const json digits = {{"type", "Digits"}, {"individual_digits", true}};
                  j["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", {j["pre_tokenizer"], digits}}};
                });
  check_refused("nested_class", "is not supported: a character class nested in a class",
                [](json& j) { j["pre_tokenizer"] = with_split(j, "[a-z[0-9]]+"); });
  check_refused("intersection", "is not supported: class intersection &&",
                [](json& j) { j["pre_tokenizer"] = with_split(j, "[a-z&&[^aeiou]]+"); });
  check_refused("bad_regex", "the pattern (unclosed is not supported: PCRE2 rejects it",
                [](json& j) { j["pre_tokenizer"] = with_split(j, "(unclosed"); });
  check_refused("roberta", "post_processor RobertaProcessing is not supported", [](json& j) {
    j["post_processor"] = {{"type", "RobertaProcessing"}};
  });
  check_refused("pair_only", "post_processor.single[0] Sequence B is not supported", [](json& j) {
    const json single = {{{"Sequence", {{"id", "B"}, {"type_id", 0}}}}};
    j["post_processor"] = {{"type", "TemplateProcessing"}, {"single", single}, {"special_tokens", json::object()}};
  });
  check_refused("decoder", "decoder WordPiece is not supported", [](json& j) {
    j["decoder"] = {{"type", "WordPiece"}};
  });
  check_refused("no_decoder", "decoder null is not supported", [](json& j) { j["decoder"] = nullptr; });
}

TEST_CASE("hf tokenizer: the CLI exits 2 with one line on a bad tokenizer.json") {
  json j = valid_tokenizer();
  j["model"]["type"] = "WordPiece";
  const std::string path = write("cli_wordpiece.json", j.dump());
  const std::string text = write("cli.txt", "hello\n");
  for (const std::string& cmd : {"data tokenize " + text + " --out " + kDir + "/cli_out --tokenizer " + path,
                                 "data tokenize " + text + " --out " + kDir + "/cli_out --tokenizer " +
                                     write("cli_cut.json", valid_tokenizer().dump().substr(0, 100))}) {
    auto r = run_dtrain(cmd);
    CHECK(r.code == 2);
    CHECK_MESSAGE(r.err_lines() == 1, r.err);
    CHECK_MESSAGE(r.err.find(kDir + "/cli_") != std::string::npos, r.err);
  }
}

TEST_CASE("data tokenize: a tokenizer.json travels with the shards and an earlier run's tokenizer files go") {
  const std::string tj = write("travel/tokenizer.json", valid_tokenizer().dump());
  const std::string text = write("travel.txt", " the thing\n");
  data::TokenizeSpec a;
  a.inputs = {text};
  a.out = kDir + "/travel_out";
  a.val_fraction = 0.0;
  a.tokenizer = fs::path(tj).parent_path().string();  // the directory holding it
  data::tokenize_files(a);
  const auto tok = load_hf_tokenizer(tj);
  std::vector<int32_t> want = {tok->eot()};  // no template: <|endoftext|> before the document
  for (int32_t id : tok->encode(" the thing\n")) want.push_back(id);
  const TokenShard s = read_token_shard(a.out + "/train_000000.bin", tok->vocab_size());
  CHECK(!s.wide);
  CHECK(std::vector<int32_t>(s.u16.begin(), s.u16.end()) == want);
  CHECK(fs::exists(a.out + "/tokenizer.json"));
  const json cfg = json::parse(std::ifstream(a.out + "/tokenizer_config.json"));
  CHECK(cfg["tokenizer_class"] == "PreTrainedTokenizerFast");  // AutoTokenizer keeps tokenizer.json as it is
  const json m = json::parse(std::ifstream(a.out + "/manifest.json"));
  CHECK(m["tokenizer"] == "tokenizer.json");
  CHECK(m["vocab_files"] == json({"tokenizer.json", "tokenizer_config.json"}));
  CHECK(m["document_tokens"]["before"] == json({tok->eot()}));
  a.tokenizer = "byte";
  data::tokenize_files(a);
  CHECK(!fs::exists(a.out + "/tokenizer.json"));
  CHECK(!fs::exists(a.out + "/tokenizer_config.json"));
  CHECK(json::parse(std::ifstream(a.out + "/manifest.json"))["tokenizer"] == "byte");
}

}  // TEST_SUITE
