// The Llama family's checkpoints read by transformers: a tiny Llama (grouped-query, untied head,
// Llama 3.1 rope scaling) and a tiny Qwen2 (multi-query, tied head, rope_theta 1e6) trained a
// few steps by dtrain; AutoModelForCausalLM.from_pretrained(checkpoint dir) builds the class its
// config.json names, gives dtrain's evaluation loss on the same windows and `dtrain sample`'s
// greedy continuations. SKIPPED without DTRAIN_SOURCE_DIR/.venv/bin/python.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>

#include "sample_fixture.h"
#include "skip.h"
#include "train_fixtures.h"

namespace {

const std::string kLlamaPy = std::string(DTRAIN_SOURCE_DIR) + "/.venv/bin/python";
const std::string kLlamaCheck = std::string(DTRAIN_TEST_DIR) + "/llama_hf_check.py";

// Byte-level token shards of README.md (train / val), once per work directory.
std::string byte_tokens(const std::string& work) {
  const std::string tok = work + "/tok";
  auto tk = run_cmd(kBin + " data tokenize " + std::string(DTRAIN_SOURCE_DIR) + "/README.md --out " + tok +
                    " --tokenizer byte --val-fraction 0.2");
  REQUIRE_MESSAGE(tk.code == 0, tk.all());
  return tok;
}

std::string llama_recipe(const std::string& work, const std::string& name, const std::string& model_keys,
                         const std::string& tok, int steps) {
  const std::string path = work + "/" + name + ".toml";
  std::ofstream f(path);
  f << "[run]\nname = \"" << name << "\"\nout_dir = \"" << work << "/runs\"\ndevice = \"cpu\"\nthreads = 1\nseed = 3\n"
    << "[model]\nkind = \"gpt\"\nn_layer = 2\nn_head = 4\nn_embd = 32\nblock_size = 32\nvocab_size = 256\n"
    << model_keys << "\n"
    << "[data]\nkind = \"tokens\"\npath = \"" << tok << "\"\neval_split = \"val\"\n"
    << "[train]\nbatch_size = 4\nmax_steps = " << steps << "\n[optim]\nname = \"adamw\"\nlr = 1e-2\nweight_decay = 0.0\n"
    << "[checkpoint]\nevery_steps = " << steps << "\n"
    << "[eval]\nevery_steps = " << steps << "\nbatch_size = 4\nmax_batches = 3\n[log]\ntensorboard = false\n";
  return path;
}

double after(const std::string& text, const std::string& re) {
  std::smatch m;
  REQUIRE_MESSAGE(std::regex_search(text, m, std::regex(re)), "no '" << re << "' in " << text);
  return std::stod(m[1].str());
}

// Trains `name` for a few steps, then compares its checkpoint in transformers.
void trained_checkpoint_in_transformers(const std::string& name, const std::string& model_keys,
                                        const std::string& hf_class) {
  const std::string work = std::string(DTRAIN_BUILD_DIR) + "/test_train/llamahf_" + name;
  stdfs::remove_all(work);
  stdfs::create_directories(work);
  const std::string tok = byte_tokens(work);
  const int steps = 30;
  auto t = run_cmd(kBin + " train " + llama_recipe(work, name, model_keys, tok, steps));
  REQUIRE_MESSAGE(t.code == 0, t.all());
  const std::string run = work + "/runs/" + name;
  const std::string ck = run + "/checkpoints/step_00000030";
  const nlohmann::json cj = nlohmann::json::parse(slurp(ck + "/config.json"));
  CHECK(cj.at("architectures")[0] == hf_class);
  CHECK(cj.at("torch_dtype") == "float32");
  const std::vector<std::string> prompts = {"The ", "dtrain", "A run"};
  auto py = run_cmd(kLlamaPy + " " + kLlamaCheck + " check " + ck + " " + tok + "/val_000000.bin 32 12 12 '" +
                    prompts[0] + "' '" + prompts[1] + "' '" + prompts[2] + "'");
  REQUIRE_MESSAGE(py.code == 0, py.all());
  CHECK_MESSAGE(py.out.find("arch " + hf_class + "\n") != std::string::npos, py.out);
  const std::vector<double> ev = eval_losses(run);
  REQUIRE(!ev.empty());
  const double loss = ev.back(), hf_loss = after(py.out, "loss ([0-9.]+)");
  MESSAGE(name << ": dtrain eval loss " << loss << ", transformers (float64) " << hf_loss << ", relative "
               << std::abs(loss - hf_loss) / hf_loss);
  CHECK(std::abs(loss - hf_loss) <= 1e-5 * hf_loss);
  CHECK(loss < 5.0);  // trained: below an untrained byte model's ln(256) = 5.5
  for (size_t i = 0; i < prompts.size(); ++i) {
    const std::string hex = greedy_hex(kBin, ck, prompts[i], 12);
    CHECK_MESSAGE(py.out.find("greedy " + std::to_string(i) + " " + hex + "\n") != std::string::npos,
                  py.out << " vs dtrain " << hex);
  }
}

}  // namespace

TEST_SUITE("integration") {

TEST_CASE("interop: a trained Llama (GQA untied llama3 rope) checkpoint in transformers gives dtrain's loss and greedy text") {
  if (!stdfs::exists(kLlamaPy)) SKIP_TEST("no " << kLlamaPy);
  trained_checkpoint_in_transformers(
      "llama_gqa",
      "arch = \"llama\"\nn_kv_head = 2\nintermediate_size = 48\nrms_norm_eps = 1e-5\nrope_scaling = \"llama3\"\n"
      "rope_factor = 4.0\nrope_low_freq_factor = 1.0\nrope_high_freq_factor = 2.0\nrope_original_max_positions = 16\n",
      "LlamaForCausalLM");
}

TEST_CASE("interop: a trained Qwen2 (MQA tied) checkpoint in transformers gives dtrain's loss and greedy text") {
  if (!stdfs::exists(kLlamaPy)) SKIP_TEST("no " << kLlamaPy);
  trained_checkpoint_in_transformers(
      "qwen2_tied", "arch = \"qwen2\"\nn_kv_head = 1\nrope_theta = 1e6\ntie_word_embeddings = true\n",
      "Qwen2ForCausalLM");
}
}

namespace {

// The model keys of the models llama_hf_check.py saves.
const char* const kHfLlamaKeys =
    "arch = \"llama\"\nn_kv_head = 2\nintermediate_size = 48\nrms_norm_eps = 1e-5\nrope_scaling = \"llama3\"\n"
    "rope_factor = 4.0\nrope_low_freq_factor = 1.0\nrope_high_freq_factor = 2.0\nrope_original_max_positions = 16\n";
const char* const kHfQwen2Keys =
    "arch = \"qwen2\"\nn_kv_head = 1\nintermediate_size = 48\nrope_theta = 1e6\ntie_word_embeddings = true\n";

// transformers saves a random model (sharded when shard_bytes > 0); dtrain import, sample on
// the directory and model.init_from give transformers' loss and greedy text.
void hf_model_into_dtrain(const std::string& kind, const std::string& keys, int shard_bytes) {
  const std::string work = std::string(DTRAIN_BUILD_DIR) + "/test_train/hfllama_" + kind;
  stdfs::remove_all(work);
  stdfs::create_directories(work);
  const std::string tok = byte_tokens(work), hf = work + "/hf";
  auto sv = run_cmd(kLlamaPy + " " + kLlamaCheck + " save " + hf + " " + kind + " " + std::to_string(shard_bytes));
  REQUIRE_MESSAGE(sv.code == 0, sv.all());
  MESSAGE(sv.out);
  CHECK(stdfs::exists(hf + "/model.safetensors.index.json") == (shard_bytes > 0));
  const std::vector<std::string> prompts = {"The ", "dtrain", "A run"};
  auto py = run_cmd(kLlamaPy + " " + kLlamaCheck + " check " + hf + " " + tok + "/val_000000.bin 32 12 12 '" +
                    prompts[0] + "' '" + prompts[1] + "' '" + prompts[2] + "'");
  REQUIRE_MESSAGE(py.code == 0, py.all());
  // dtrain import llama: the step-0 checkpoint's greedy text is transformers'
  auto im = run_cmd(kBin + " import llama " + hf + " --out " + work + "/imported");
  REQUIRE_MESSAGE(im.code == 0, im.all());
  for (size_t i = 0; i < prompts.size(); ++i) {
    const std::string hex = greedy_hex(kBin, work + "/imported", prompts[i], 12);
    CHECK_MESSAGE(py.out.find("greedy " + std::to_string(i) + " " + hex + "\n") != std::string::npos,
                  py.out << " vs dtrain " << hex);
  }
  // dtrain sample on the Hugging Face directory itself
  const std::string hex = greedy_hex(kBin, hf, prompts[0], 12);
  CHECK_MESSAGE(py.out.find("greedy 0 " + hex + "\n") != std::string::npos, py.out << " vs dtrain " << hex);
  // model.init_from = the directory: the evaluation after one step of lr 1e-12 is transformers' loss
  const std::string name = "init_" + kind;
  auto t = run_cmd(kBin + " train " +
                   llama_recipe(work, name, keys + std::string("init_from = \"") + hf + "\"\n", tok, 1) +
                   " --set optim.lr=1e-12");
  REQUIRE_MESSAGE(t.code == 0, t.all());
  CHECK_MESSAGE(t.all().find("initialised from") != std::string::npos, t.all());
  const std::vector<double> ev = eval_losses(work + "/runs/" + name);
  REQUIRE(!ev.empty());
  const double hf_loss = after(py.out, "loss ([0-9.]+)");
  MESSAGE(kind << ": dtrain eval loss after init_from " << ev.back() << ", transformers (float64) " << hf_loss
               << ", relative " << std::abs(ev.back() - hf_loss) / hf_loss);
  CHECK(std::abs(ev.back() - hf_loss) <= 1e-5 * hf_loss);
  // a recipe that builds another model than config.json describes is refused, naming the field and key
  auto other = run_cmd(kBin + " train " +
                       llama_recipe(work, "other_" + kind, keys + std::string("init_from = \"") + hf + "\"\n", tok, 1) +
                       " --set model.rms_norm_eps=1e-3");
  CHECK(other.code == 2);
  CHECK_MESSAGE(other.err.find("rms_norm_eps") != std::string::npos, other.err);
  CHECK_MESSAGE(other.err.find("model.rms_norm_eps") != std::string::npos, other.err);
}

// A copy of `hf` whose config.json has `field` set to the JSON `value`.
std::string with_field(const std::string& hf, const std::string& dir, const std::string& field, const std::string& value) {
  stdfs::remove_all(dir);
  stdfs::create_directories(dir);
  for (const auto& e : stdfs::directory_iterator(hf)) stdfs::copy(e.path(), dir / e.path().filename());
  nlohmann::json j = nlohmann::json::parse(slurp(hf + "/config.json"));
  j[field] = nlohmann::json::parse(value);
  std::ofstream(dir + "/config.json") << j.dump(2);
  return dir;
}

}  // namespace

TEST_SUITE("integration") {

TEST_CASE("interop: a sharded Hugging Face Llama (GQA untied llama3 rope) imports and initialises with transformers' loss") {
  if (!stdfs::exists(kLlamaPy)) SKIP_TEST("no " << kLlamaPy);
  hf_model_into_dtrain("llama", kHfLlamaKeys, 40000);
}

TEST_CASE("interop: a Hugging Face Qwen2 (MQA tied) imports and initialises with transformers' loss") {
  if (!stdfs::exists(kLlamaPy)) SKIP_TEST("no " << kLlamaPy);
  hf_model_into_dtrain("qwen2", kHfQwen2Keys, 0);
}

TEST_CASE("interop: a Hugging Face config.json dtrain does not build is refused naming the field") {
  if (!stdfs::exists(kLlamaPy)) SKIP_TEST("no " << kLlamaPy);
  const std::string work = std::string(DTRAIN_BUILD_DIR) + "/test_train/hfllama_refuse";
  stdfs::remove_all(work);
  stdfs::create_directories(work);
  auto sv = run_cmd(kLlamaPy + " " + kLlamaCheck + " save " + work + "/hf qwen2 0");
  REQUIRE_MESSAGE(sv.code == 0, sv.all());
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"hidden_act", "\"gelu\""},
      {"attention_dropout", "0.1"},
      {"use_sliding_window", "true"},
      {"rope_scaling", R"({"rope_type": "yarn", "factor": 4.0})"},
      {"some_new_switch", "1"},
  };
  for (const auto& [field, value] : bad) {
    CAPTURE(field);
    const std::string dir = with_field(work + "/hf", work + "/bad_" + field, field, value);
    auto im = run_cmd(kBin + " import llama " + dir + " --out " + work + "/out_" + field);
    CHECK(im.code == 2);
    CHECK(im.err_lines() == 1);
    CHECK_MESSAGE(im.err.find(dir + "/config.json: " + field) != std::string::npos, im.err);
    CHECK_FALSE(stdfs::exists(work + "/out_" + field));
  }
}
}
