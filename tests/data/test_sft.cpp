// Fine-tuning data (`dtrain data sft`, docs/finetune.md): the built-in chat templates rendered and
// masked on a byte-level tokenizer.json made here (every byte its own token, the templates'
// special tokens added after them, so ids spell the text), the row checks, the .sft side files,
// the command's bad-row paths (exit 2 naming FILE:LINE; --skip-bad counting them in one line), and
// the judge: transformers' apply_chat_template with the template's Jinja from the output's
// tokenizer_config.json, on a BPE trained with `tokenizers` (tests/sft_ref.py), comparing ids and
// transformers' return_assistant_tokens_mask on every row of a generated corpus.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "data/chat_template.h"
#include "data/sft.h"
#include "data/sft_shards.h"
#include "data/token_shards.h"
#include "data/tokenizer.h"
#include "data/utf8.h"
#include "process_work_dir.h"
#include "run_cmd.h"
#include "skip.h"

using namespace dtrain;
using sft::Message;
using sft::Role;
namespace fs = std::filesystem;

namespace {

const std::vector<std::string> kSpecials = {"<|endoftext|>",     "<|im_start|>",        "<|im_end|>",
                                            "<|begin_of_text|>", "<|end_of_text|>",     "<|start_header_id|>",
                                            "<|end_header_id|>", "<|eot_id|>"};

const std::string& work() {
  static const std::string w = [] {
    const std::string d = process_work_dir("test_sft");
    fs::create_directories(d);
    return d;
  }();
  return w;
}

// A byte-level BPE tokenizer.json without merges: byte b is token b, kSpecials[k] is 256 + k.
std::string byte_tokenizer_json() {
  const std::string path = work() + "/bytes/tokenizer.json";
  if (fs::exists(path)) return path;
  fs::create_directories(work() + "/bytes");
  nlohmann::json vocab = nlohmann::json::object();
  char32_t n = 0;
  for (int b = 0; b < 256; ++b) {
    const bool keep = (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
    vocab[utf8::encode(keep ? char32_t(b) : 0x100 + n++)] = b;
  }
  nlohmann::json added = nlohmann::json::array();
  for (size_t k = 0; k < kSpecials.size(); ++k)
    added.push_back({{"id", 256 + k}, {"content", kSpecials[k]}, {"single_word", false}, {"lstrip", false},
                     {"rstrip", false}, {"normalized", false}, {"special", true}});
  const nlohmann::json byte_level = {
      {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", true}};
  const nlohmann::json j = {{"version", "1.0"},
                            {"truncation", nullptr},
                            {"padding", nullptr},
                            {"added_tokens", added},
                            {"normalizer", nullptr},
                            {"pre_tokenizer", byte_level},
                            {"post_processor", byte_level},
                            {"decoder", byte_level},
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
                              {"merges", nlohmann::json::array()}}}};
  std::ofstream(path) << j.dump(1);
  return path;
}

const Tokenizer& bytes_tok() {
  static const std::unique_ptr<Tokenizer> t = load_hf_tokenizer(byte_tokenizer_json());
  return *t;
}

int32_t sid(const std::string& special) {
  for (size_t k = 0; k < kSpecials.size(); ++k)
    if (kSpecials[k] == special) return int32_t(256 + k);
  return -1;
}

// The text of ids (specials by name) and the text of the targets alone.
std::string text_of(const std::vector<int32_t>& ids) { return bytes_tok().decode(ids); }
std::string targets_of(const sft::Encoded& e) {
  std::vector<int32_t> t;
  for (size_t i = 0; i < e.ids.size(); ++i)
    if (e.mask[i]) t.push_back(e.ids[i]);
  return text_of(t);
}
std::string rendered(const sft::ChatTemplate& t, const std::vector<Message>& m) {
  std::string s;
  for (const auto& p : t.render(m)) s += p.text;
  return s;
}

const std::vector<Message> kChat = {{Role::System, "Be brief."},
                                    {Role::User, " Hi\n"},
                                    {Role::Assistant, "\nHello! 😀 "},
                                    {Role::User, "2+2?"},
                                    {Role::Assistant, "4"}};

std::string slurp(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

std::string write_file(const std::string& name, const std::string& text) {
  const std::string p = work() + "/" + name;
  std::ofstream(p, std::ios::binary) << text;
  return p;
}

}  // namespace

TEST_SUITE("unit") {

TEST_CASE("sft template: chatml renders Qwen2's ChatML and masks each assistant content with its <|im_end|>") {
  const sft::ChatTemplate t("chatml", bytes_tok(), "");
  CHECK(rendered(t, kChat) ==
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n Hi\n<|im_end|>\n"
        "<|im_start|>assistant\n\nHello! 😀 <|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n");
  const sft::Encoded e = t.encode(kChat);
  REQUIRE(e.ids.size() == e.mask.size());
  CHECK(text_of(e.ids) == rendered(t, kChat));
  CHECK(targets_of(e) == "\nHello! 😀 <|im_end|>4<|im_end|>");
  CHECK(e.ids[0] == sid("<|im_start|>"));  // the special token's id, not its text's bytes
  CHECK(std::count(e.ids.begin(), e.ids.end(), sid("<|im_end|>")) == 5);
  // no system message: Qwen2's default system prompt
  const sft::Encoded d = t.encode({{Role::User, "q"}, {Role::Assistant, "a"}});
  CHECK(text_of(d.ids) ==
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nq<|im_end|>\n"
        "<|im_start|>assistant\na<|im_end|>\n");
  CHECK(targets_of(d) == "a<|im_end|>");
}

TEST_CASE("sft template: llama3 starts with <|begin_of_text|> and trims each content as Meta's template does") {
  const sft::ChatTemplate t("llama3", bytes_tok(), "");
  const sft::Encoded e = t.encode(kChat);
  CHECK(text_of(e.ids) ==
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello! 😀<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>");
  CHECK(e.ids[0] == sid("<|begin_of_text|>"));
  CHECK(targets_of(e) == "Hello! 😀<|eot_id|>4<|eot_id|>");
  CHECK(e.mask[0] == 0);
}

TEST_CASE("sft template: plain writes ### Prompt / ### Response with the end-of-text token as a target") {
  const sft::ChatTemplate t("plain", bytes_tok(), "<|endoftext|>");
  const sft::Encoded e = t.encode({{Role::System, ""}, {Role::User, "Q: why?"}, {Role::Assistant, "A: because."}});
  CHECK(text_of(e.ids) == "### Prompt:\nQ: why?\n\n### Response:\nA: because.<|endoftext|>");  // empty system: none
  CHECK(targets_of(e) == "A: because.<|endoftext|>");
  CHECK(e.ids.back() == sid("<|endoftext|>"));
  CHECK(rendered(t, kChat) == "Be brief.\n\n### Prompt:\n Hi\n\n\n### Response:\n\nHello! 😀 <|endoftext|>\n\n"
                              "### Prompt:\n2+2?\n\n### Response:\n4<|endoftext|>");
  // the byte tokenizer has no end-of-text token: the response ends without one
  const std::unique_ptr<Tokenizer> bytes = make_byte_tokenizer();
  const sft::ChatTemplate b("plain", *bytes, "");
  const sft::Encoded eb = b.encode({{Role::User, "x"}, {Role::Assistant, "y"}});
  CHECK(eb.ids.size() == std::string("### Prompt:\nx\n\n### Response:\ny").size());
  CHECK(eb.mask.back() == 1);
  CHECK(std::count(eb.mask.begin(), eb.mask.end(), 1) == 1);
}

TEST_CASE("sft template: a token that spans the end of a header and the start of a content is a target") {
  // a tokenizer whose merges join "\n" + "\n": GPT-2's pattern cuts "assistant\n" + "\n\nyes" into
  // "assistant", "\n\n", "\n", "yes", so the header's "\n" and the content's first one become one
  // token; transformers marks it (its mask runs from the token of the first target character), and
  // dtrain marks a token whose bytes overlap a target's
  const std::string dir = work() + "/merge";
  fs::create_directories(dir);
  nlohmann::json j = nlohmann::json::parse(slurp(byte_tokenizer_json()));
  j["model"]["vocab"]["ĊĊ"] = 256;
  j["model"]["merges"] = nlohmann::json::array({nlohmann::json::array({"Ċ", "Ċ"})});
  j["added_tokens"] = nlohmann::json::array();
  for (size_t k = 0; k < kSpecials.size(); ++k)
    j["added_tokens"].push_back({{"id", 257 + k}, {"content", kSpecials[k]}, {"single_word", false}, {"lstrip", false},
                                 {"rstrip", false}, {"normalized", false}, {"special", true}});
  std::ofstream(dir + "/tokenizer.json") << j.dump();
  const std::unique_ptr<Tokenizer> tok = load_hf_tokenizer(dir);
  const sft::ChatTemplate t("chatml", *tok, "");
  const sft::Encoded e = t.encode({{Role::User, "q"}, {Role::Assistant, "\n\nyes"}});
  // ... <|im_start|> a s s i s t a n t [\n\n] \n y e s <|im_end|> \n
  const size_t k = size_t(std::find(e.ids.begin(), e.ids.end(), 256) - e.ids.begin());
  REQUIRE(k < e.ids.size());
  CHECK(e.mask[k - 1] == 0);  // the 't' of "assistant"
  CHECK(e.mask[k] == 1);
  CHECK(e.mask[k + 1] == 1);
}

TEST_CASE("sft template: a template's special tokens must be added tokens of the tokenizer") {
  const std::unique_ptr<Tokenizer> bytes = make_byte_tokenizer();
  for (const char* name : {"chatml", "llama3"}) {
    CAPTURE(name);
    try {
      sft::ChatTemplate t(name, *bytes, "");
      FAIL("no error");
    } catch (const UserError& e) {
      CHECK(std::string(e.what()).find("does not have") != std::string::npos);
      CHECK(std::string(e.what()).find(name) != std::string::npos);
    }
  }
  CHECK_THROWS_AS(sft::ChatTemplate("plain", bytes_tok(), "<|no_such|>"), UserError);
  CHECK_THROWS_AS(sft::ChatTemplate("vicuna", bytes_tok(), ""), UserError);
  CHECK(sft::ChatTemplate::names() == std::vector<std::string>{"chatml", "llama3", "plain"});
  CHECK(sft::ChatTemplate::jinja("chatml").find("{% generation %}") != std::string::npos);
}

TEST_CASE("sft template: py_strip strips what Python's str.strip() strips") {
  CHECK(sft::py_strip(" \t\n\r\x0b\x0c\x1c\x1d\x1e\x1fx y\n") == "x y");
  CHECK(sft::py_strip("\xc2\x85\xc2\xa0\xe3\x80\x80x\xe2\x80\xa8\xe2\x80\xaf") == "x");  // NEL NBSP U+3000, U+2028 U+202F
  CHECK(sft::py_strip("\xe2\x80\x8bx") == "\xe2\x80\x8bx");  // U+200B is no white space
  CHECK(sft::py_strip("   ").empty());
  CHECK(sft::py_strip("é ") == "é");
}

TEST_CASE("sft rows: prompt/completion and messages rows are read and bad rows say why") {
  std::vector<Message> m;
  CHECK(data::parse_sft_row(R"({"prompt": "p", "completion": "c", "id": 7})", m).empty());
  REQUIRE(m.size() == 2);
  CHECK((m[0].role == Role::User && m[0].content == "p" && m[1].role == Role::Assistant && m[1].content == "c"));
  CHECK(data::parse_sft_row(
            R"({"messages": [{"role": "system", "content": ""}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]})",
            m)
            .empty());
  CHECK(m.size() == 3);
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"{not json", "not JSON"},
      {"[1, 2]", "not a JSON object"},
      {R"({"text": "x"})", "neither"},
      {R"({"prompt": "p"})", "no \"completion\""},
      {R"({"completion": "c"})", "no \"prompt\""},
      {R"({"prompt": "p", "completion": ""})", "empty completion"},
      {R"({"prompt": 3, "completion": "c"})", "\"prompt\" is not a string"},
      {R"({"prompt": "p", "completion": "c", "messages": []})", "both"},
      {R"({"messages": "hi"})", "not a list"},
      {R"({"messages": []})", "no messages"},
      {R"({"messages": [{"role": "user"}]})", "no \"content\""},
      {R"({"messages": [{"content": "x"}]})", "no \"role\""},
      {R"({"messages": [{"role": "tool", "content": "x"}]})", "unknown role \"tool\""},
      {R"({"messages": [{"role": "user", "content": null}]})", "\"content\" is not a string"},
      {R"({"messages": [{"role": "user", "content": "q"}]})", "not the assistant"},
      {R"({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]})", "empty content"},
      {R"({"messages": [{"role": "assistant", "content": "a"}]})", "not the user"},
      {R"({"messages": [{"role": "system", "content": "s"}]})", "only system"},
      {"{\"prompt\": \"\xff\", \"completion\": \"c\"}", "not UTF-8 (byte 0xff at column 13)"},
  };
  for (const auto& [line, why] : bad) {
    CAPTURE(line);
    const std::string got = data::parse_sft_row(line, m);
    CAPTURE(got);
    CHECK(got.find(why) != std::string::npos);
  }
}

TEST_CASE("sft shards: the .sft side file round-trips and a damaged one is refused") {
  const std::string p = work() + "/side.sft";
  SftSide s;
  s.starts = {0, 3, 7};
  s.mask = {0, 1, 1, 0, 0, 1, 1};
  write_sft_side(p, s);
  const SftSide r = read_sft_side(p, 7);
  CHECK(r.starts == s.starts);
  CHECK(r.mask == s.mask);
  CHECK(r.documents() == 2);
  CHECK(sft_side_path("d/train_000001.bin") == "d/train_000001.sft");
  CHECK_THROWS_AS(read_sft_side(p, 8), UserError);  // another shard's count
  std::string bytes = slurp(p);
  bytes[1024 + 12 + 2] = 9;  // a mask value of 9
  write_file("side_bad.sft", bytes);
  CHECK_THROWS_WITH_AS(read_sft_side(work() + "/side_bad.sft", 7), doctest::Contains("mask value 9"), UserError);
  bytes = slurp(p);
  write_file("side_short.sft", bytes.substr(0, bytes.size() - 1));
  CHECK_THROWS_WITH_AS(read_sft_side(work() + "/side_short.sft", 7), doctest::Contains("truncated"), UserError);
}

}  // TEST_SUITE("unit")

TEST_SUITE("integration") {

TEST_CASE("data sft: writes token shards the token loader reads and side files with one document per row") {
  const std::string in =
      write_file("ok.jsonl", "{\"prompt\": \"Q: a?\", \"completion\": \"A: b.\"}\n\n"
                             "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", "
                             "\"content\": \"yo\"}, {\"role\": \"user\", \"content\": \"and?\"}, {\"role\": "
                             "\"assistant\", \"content\": \"done\"}]}\r\n");
  const std::string out = work() + "/ok";
  const std::string tj = byte_tokenizer_json();
  const auto r = run_dtrain("data sft " + in + " --tokenizer " + tj + " --template chatml --out " + out +
                            " --shard-tokens 1024");
  REQUIRE_MESSAGE(r.code == 0, r.all());
  CHECK(r.out.find("2 document(s)") != std::string::npos);
  const TokenShard t = read_token_shard(out + "/train_000000.bin", bytes_tok().vocab_size());
  const SftSide s = read_sft_side(out + "/train_000000.sft", t.size());
  REQUIRE(s.documents() == 2);
  const sft::ChatTemplate tmpl("chatml", bytes_tok(), "");
  const sft::Encoded d0 = tmpl.encode({{Role::User, "Q: a?"}, {Role::Assistant, "A: b."}});
  REQUIRE(s.starts[1] == d0.ids.size());
  CHECK(std::vector<int32_t>(t.u16.begin(), t.u16.begin() + long(d0.ids.size())) == d0.ids);
  CHECK(std::vector<uint8_t>(s.mask.begin(), s.mask.begin() + long(d0.ids.size())) == d0.mask);
  // the token loader reads the shard as plain tokens
  TokenLoader loader({out + "/train_000000.bin"}, bytes_tok().vocab_size(), 2, 16, 0, 1, 1);
  CHECK(loader.total_tokens() == int64_t(t.size()));
  const nlohmann::json m = nlohmann::json::parse(slurp(out + "/manifest.json"));
  CHECK(m["sft"]["template"] == "chatml");
  CHECK(m["train"]["documents"] == 2);
  CHECK(m["train"]["side_files"][0] == "train_000000.sft");
  // the template's Jinja travels in tokenizer_config.json, as transformers reads it
  const nlohmann::json cfg = nlohmann::json::parse(slurp(out + "/tokenizer_config.json"));
  CHECK(cfg["chat_template"] == sft::ChatTemplate::jinja("chatml"));
  CHECK(fs::exists(out + "/tokenizer.json"));
  // a second split beside it; another template in the same directory is refused
  const auto v = run_dtrain("data sft " + in + " --tokenizer " + tj + " --template chatml --out " + out + " --split val");
  REQUIRE_MESSAGE(v.code == 0, v.all());
  CHECK(fs::exists(out + "/val_000000.sft"));
  CHECK(fs::exists(out + "/train_000000.sft"));
  const auto w = run_dtrain("data sft " + in + " --tokenizer " + tj + " --template llama3 --out " + out);
  CHECK(w.code == 2);
  CHECK(w.err.find("template chatml") != std::string::npos);
}

TEST_CASE("data sft: each kind of bad row exits 2 with one line naming the file and line") {
  const std::string tj = byte_tokenizer_json();
  const std::string good = R"({"prompt": "p", "completion": "c"})";
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"not json", "not JSON"},
      {R"({"prompt": "p"})", "no \"completion\""},
      {R"({"messages": [{"role": "user", "content": "q"}, {"role": "bot", "content": "a"}]})", "unknown role"},
      {R"({"prompt": "p", "completion": ""})", "empty completion"},
      {"{\"prompt\": \"caf\xe9\", \"completion\": \"c\"}", "not UTF-8"},
      {R"({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]})",
       "not the assistant"},
  };
  int k = 0;
  for (const auto& [line, why] : bad) {
    CAPTURE(line);
    const std::string in = write_file(fmt::format("bad{}.jsonl", k), good + "\n" + good + "\n" + line + "\n" + good + "\n");
    const auto r = run_dtrain("data sft " + in + " --tokenizer " + tj + " --template llama3 --out " + work() +
                              fmt::format("/bad{}", k++));
    CAPTURE(r.err);
    CHECK(r.code == 2);
    CHECK(r.err_lines() == 1);
    CHECK(r.err.find(in + ":3: ") != std::string::npos);
    CHECK(r.err.find(why) != std::string::npos);
  }
}

TEST_CASE("data sft: --skip-bad counts the bad rows in one line and writes the good ones") {
  const std::string tj = byte_tokenizer_json();
  const std::string good = R"({"prompt": "p", "completion": "c"})";
  const std::string in = write_file("mixed.jsonl", good + "\nnot json\n" + good + "\n" + R"({"prompt": "p"})" + "\n" +
                                                       "{\"prompt\": \"\xc3\", \"completion\": \"c\"}\n" + good + "\n");
  const std::string out = work() + "/mixed";
  const auto r = run_dtrain("data sft " + in + " --tokenizer " + tj + " --template plain --out " + out + " --skip-bad");
  REQUIRE_MESSAGE(r.code == 0, r.all());
  CHECK(r.err_lines() == 1);
  CHECK(r.err.find("skipped 3 bad row(s) of 6: " + in + ":2, " + in + ":4, " + in + ":5") != std::string::npos);
  CHECK(r.err.find("not JSON") != std::string::npos);  // the first one's reason
  const nlohmann::json m = nlohmann::json::parse(slurp(out + "/manifest.json"));
  CHECK(m["train"]["documents"] == 3);
  CHECK(m["train"]["skipped_rows"] == 3);
  CHECK(m["sft"]["eos_token"] == "<|endoftext|>");
  // every row bad: nothing to train on, exit 2
  const std::string all_bad = write_file("all_bad.jsonl", "x\ny\n");
  const auto b = run_dtrain("data sft " + all_bad + " --tokenizer " + tj + " --template plain --out " + work() +
                            "/all_bad --skip-bad");
  CHECK(b.code == 2);
  CHECK(b.err.find("no row to train on") != std::string::npos);
}

TEST_CASE("data sft: transformers' apply_chat_template gives the same ids and assistant mask on every row") {
  const std::string py = DTRAIN_SOURCE_DIR "/.venv/bin/python";
  const std::string probe = py + " -c 'import transformers, tokenizers, jinja2' 2>/dev/null";
  if (!fs::exists(py) || std::system(probe.c_str()) != 0)
    SKIP_TEST(py << " with transformers, tokenizers and jinja2 (scripts/setup.sh)");
  const std::string ref = DTRAIN_TEST_DIR "/sft_ref.py";
  const std::string dir = work() + "/judge";
  auto mk = run_cmd(py + " " + ref + " make " + dir + " 300");
  REQUIRE_MESSAGE(mk.code == 0, mk.all());
  // every template on the tokenizer with GPT-2's pattern, chatml and llama3 on Llama 3's too
  std::string dirs;
  for (const std::string tk : {"tokenizer.json", "l3/tokenizer.json"})
    for (const std::string name : {"chatml", "llama3", "plain"}) {
      if (tk != "tokenizer.json" && name == "plain") continue;
      const std::string out = dir + "/out_" + name + (tk == "tokenizer.json" ? "" : "_l3");
      const auto r = run_dtrain("data sft " + dir + "/corpus.jsonl --tokenizer " + dir + "/" + tk + " --template " +
                                name + " --out " + out);
      REQUIRE_MESSAGE(r.code == 0, r.all());
      dirs += " " + out;
    }
  const auto c = run_cmd(py + " " + ref + " check " + dir + "/corpus.jsonl" + dirs + " 2>&1");
  MESSAGE(c.out);
  CHECK_MESSAGE(c.code == 0, c.all());
  size_t equal = 0;
  for (size_t at = 0; (at = c.out.find("equal 300 rows", at)) != std::string::npos; ++at) ++equal;
  CHECK(equal == 5);
}

}  // TEST_SUITE("integration")
