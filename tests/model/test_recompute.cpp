// Activation recomputation (train.recompute = "block" | "selective") end to end on the CPU:
// the losses and the final weights (batch-norm running statistics and counters included)
// are bit-identical to "none" for GPT, ResNet with BatchNorm and U-Net, alone and under
// ZeRO-3 on 2 ranks, and the activations' high-water mark goes down. In process: with a backend
// that fuses the GELU into its GEMM as CUDA does (the GELU of the unrounded product), selective
// recompute still replays the forward's bits in bf16.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "backend/cpu/cpu_backend.h"
#include "checkpoint_fixture.h"
#include "core/buffer.h"
#include "core/fsutil.h"
#include "core/rng.h"
#include "models/gpt.h"
#include "run_cmd.h"
#include "run_readers.h"

namespace stdfs = std::filesystem;
using namespace dtrain;

namespace {

const std::string kBin = dtrain_bin();
const std::string kWork = std::string(DTRAIN_BUILD_DIR) + "/test_recompute";

std::string run_dir(const std::string& name) { return kWork + "/runs/" + name; }

std::string recipe(const std::string& name, const std::string& kind) {
  stdfs::create_directories(kWork);
  stdfs::remove_all(run_dir(name));
  const std::string path = kWork + "/" + name + ".toml";
  std::ofstream f(path);
  f << "[run]\nname = \"" << name << "\"\nout_dir = \"" << kWork << "/runs\"\nseed = 3\ndevice = \"cpu\"\nthreads = 1\n";
  if (kind == "gpt")
    f << "[model]\nkind = \"gpt\"\nn_layer = 3\nn_head = 2\nn_embd = 32\nblock_size = 16\nvocab_size = 64\n"
      << "[data]\nkind = \"synthetic\"\n[optim]\nname = \"adamw\"\nlr = 3e-3\n";
  else if (kind == "resnet")
    f << "[model]\nkind = \"resnet\"\ndepth = 8\nwidth = 4\nstem = \"cifar\"\nin_channels = 1\nnum_classes = 10\n"
      << "[data]\nkind = \"synthetic\"\nsynthetic_height = 12\nsynthetic_width = 12\n"
      << "[optim]\nname = \"sgd\"\nlr = 0.05\nmomentum = 0.9\n";
  else
    f << "[model]\nkind = \"unet\"\ndepth = 2\nbase_channels = 4\nin_channels = 1\nnum_classes = 3\n"
      << "[data]\nkind = \"synthetic\"\nsynthetic_height = 16\nsynthetic_width = 16\n"
      << "[optim]\nname = \"adamw\"\nlr = 3e-3\n";
  f << "[train]\nbatch_size = 2\nmax_steps = 8\ngrad_accum = 2\nclip_grad_norm = 1.0\n"
    << "[checkpoint]\nevery_steps = 0\n[eval]\nevery_steps = 0\n[log]\nevery_steps = 1\ntensorboard = false\n"
    << "[parallel]\ntimeout_s = 30\n";
  return path;
}

struct Run {
  std::vector<double> losses;
  int64_t activation_bytes = 0;
  std::string weights;  // the final model (model.safetensors or ZeRO-3 shards), byte for byte
};

Run train(const std::string& name, const std::string& kind, const std::string& recompute, const std::string& extra = "") {
  auto r = run_cmd(kBin + " train " + recipe(name, kind) + " --set train.recompute=" + recompute + " " + extra);
  REQUIRE_MESSAGE(r.code == 0, r.all());
  Run out;
  for (auto& row : read_jsonl(run_dir(name) + "/metrics.jsonl"))
    if (row["kind"] == "train") {
      out.losses.push_back(row["loss"].get<double>());
      out.activation_bytes = row["activation_bytes"].get<int64_t>();
    }
  out.weights = model_state(run_dir(name) + "/checkpoints/step_00000008");
  return out;
}

void same_as_none(const std::string& kind) {
  const Run none = train("rc_" + kind + "_none", kind, "none");
  REQUIRE(none.losses.size() == 8);
  for (const char* mode : {"block", "selective"}) {
    const Run r = train("rc_" + kind + "_" + mode, kind, mode);
    const std::string m = mode;
    INFO(kind << " " << m);
    CHECK(r.losses == none.losses);  // bit for bit
    CHECK(r.weights == none.weights);
    CHECK(r.activation_bytes < none.activation_bytes);
    MESSAGE(kind << " " << m << ": activations " << r.activation_bytes << " B against " << none.activation_bytes
                 << " B without recomputation");
  }
}

}  // namespace

TEST_SUITE("integration") {

TEST_CASE("recompute: GPT with block and selective recomputation is bit-identical to none") { same_as_none("gpt"); }

TEST_CASE("recompute: ResNet with BatchNorm and block or selective recomputation is bit-identical to none") {
  same_as_none("resnet");
}

TEST_CASE("recompute: U-Net with block and selective recomputation is bit-identical to none") { same_as_none("unet"); }

TEST_CASE("recompute: under ZeRO-3 on 2 ranks block and selective are bit-identical to none") {
  const std::string z3 = " --nproc-per-node 2 --set parallel.zero=3 --set train.grad_accum=1 --master-port ";
  const Run none = train("rc_z3_none", "resnet", "none", z3 + "29941");
  const Run block = train("rc_z3_block", "resnet", "block", z3 + "29942");
  const Run sel = train("rc_z3_selective", "resnet", "selective", z3 + "29943");
  CHECK(block.losses == none.losses);
  CHECK(sel.losses == none.losses);
  CHECK(block.weights == none.weights);
  CHECK(sel.weights == none.weights);
}

TEST_CASE("recompute: an unknown mode is a user error naming the key") {
  auto r = run_cmd(kBin + " train " + recipe("rc_bad", "gpt") + " --set train.recompute=full");
  CHECK(r.code == 2);
  CHECK_MESSAGE(r.err.find("train.recompute") != std::string::npos, r.all());
}

}  // TEST_SUITE

namespace {

// A CPU backend whose gemm_bias_gelu does what CUDA's cuBLASLt GELU_AUX_BIAS epilogue does: the
// GELU of the unrounded product (pre is stored rounded, the output is not gelu of it). With it,
// a forward that used the fused epilogue and a selective replay that recomputes gelu(pre) from
// the kept, rounded pre disagree in 16 bits.
class FusedGeluCpu final : public CpuBackend {
 public:
  FusedGeluCpu() : CpuBackend(1) {}
  void gemm_bias_gelu(bool ta, bool tb, const Tensor& a, const Tensor& b, const Tensor& bias, Tensor& pre,
                      Tensor& c) override {
    if (pre.dtype == DType::F32) return CpuBackend::gemm_bias_gelu(ta, tb, a, b, bias, pre, c);
    Arena f32(*this);
    Tensor a32 = f32.alloc(DType::F32, a.shape), b32 = f32.alloc(DType::F32, b.shape);
    Tensor bias32 = f32.alloc(DType::F32, bias.shape), pre32 = f32.alloc(DType::F32, pre.shape);
    Tensor c32 = f32.alloc(DType::F32, c.shape);
    cast(a, a32), cast(b, b32), cast(bias, bias32);
    CpuBackend::gemm_bias(ta, tb, a32, b32, bias32, pre32);
    gelu_fwd(pre32, c32);
    cast(pre32, pre), cast(c32, c);
    ++fused;
  }
  int fused = 0;
};

// One bf16 step of a small GPT (forward, loss, backward) on `be`: the flat gradients.
std::vector<float> bf16_step(Backend& be, Recompute rc) {
  GptSpec s;
  s.n_layer = 2, s.n_head = 2, s.n_embd = 32, s.block_size = 16, s.vocab_size = 64;
  ParamStore ps;
  auto model = build_gpt(s, ps);
  ps.set_compute_dtype(DType::BF16);
  ps.finalize(be);
  ps.initialize(7);
  ps.refresh_compute();
  Arena arena(be), scratch(be);
  Ctx ctx{be, arena, true, {}, {}};
  ctx.recompute = rc;
  ctx.scratch = &scratch;
  const int B = 2, T = 16;
  std::vector<int32_t> ids(B * T), tgt(B * T);
  Rng r(3);
  for (auto& v : ids) v = int32_t(r.below(64));
  for (auto& v : tgt) v = int32_t(r.below(64));
  Tensor tid = arena.alloc(DType::I32, Shape{B, T}), ttg = arena.alloc(DType::I32, Shape{B * T});
  be.copy_from_host(tid.data, ids.data(), ids.size() * 4);
  be.copy_from_host(ttg.data, tgt.data(), tgt.size() * 4);
  GptLoss loss;
  loss.forward(ctx, model->forward(ctx, tid), ttg, s.vocab_size);
  model->backward(ctx, loss.backward());
  std::vector<float> g(size_t(ps.num_params()));
  be.copy_to_host(g.data(), ps.flat_grads().data, g.size() * 4);
  return g;
}

}  // namespace

TEST_CASE("recompute: selective recompute with a fused GELU epilogue replays the forward's bits (bf16)") {
  // With CUDA's fusion a selective replay can only recompute gelu(pre) from the kept, rounded
  // pre, so the forward it repeats must have computed the GELU that way too: the gradients of a
  // selective step on the fused backend are those of the unfused forward, bit for bit (the loss
  // it reports is the loss it differentiates). Recompute "block" runs the fused GEMM again and
  // equals "none" on the fused backend.
  FusedGeluCpu fused;
  CpuBackend plain(1);
  const std::vector<float> none_fused = bf16_step(fused, Recompute::None);
  CHECK(fused.fused > 0);
  const std::vector<float> none_plain = bf16_step(plain, Recompute::None);
  REQUIRE(none_fused != none_plain);  // in bf16 the epilogue's rounding shows
  fused.fused = 0;
  CHECK(bf16_step(fused, Recompute::Selective) == none_plain);
  CHECK(fused.fused == 0);
  CHECK(bf16_step(fused, Recompute::Block) == none_fused);
}
