// GPT-2 model: presets and parameter counts, HF names/layouts, and a full comparison with a
// PyTorch GPT-2 (written out here, float64) on a tiny config with a padded vocabulary:
// logits, loss and every gradient. Also sampling (greedy determinism, top-k bounds).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"
#include "models/gpt.h"
#include "nn/loss.h"
#include "op_harness.h"
#include "checkpoint/safetensors.h"
#include "skip.h"

using namespace dtrain;
using testing::HostVec;

namespace {

const char* kTorchRef = R"PY(
import math, sys, torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
d = sys.argv[1]
W = load_file(d + "/weights.safetensors")
I = load_file(d + "/inputs.safetensors")
L, H = [int(v) for v in I["cfg"].tolist()]
ids, tgt = I["ids"].long(), I["targets"].long()
P = {k: v.double().requires_grad_() for k, v in W.items()}
B, T = ids.shape
C = P["transformer.wte.weight"].shape[1]
hs = C // H
def ln(x, p): return F.layer_norm(x, (C,), P[p + ".weight"], P[p + ".bias"], 1e-5)
def conv1d(x, p): return x @ P[p + ".weight"] + P[p + ".bias"]
x = P["transformer.wte.weight"][ids] + P["transformer.wpe.weight"][:T]
mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
for i in range(L):
    p = "transformer.h.%d." % i
    q, k, v = conv1d(ln(x, p + "ln_1"), p + "attn.c_attn").split(C, dim=2)
    q, k, v = [t.view(B, T, H, hs).transpose(1, 2) for t in (q, k, v)]
    att = (q @ k.transpose(-2, -1)) / math.sqrt(hs)
    att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    y = (att @ v).transpose(1, 2).reshape(B, T, C)
    x = x + conv1d(y, p + "attn.c_proj")
    m = F.gelu(conv1d(ln(x, p + "ln_2"), p + "mlp.c_fc"), approximate="tanh")
    x = x + conv1d(m, p + "mlp.c_proj")
x = ln(x, "transformer.ln_f")
logits = x @ P["transformer.wte.weight"].t()
loss = F.cross_entropy(logits.view(B * T, -1), tgt.view(-1))
loss.backward()
out = {"logits": logits.detach().float().reshape(B * T, -1).contiguous(),
       "loss": loss.detach().float().reshape(1)}
for k, v in P.items():
    out["grad." + k] = v.grad.float().contiguous()
save_file(out, d + "/reference.safetensors")
)PY";

}  // namespace

TEST_SUITE("unit") {

TEST_CASE("gpt: presets / validation and parameter counts (HF GPT-2 124M = 124439808)") {
  GptSpec s = gpt_preset("gpt2");
  CHECK(s.n_layer == 12);
  CHECK(s.vocab_size == 50257);
  CHECK(s.padded_vocab == 50304);
  CHECK(gpt_param_count(s, false) == 124439808);
  CHECK(gpt_param_count(s, true) == 124439808 + 47 * 768);
  CHECK(gpt_preset("gpt2-medium").n_embd == 1024);
  CHECK(gpt_preset("gpt2-xl").n_head == 25);
  CHECK_THROWS_AS(gpt_preset("gpt5"), UserError);
  GptSpec bad = gpt_preset("tiny");
  bad.n_head = 3;
  CHECK_THROWS_WITH_AS(gpt_validate(bad), doctest::Contains("model.n_embd"), UserError);

  // Declared parameters: names, internal count (padded) and checkpoint shapes (HF).
  ParamStore ps;
  auto m = build_gpt(s, ps);
  CHECK(ps.num_params() == gpt_param_count(s, true));
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& e : ps.state_entries()) shapes[e.name] = e.shape;
  CHECK(shapes.size() == 2 + 12 * 12 + 2);
  CHECK(shapes["transformer.wte.weight"] == std::vector<int64_t>{50257, 768});
  CHECK(shapes["transformer.wpe.weight"] == std::vector<int64_t>{1024, 768});
  CHECK(shapes["transformer.h.0.attn.c_attn.weight"] == std::vector<int64_t>{768, 2304});
  CHECK(shapes["transformer.h.11.mlp.c_proj.weight"] == std::vector<int64_t>{3072, 768});
  CHECK(shapes["transformer.ln_f.bias"] == std::vector<int64_t>{768});
  CHECK(shapes.count("lm_head.weight") == 0);  // tied to wte
  int64_t torch_total = 0;
  for (auto& [n, sh] : shapes) {
    int64_t k = 1;
    for (int64_t d : sh) k *= d;
    torch_total += k;
  }
  CHECK(torch_total == 124439808);
}

TEST_CASE("gpt: init statistics (std 0.02 / residual projections 0.02/sqrt(2L) / padding rows 0)") {
  auto be = make_backend("cpu");
  GptSpec s = gpt_preset("tiny");
  s.vocab_size = 200;  // padded to 256
  s.padded_vocab = 0;
  ParamStore ps;
  auto m = build_gpt(s, ps);
  ps.finalize(*be);
  ps.initialize(3);
  auto std_of = [&](const std::string& name, int64_t rows = -1) {
    const ParamDesc& d = ps.params()[size_t(ps.find_param(name))];
    HostVec v(size_t(d.shape.numel()));
    be->copy_to_host(v.data(), ps.param(ps.find_param(name)).data, v.size() * 4);
    if (rows >= 0) v.resize(size_t(rows * d.shape[1]));
    double s2 = 0;
    for (float f : v) s2 += double(f) * f;
    return std::sqrt(s2 / double(v.size()));
  };
  CHECK(std_of("transformer.wte.weight", 200) == doctest::Approx(0.02).epsilon(0.05));
  CHECK(std_of("transformer.h.0.attn.c_attn.weight") == doctest::Approx(0.02).epsilon(0.05));
  CHECK(std_of("transformer.h.1.mlp.c_proj.weight") ==
        doctest::Approx(0.02 / std::sqrt(4.0)).epsilon(0.05));
  CHECK(std_of("transformer.h.0.ln_1.weight") == doctest::Approx(1.0));
  CHECK(std_of("transformer.h.0.attn.c_attn.bias") == 0.0);
  // padding rows of wte are zero
  HostVec wte(size_t(256 * 64));
  be->copy_to_host(wte.data(), ps.param(ps.find_param("transformer.wte.weight")).data,
                   wte.size() * 4);
  bool pad_zero = true;
  for (size_t i = 200 * 64; i < wte.size(); ++i) pad_zero = pad_zero && wte[i] == 0.f;
  CHECK(pad_zero);
}

TEST_CASE("gpt: logits / loss and every gradient match a float64 PyTorch GPT-2 (padded vocab)") {
  namespace fs = std::filesystem;
  const std::string python = DTRAIN_SOURCE_DIR "/.venv/bin/python";
  if (!fs::exists(python)) {
    SKIP_TEST("no " << python);
  }
  const fs::path dir = fs::path(DTRAIN_BUILD_DIR) / "test_gpt_torch";
  fs::remove_all(dir);
  fs::create_directories(dir);

  auto be = make_backend("cpu");
  GptSpec s;
  s.n_layer = 2, s.n_head = 4, s.n_embd = 32, s.block_size = 16, s.vocab_size = 100;
  ParamStore ps;
  auto model = build_gpt(s, ps);
  ps.finalize(*be);
  ps.initialize(11);
  const int64_t Vp = model->spec().padded_vocab;
  REQUIRE(Vp == 128);
  // Non-trivial LayerNorm parameters and biases (init has them at 1/0).
  {
    Tensor flat = ps.flat_params();
    HostVec h(size_t(flat.numel()));
    be->copy_to_host(h.data(), flat.data, h.size() * 4);
    Rng r(5);
    for (const auto& d : ps.params())
      if (d.shape.ndim() == 1)
        for (int64_t i = 0; i < d.shape.numel(); ++i)
          h[size_t(d.offset + i)] += 0.1f * r.normal();
    be->copy_from_host(flat.data, h.data(), h.size() * 4);
  }
  const int B = 2, T = 11;
  std::vector<int32_t> ids(B * T), tgt(B * T), cfg{s.n_layer, s.n_head};
  Rng r(9);
  for (auto& v : ids) v = int32_t(r.below(100));
  for (auto& v : tgt) v = int32_t(r.below(100));
  {
    auto ex = ps.export_state();
    std::vector<StTensor> ts;
    for (auto& e : ex) ts.push_back({e.name, e.dtype, e.shape, e.bytes.data(), e.bytes.size()});
    write_safetensors((dir / "weights.safetensors").string(), ts, {});
    write_safetensors((dir / "inputs.safetensors").string(),
                      {{"ids", "I32", {B, T}, ids.data(), ids.size() * 4},
                       {"targets", "I32", {B, T}, tgt.data(), tgt.size() * 4},
                       {"cfg", "I32", {2}, cfg.data(), 8}},
                      {});
  }
  { std::ofstream(dir / "ref.py") << kTorchRef; }
  const std::string cmd = python + " " + (dir / "ref.py").string() + " " + dir.string() + " 2>&1";
  REQUIRE(std::system(cmd.c_str()) == 0);
  SafetensorsReader ref((dir / "reference.safetensors").string());

  Arena arena(*be);
  Ctx ctx{*be, arena, true, {}};
  Tensor tid = arena.alloc(DType::I32, Shape{B, T});
  Tensor ttg = arena.alloc(DType::I32, Shape{B * T});
  be->copy_from_host(tid.data, ids.data(), ids.size() * 4);
  be->copy_from_host(ttg.data, tgt.data(), tgt.size() * 4);
  Tensor logits = model->forward(ctx, tid);
  GptLoss loss;
  Tensor losses = loss.forward(ctx, logits, ttg, s.vocab_size);
  const double mean = mean_loss(*be, losses);
  model->backward(ctx, loss.backward());

  HostVec lg(size_t(logits.numel())), lg100;
  be->copy_to_host(lg.data(), logits.data, lg.size() * 4);
  for (int i = 0; i < B * T; ++i)
    lg100.insert(lg100.end(), lg.begin() + i * Vp, lg.begin() + i * Vp + 100);
  CHECK(testing::nerr(lg100, read_f32(ref, "logits")) < 1e-5);
  CHECK(mean == doctest::Approx(read_f32(ref, "loss")[0]).epsilon(1e-5));

  Tensor fg = ps.flat_grads();
  HostVec g(size_t(fg.numel()));
  be->copy_to_host(g.data(), fg.data, g.size() * 4);
  int compared = 0;
  for (const auto& d : ps.params()) {
    const HostVec want = read_f32(ref, "grad." + d.name);
    HostVec got(g.begin() + d.offset, g.begin() + d.offset + int64_t(want.size()));
    CAPTURE(d.name);
    CHECK(testing::nerr(got, want) < 1e-4);
    CHECK(!testing::all_zero(got));
    if (d.layout == Layout::PadRows) {  // padding rows get no gradient
      bool zero = true;
      for (int64_t i = int64_t(want.size()); i < d.shape.numel(); ++i)
        zero = zero && g[size_t(d.offset + i)] == 0.f;
      CHECK(zero);
    }
    ++compared;
  }
  CHECK(compared == 2 + 2 * 12 + 2);
}

TEST_CASE("gpt: greedy sampling is deterministic - sampling stays in the vocabulary and block") {
  auto be = make_backend("cpu");
  GptSpec s = gpt_preset("tiny");
  s.vocab_size = 50;
  s.padded_vocab = 0;
  s.block_size = 8;
  ParamStore ps;
  auto model = build_gpt(s, ps);
  ps.finalize(*be);
  ps.initialize(1);
  Arena arena(*be);
  Rng rng(1);
  SampleOptions o;
  o.max_new_tokens = 12;  // runs past block_size: the context is cropped
  o.temperature = 0.f;
  auto a = gpt_generate(*model, *be, arena, {1, 2, 3}, o, rng);
  auto b = gpt_generate(*model, *be, arena, {1, 2, 3}, o, rng);
  CHECK(a.size() == 15);
  CHECK(a == b);
  o.temperature = 1.f;
  o.top_k = 5;
  Rng r1(42), r2(42);
  auto c = gpt_generate(*model, *be, arena, {4}, o, r1);
  auto d = gpt_generate(*model, *be, arena, {4}, o, r2);
  CHECK(c == d);
  for (int32_t t : c) CHECK((t >= 0 && t < 50));
  CHECK_THROWS_AS(gpt_generate(*model, *be, arena, {}, o, r1), UserError);
  CHECK_THROWS_AS(gpt_generate(*model, *be, arena, {77}, o, r1), UserError);
}

}  // TEST_SUITE
