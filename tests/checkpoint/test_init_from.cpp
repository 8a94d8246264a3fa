// model.init_from (checkpoint/init_from.h): weights of another run or of PyTorch as the starting
// point, strictly or keeping the tensors that do not fit. The torchvision case is in
// test_interop.cpp; the whole `dtrain train` path with its error exit there too.
#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/dtype.h"
#include "core/error.h"
#include "checkpoint/init_from.h"
#include "checkpoint/safetensors.h"

using namespace dtrain;

namespace {

namespace stdfs = std::filesystem;

const std::string kDir = std::string(DTRAIN_BUILD_DIR) + "/test_init_from";

// A CPU session of `model` (the [model] table's lines) on synthetic data, without data loaders.
std::unique_ptr<Session> session(int seed, const std::string& model) {
  const std::string text = fmt::format("[run]\nseed = {}\ndevice = \"cpu\"\nthreads = 1\n[model]\n{}"
                                       "[data]\nkind = \"synthetic\"\nsynthetic_height = 8\nsynthetic_width = 8\n"
                                       "[train]\nbatch_size = 2\nmax_steps = 1\n",
                                       seed, model);
  SessionOptions o;
  o.with_train_data = o.with_eval_data = false;
  return make_session(Config::parse(text, "init_from_test.toml"), o);
}

std::unique_ptr<Session> resnet(int seed, int depth = 8, int classes = 10) {
  return session(seed, fmt::format("kind = \"resnet\"\ndepth = {}\nwidth = 4\nstem = \"cifar\"\nin_channels = 1\n"
                                   "num_classes = {}\n",
                                   depth, classes));
}

std::unique_ptr<Session> gpt(int seed) {
  return session(seed, "kind = \"gpt\"\nn_layer = 1\nn_head = 2\nn_embd = 16\nblock_size = 8\nvocab_size = 100\n");
}

// name -> the tensor's bytes as the model exports it (PyTorch layout)
std::map<std::string, std::vector<uint8_t>> state(Session& s) {
  std::map<std::string, std::vector<uint8_t>> m;
  for (auto& e : s.params.export_state()) m[e.name] = e.bytes;
  return m;
}

// Writes s's weights to `file`; `bf16`: floating tensors stored as bf16 (as many published
// checkpoints are); `drop`: a tensor left out; `extra`: a tensor the model does not have.
std::string save(Session& s, const std::string& file, bool bf16 = false, const std::string& drop = "",
                 bool extra = false) {
  stdfs::create_directories(kDir);
  auto ex = s.params.export_state();
  std::vector<std::vector<uint8_t>> narrowed(ex.size());
  std::vector<StTensor> ts;
  for (size_t i = 0; i < ex.size(); ++i) {
    auto& e = ex[i];
    if (e.name == drop) continue;
    if (bf16 && e.dtype == "F32") {
      const size_t n = e.bytes.size() / 4;
      narrowed[i].resize(n * 2);
      for (size_t k = 0; k < n; ++k) {
        float f;
        std::memcpy(&f, e.bytes.data() + 4 * k, 4);
        const uint16_t h = f32_to_bf16(f);
        std::memcpy(narrowed[i].data() + 2 * k, &h, 2);
      }
      ts.push_back({e.name, "BF16", e.shape, narrowed[i].data(), narrowed[i].size()});
    } else {
      ts.push_back({e.name, e.dtype, e.shape, e.bytes.data(), e.bytes.size()});
    }
  }
  const float one = 1.f;
  if (extra) ts.push_back({"head.proj.weight", "F32", {1}, &one, 4});
  const std::string path = kDir + "/" + file;
  write_safetensors(path, ts, {{"format", "pt"}});
  return path;
}

}  // namespace

TEST_SUITE("unit") {

TEST_CASE("init_from: a model starts from another's weights bit for bit and bf16 files are widened") {
  auto a = resnet(1);
  const std::string file = save(*a, "a.safetensors");
  auto b = resnet(2);
  REQUIRE(state(*b) != state(*a));  // another seed, other weights
  InitReport r = init_model_from(*b, file, true);
  CHECK(r.loaded == int(state(*a).size()));
  CHECK(r.kept.empty());
  CHECK(r.ignored.empty());
  CHECK(state(*b) == state(*a));
  // bf16 in the file: every float is a's rounded to bf16
  auto c = resnet(3);
  init_model_from(*c, save(*a, "a_bf16.safetensors", true), true);
  auto sa = state(*a), sc = state(*c);
  const auto& w = sa.at("conv1.weight");
  const auto& wc = sc.at("conv1.weight");
  for (size_t k = 0; k < w.size() / 4; ++k) {
    float f, g;
    std::memcpy(&f, w.data() + 4 * k, 4);
    std::memcpy(&g, wc.data() + 4 * k, 4);
    REQUIRE(g == bf16_to_f32(f32_to_bf16(f)));
  }
  CHECK(sc.at("bn1.num_batches_tracked") == sa.at("bn1.num_batches_tracked"));
}

TEST_CASE("init_from: strict refuses what does not fit (naming the file and the tensor) and not strict keeps it") {
  auto src = resnet(1);
  const std::string file = save(*src, "src.safetensors");
  // another head: 5 classes
  auto five = resnet(2, 8, 5);
  const auto before = state(*five);
  CHECK_THROWS_WITH_AS(init_model_from(*five, file, true),
                       doctest::Contains("src.safetensors: tensor 'fc.weight' is F32 [10, 16], this model's is F32 [5, 16]"),
                       UserError);
  CHECK(state(*five) == before);  // nothing touched
  InitReport r = init_model_from(*five, file, false);
  CHECK(r.kept == std::vector<std::string>{"fc.weight", "fc.bias"});
  auto after = state(*five), ss = state(*src);
  for (auto& [name, bytes] : after) {
    CAPTURE(name);
    CHECK(bytes == (name.rfind("fc.", 0) == 0 ? before.at(name) : ss.at(name)));
  }
  // a tensor missing from the file, or one the model does not have
  auto m = resnet(3);
  CHECK_THROWS_WITH_AS(init_model_from(*m, save(*src, "drop.safetensors", false, "bn1.running_var"), true),
                       doctest::Contains("tensor 'bn1.running_var' is missing"), UserError);
  CHECK_THROWS_WITH_AS(init_model_from(*m, save(*src, "extra.safetensors", false, "", true), true),
                       doctest::Contains("tensor 'head.proj.weight' does not exist in this model"), UserError);
  InitReport rx = init_model_from(*m, kDir + "/extra.safetensors", false);
  CHECK(rx.ignored == std::vector<std::string>{"head.proj.weight"});
  CHECK(state(*m) == ss);
  // a deeper model's weights into a shallower one: its extra blocks are ignored
  auto deep = resnet(4, 14);
  auto shallow = resnet(5);
  InitReport rd = init_model_from(*shallow, save(*deep, "deep.safetensors"), false);
  CHECK(!rd.ignored.empty());
  CHECK(rd.kept.empty());
}

// A Hugging Face GPT-2 directory (model.safetensors + config.json): the weights alone do not
// show an untied LM head, another activation or another attention scaling, so config.json is
// read and a model dtrain does not build is refused, as `dtrain import gpt2` refuses it; an
// lm_head.weight in the file must be the tied copy of wte.
TEST_CASE("init_from: a Hugging Face GPT-2 directory whose config.json or LM head is another model is refused") {
  auto src = gpt(5);
  const std::string dir = kDir + "/hf_gpt2";
  stdfs::remove_all(dir);
  stdfs::create_directories(dir);
  auto ex = src->params.export_state();
  std::vector<StTensor> ts;
  std::vector<uint8_t> head;
  std::vector<int64_t> head_shape;
  for (auto& e : ex) {
    ts.push_back({e.name, e.dtype, e.shape, e.bytes.data(), e.bytes.size()});
    if (e.name == "transformer.wte.weight") head = e.bytes, head_shape = e.shape;
  }
  write_safetensors(dir + "/model.safetensors", ts, {{"format", "pt"}});
  const std::string base = R"("model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 16, "n_positions": 8, "vocab_size": 100)";
  auto config = [&](const std::string& extra) { std::ofstream(dir + "/config.json") << "{" << base << extra << "}"; };
  config("");
  auto dst = gpt(6);
  CHECK(init_model_from(*dst, dir, true).loaded > 0);
  CHECK(state(*dst) == state(*src));
  const std::vector<std::pair<std::string, std::string>> bad = {
      {R"(, "tie_word_embeddings": false)", "tie_word_embeddings false"},
      {R"(, "activation_function": "relu")", "activation_function \"relu\""},
      {R"(, "layer_norm_epsilon": 0.001)", "layer_norm_epsilon 0.001"},
      {R"(, "scale_attn_weights": false)", "scale_attn_weights false"},
      {R"(, "scale_attn_by_inverse_layer_idx": true)", "scale_attn_by_inverse_layer_idx true"},
  };
  for (const auto& [extra, words] : bad) {
    config(extra);
    auto d = gpt(6);
    CHECK_THROWS_WITH_AS(init_model_from(*d, dir, false), doctest::Contains(("config.json: " + words).c_str()), UserError);
  }
  config(R"(, "reorder_and_upcast_attn": true)");  // the same numbers up to rounding: accepted
  CHECK(init_model_from(*gpt(6), dir, true).loaded > 0);
  // an LM head equal to wte is the tied copy; another one is another model (strict or not)
  config("");
  ts.push_back({"lm_head.weight", "F32", head_shape, head.data(), head.size()});
  write_safetensors(dir + "/model.safetensors", ts, {{"format", "pt"}});
  CHECK(init_model_from(*gpt(6), dir, true).loaded > 0);
  for (size_t k = 0; k < head.size(); k += 4) head[k + 3] ^= 0x40;  // another value in every float
  write_safetensors(dir + "/model.safetensors", ts, {{"format", "pt"}});
  CHECK_THROWS_WITH_AS(init_model_from(*gpt(6), dir, false),
                       doctest::Contains("lm_head.weight differs from transformer.wte.weight"), UserError);
}

TEST_CASE("init_from: unusable sources are one clear error") {
  auto s = resnet(1);
  CHECK_THROWS_WITH_AS(init_model_from(*s, kDir + "/nothing.safetensors", true),
                       doctest::Contains(("model.init_from: " + kDir + "/nothing.safetensors does not exist").c_str()),
                       UserError);
  stdfs::create_directories(kDir);
  { std::ofstream(kDir + "/junk.safetensors") << "not a safetensors file"; }
  CHECK_THROWS_WITH_AS(init_model_from(*s, kDir + "/junk.safetensors", true), doctest::Contains("junk.safetensors"),
                       UserError);
  stdfs::create_directories(kDir + "/emptydir");
  CHECK_THROWS_WITH_AS(init_model_from(*s, kDir + "/emptydir", true),
                       doctest::Contains("neither a checkpoint directory"), UserError);
  // nothing in common with this model
  const float one = 1.f;
  write_safetensors(kDir + "/other.safetensors", {{"encoder.w", "F32", {1}, &one, 4}}, {});
  CHECK_THROWS_WITH_AS(init_model_from(*s, kDir + "/other.safetensors", false),
                       doctest::Contains(("no tensor of " + kDir + "/other.safetensors fits this model").c_str()), UserError);
}

}  // TEST_SUITE
