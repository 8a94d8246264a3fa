// Tensor parallelism (parallel.tensor = T, Megatron) on CPU with Gloo and a tiny GPT:
//  * units: the vocabulary-parallel cross-entropy of 2 ranks equals the full one (losses and
//    each rank's slice of the gradient); the ParamStore's tensor-parallel layout maps every
//    element of every rank to the universal (one-process) layout and back;
//  * end to end through the launcher: TP=2 gives the per-step losses and evaluations of one
//    process over 20 steps, DP2 x TP2 (4 ranks) those of one process with grad_accum 2, and a
//    TP=2 checkpoint resumes on one process (and a one-process checkpoint on TP=2) continuing
//    as the uninterrupted run; keys that do not fit exit 2 naming them;
//  * ZeRO-1/2/3 on the data dimension (DP2 x TP2; ZeRO-3 also with SP) give one process's
//    losses, gradient norms and weights, a ZeRO-3 TP checkpoint resumes on one process;
//    recompute block / selective are bit-identical to none under TP and under SP + ZeRO-3;
//    the bytes a rank sends in its tp group equal the analytic volume.
//  * sequence parallelism (parallel.sequence = true on top of TP): the same three end-to-end
//    comparisons (TP=2+SP vs one process, DP2 x TP2+SP vs grad_accum 2, a TP=2+SP checkpoint
//    resumed on one process), and parallel.sequence without TP or with a block size TP does
//    not divide exits 2 naming the keys; and (unit) one forward+backward hands the tp group
//    the same bytes with and without sequence parallelism (counted at TensorParallelOps: the
//    communicators count no bytes).
//
// Tolerance: 1e-5 relative on every loss, as the other layouts (run_readers.h check_close):
// the row-parallel layers sum the ranks' partial products where one process runs one GEMM,
// and the cross-entropy sums its exponentials per rank.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "backend/backend.h"
#include "comm/communicator.h"
#include "core/fsutil.h"
#include "core/rng.h"
#include "gloo_ranks.h"
#include "models/gpt.h"
#include "nn/vocab_parallel.h"
#include "parallel/tensor_parallel.h"
#include "run_cmd.h"
#include "checkpoint_fixture.h"
#include "model_parallel_fixture.h"
#include "process_work_dir.h"
#include "run_readers.h"
#include "token_fixture.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/safetensors.h"

namespace stdfs = std::filesystem;
using namespace dtrain;

TEST_CASE("tensor parallel: the vocabulary-parallel cross-entropy of 2 ranks equals the full one") {
  const int64_t N = 7, Vl = 128, W = 2, valid = 200;  // rank 1's last 56 columns are padding
  std::vector<float> z(size_t(N * Vl * W));
  std::vector<int32_t> lab(static_cast<size_t>(N));
  Rng rng(3, 0);
  for (auto& v : z) v = 4.f * rng.normal();
  for (int64_t i = 0; i < N; ++i) lab[size_t(i)] = int32_t(rng.below(uint64_t(valid)));
  lab[0] = 5;    // owned by rank 0
  lab[1] = 199;  // by rank 1, next to the padding
  const float scale = 0.25f;
  // the reference: one process, full logits
  std::vector<float> ref_loss(static_cast<size_t>(N)), ref_dz(z.size());
  {
    auto be = make_backend("cpu");
    Arena arena(*be);
    Tensor logits = arena.alloc(DType::F32, Shape{N, Vl * W}), labels = arena.alloc(DType::I32, Shape{N});
    Tensor losses = arena.alloc(DType::F32, Shape{N}), dz = arena.alloc(DType::F32, Shape{N, Vl * W});
    be->copy_from_host(logits.data, z.data(), z.size() * 4);
    be->copy_from_host(labels.data, lab.data(), lab.size() * 4);
    be->softmax_xent_masked(logits, labels, valid, scale, losses, dz);
    be->copy_to_host(ref_loss.data(), losses.data, ref_loss.size() * 4);
    be->copy_to_host(ref_dz.data(), dz.data, ref_dz.size() * 4);
  }
  std::vector<std::vector<float>> loss(W), dz(W);
  run_gloo_ranks(int(W), [&](int r, comm::GlooCommunicator& c) {
    auto be = make_backend("cpu");
    Arena arena(*be);
    parallel::CommTensorParallel tp(c);
    Ctx ctx{*be, arena, true, {}, {}};
    ctx.tp = &tp;
    std::vector<float> mine(size_t(N * Vl));
    for (int64_t i = 0; i < N; ++i)
      std::copy_n(z.begin() + i * Vl * W + r * Vl, Vl, mine.begin() + i * Vl);
    Tensor logits = arena.alloc(DType::F32, Shape{N, Vl}), labels = arena.alloc(DType::I32, Shape{N});
    Tensor losses = arena.alloc(DType::F32, Shape{N}), d = arena.alloc(DType::F32, Shape{N, Vl});
    be->copy_from_host(logits.data, mine.data(), mine.size() * 4);
    be->copy_from_host(labels.data, lab.data(), lab.size() * 4);
    vp_softmax_xent(ctx, logits, labels, r * Vl, valid, scale, losses, d);
    loss[size_t(r)].resize(size_t(N));
    dz[size_t(r)].resize(size_t(N * Vl));
    be->copy_to_host(loss[size_t(r)].data(), losses.data, size_t(N) * 4);
    be->copy_to_host(dz[size_t(r)].data(), d.data, size_t(N * Vl) * 4);
  });
  double worst_loss = 0, worst_grad = 0;
  for (int64_t r = 0; r < W; ++r)
    for (int64_t i = 0; i < N; ++i) {
      INFO("rank " << r << " row " << i);
      CHECK(loss[size_t(r)][size_t(i)] == doctest::Approx(ref_loss[size_t(i)]).epsilon(1e-6));
      worst_loss = std::max(worst_loss, std::fabs(double(loss[size_t(r)][size_t(i)]) - ref_loss[size_t(i)]));
      for (int64_t c = 0; c < Vl; ++c) {
        const double a = dz[size_t(r)][size_t(i * Vl + c)], b = ref_dz[size_t(i * Vl * W + r * Vl + c)];
        CHECK(std::fabs(a - b) <= 1e-7);
        worst_grad = std::max(worst_grad, std::fabs(a - b));
        if (r * Vl + c >= valid) CHECK(a == 0.0);  // padding columns: never predicted
      }
    }
  MESSAGE("vocab-parallel cross-entropy vs full: largest loss difference " << worst_loss << ", gradient "
                                                                           << worst_grad);
}

TEST_CASE("tensor parallel: the ParamStore's parts map onto the universal layout of one process") {
  GptSpec spec;
  spec.n_layer = 2, spec.n_head = 4, spec.n_embd = 32, spec.block_size = 16, spec.vocab_size = 300;
  gpt_validate(spec);  // padded_vocab 384: under T = 2 each rank holds 256 rows, 128 of rank 1 padding
  ParamStore one;
  build_gpt(spec, one);
  const std::vector<float> init = init_params_host(one.params(), one.num_params(), 9);
  for (int T : {2, 4}) {
    GptSpec s = spec;
    s.tp_size = T;
    std::vector<std::unique_ptr<ParamStore>> ps;
    std::vector<std::vector<float>> parts;
    std::vector<int64_t> covered(size_t(one.num_params()), 0);
    for (int r = 0; r < T; ++r) {
      ps.push_back(std::make_unique<ParamStore>());
      ps.back()->set_tensor_parallel(r, T);
      build_gpt(s, *ps.back());
      CHECK(ps.back()->layout_hash() == one.layout_hash());
      CHECK(ps.back()->universal_num_params() == one.num_params());
      CHECK(ps.back()->state_entries().size() == one.state_entries().size());
      for (const FlatPiece& p : ps.back()->tp_pieces(r))
        for (int64_t k = 0; k < p.count; ++k) covered[size_t(p.global + k)] += 1;
      parts.push_back(ps.back()->tp_slice(init));
    }
    INFO("T = " << T);
    // every universal element is held by one rank (cut) or by all (replicated)
    const auto& full = one.params();
    for (size_t i = 0; i < full.size(); ++i) {
      const bool cut = ps[0]->params()[i].tp_dim >= 0;
      for (int64_t k = 0; k < full[i].shape.numel(); ++k)
        if (covered[size_t(full[i].offset + k)] != (cut ? 1 : T)) {
          FAIL_CHECK(full[i].name << " element " << k << " held " << covered[size_t(full[i].offset + k)] << " times");
          break;
        }
    }
    std::vector<const float*> ptrs;
    for (auto& p : parts) ptrs.push_back(p.data());
    CHECK(ps[0]->tp_assemble(ptrs) == init);
    // c_attn: rank r holds columns [r*8, r*8+8) of each of q, k, v (C = 32, 4 heads of 8)
    const int id = ps[1]->find_param("transformer.h.0.attn.c_attn.weight");
    const ParamDesc& d = ps[1]->params()[size_t(id)];
    CHECK(d.shape == Shape{32, 96 / T});
    const int64_t uo = full[size_t(id)].offset, lo = d.offset, w = 32 / T;
    CHECK(parts[1][size_t(lo + 0)] == init[size_t(uo + w)]);               // q, column w
    CHECK(parts[1][size_t(lo + w)] == init[size_t(uo + 32 + w)]);          // k
    CHECK(parts[1][size_t(lo + 96 / T)] == init[size_t(uo + 96 + w)]);     // next input row, q
  }
}

namespace {

// The layers' collectives of one rank, passed on, with the bytes this rank sends under the
// ring algorithms (Gloo's and NCCL's): all-reduce 2(W-1)/W of the tensor, reduce-scatter and
// all-gather (W-1)/W of the full tensor. The communicators count no bytes themselves.
class CountingTp final : public TensorParallelOps {
 public:
  explicit CountingTp(TensorParallelOps& in) : in_(in) {}
  int rank() const override { return in_.rank(); }
  int size() const override { return in_.size(); }
  void allreduce_sum(Tensor& t) override {
    sent += 2.0 * (size() - 1) / size() * double(t.nbytes());
    in_.allreduce_sum(t);
  }
  void allreduce_max(Tensor& t) override {
    sent += 2.0 * (size() - 1) / size() * double(t.nbytes());
    in_.allreduce_max(t);
  }
  void allgather(const Tensor& shard, Tensor& out) override {
    sent += double(size() - 1) * double(shard.nbytes());
    in_.allgather(shard, out);
  }
  void reduce_scatter_sum(const Tensor& in, Tensor& out_shard) override {
    sent += double(size() - 1) * double(out_shard.nbytes());
    in_.reduce_scatter_sum(in, out_shard);
  }
  double sent = 0;

 private:
  TensorParallelOps& in_;
};

}  // namespace

TEST_CASE("sequence parallel: a training step sends the bytes of plain tensor parallelism (same losses)") {
  GptSpec spec;
  spec.n_layer = 2, spec.n_head = 4, spec.n_embd = 32, spec.block_size = 16, spec.vocab_size = 256;
  spec.tp_size = 2;
  const int64_t B = 2, T = 16;
  std::vector<int32_t> ids(size_t(B * T)), tgt(ids.size());
  Rng rng(4, 0);
  for (auto& v : ids) v = int32_t(rng.below(256));
  for (auto& v : tgt) v = int32_t(rng.below(256));
  double sent[2][2] = {}, loss[2][2] = {};  // [sequence][rank]
  for (int sp = 0; sp < 2; ++sp)
    run_gloo_ranks(2, [&](int r, comm::GlooCommunicator& c) {
      auto be = make_backend("cpu");
      GptSpec s = spec;
      s.sequence_parallel = sp == 1;
      ParamStore ps;
      ps.set_tensor_parallel(r, 2);
      auto model = build_gpt(s, ps);
      ps.finalize(*be);
      ps.initialize(11);
      Arena arena(*be);
      parallel::CommTensorParallel group(c);
      CountingTp tp(group);
      Ctx ctx{*be, arena, true, {}, {}};
      ctx.tp = &tp;
      Tensor tid = arena.alloc(DType::I32, Shape{B, T}), ttg = arena.alloc(DType::I32, Shape{B * T});
      be->copy_from_host(tid.data, ids.data(), ids.size() * 4);
      be->copy_from_host(ttg.data, tgt.data(), tgt.size() * 4);
      GptLoss lf;
      Tensor losses = lf.forward(ctx, model->forward(ctx, tid), ttg, s.vocab_size);
      model->backward(ctx, lf.backward());
      std::vector<float> h(size_t(B * T));
      be->copy_to_host(h.data(), losses.data, h.size() * 4);
      for (float v : h) loss[sp][r] += v;
      sent[sp][r] = tp.sent;
    });
  for (int r = 0; r < 2; ++r) {
    CHECK(sent[1][r] == sent[0][r]);  // the activations' collectives: all-reduce = reduce-scatter + all-gather
    CHECK(loss[1][r] == doctest::Approx(loss[0][r]).epsilon(1e-6));
  }
  // what sequence parallelism adds per step: the all-reduce of the layer norms' gradients
  const double ln = 2.0 * (2 - 1) / 2 * double((4 * spec.n_layer + 2) * spec.n_embd) * 4;
  MESSAGE("bytes a rank sends in one forward+backward (B=2, T=16, C=32, 2 layers, TP=2): " << sent[0][0]
          << " without sequence parallelism, " << sent[1][0] << " with; plus " << ln
          << " per step for the layer-norm gradients' all-reduce under sequence parallelism");
}

namespace {

const std::string kBin = dtrain_bin();
const std::string kWork = process_work_dir("test_tensor_parallel");  // runs made once per process

std::string run_dir(const std::string& name) { return kWork + "/runs/" + name; }
std::string ckpt(const std::string& name, int64_t step) {
  return run_dir(name) + "/checkpoints/" + CheckpointManager::dir_name(step);
}

// A tiny GPT (4 heads, so T = 2 and 4 fit) on byte tokens: `steps` steps of batch 2 per
// data-parallel rank, a checkpoint every `every`, an evaluation every 10, clipping on.
std::string recipe(const std::string& name, int steps, int every, const std::string& extra) {
  stdfs::create_directories(kWork);
  stdfs::remove_all(run_dir(name));
  const std::string path = kWork + "/" + name + ".toml";
  std::ofstream f(path);
  f << "[run]\nname = \"" << name << "\"\nout_dir = \"" << kWork << "/runs\"\nseed = 11\ndevice = \"cpu\"\nthreads = 1\n"
    << "[model]\nkind = \"gpt\"\nn_layer = 2\nn_head = 4\nn_embd = 32\nblock_size = 16\nvocab_size = 256\n"
    << "[data]\nkind = \"tokens\"\npath = \"" << byte_tokens(kWork) << "\"\neval_split = \"val\"\n"
    << "[optim]\nname = \"adamw\"\nlr = 3e-3\nweight_decay = 0.01\n"
    << "[schedule]\nkind = \"cosine\"\nwarmup_steps = 2\n"
    << "[train]\nbatch_size = 2\nmax_steps = " << steps << "\nclip_grad_norm = 1.0\n"
    << "[checkpoint]\nevery_steps = " << every << "\nkeep_last = 10\n"
    << "[eval]\nevery_steps = 10\nbatch_size = 2\nmax_batches = 2\n"
    << "[log]\nevery_steps = 1\ntensorboard = false\n"
    << "[parallel]\ntimeout_s = 30\n"
    << extra;
  return path;
}

std::string train(const std::string& args) { return kBin + " train " + args; }

// A run directory `name` holding `from`'s recipe and its checkpoint at `step` (latest).
std::string copy_run(const std::string& from, const std::string& name, int64_t step) {
  return copy_run_at(run_dir(from), run_dir(name), step);
}

// the one-process reference with grad_accum `accum`, 20 steps, a checkpoint every 10 (made once)
std::string reference(int accum) {
  const std::string name = "tp_ref_accum" + std::to_string(accum);
  static std::set<int> made;  // by this test process (never a stale run of another binary)
  if (made.insert(accum).second) {
    auto r = run_cmd(train(recipe(name, 20, 10, "") + " --set train.grad_accum=" + std::to_string(accum)));
    REQUIRE_MESSAGE(r.code == 0, r.all());
  }
  return name;
}

// TP=2 over the reference's recipe, 20 steps, a checkpoint every 10 (made once)
std::string tp2_run() {
  static bool made = false;
  if (!std::exchange(made, true)) {
    auto r = run_cmd(train(recipe("tp2", 20, 10, "tensor = 2\n") + " --nproc-per-node 2 --master-port 29811"));
    REQUIRE_MESSAGE(r.code == 0, r.all());
    CHECK_MESSAGE(r.all().find("tensor parallel: 2 ranks per group") != std::string::npos, r.all());
  }
  return "tp2";
}

// TP=2 with sequence parallelism over the reference's recipe, 20 steps, a checkpoint every 10 (made once)
std::string tp2sp_run() {
  static bool made = false;
  if (!std::exchange(made, true)) {
    auto r = run_cmd(train(recipe("tp2sp", 20, 10, "tensor = 2\nsequence = true\n") +
                           " --nproc-per-node 2 --master-port 29841"));
    REQUIRE_MESSAGE(r.code == 0, r.all());
    CHECK_MESSAGE(r.all().find("sequence parallel") != std::string::npos, r.all());
  }
  return "tp2sp";
}

}  // namespace

TEST_SUITE("integration") {

TEST_CASE("tensor parallel: TP=2 gives the per-step losses and evaluations of one process") {
  const std::string ref = reference(1);
  tp2_run();
  check_close("tp2 train", train_losses(run_dir("tp2")), train_losses(run_dir(ref)), 20);
  check_close("tp2 eval", eval_losses(run_dir("tp2")), eval_losses(run_dir(ref)), 2);
  MESSAGE("TP=2 vs one process over 20 steps: largest relative loss difference "
          << worst_relative(train_losses(run_dir("tp2")), train_losses(run_dir(ref))));
  // the checkpoint is the universal one: full HF-named tensors, one optimizer file
  check_weights(ckpt("tp2", 20), ckpt(ref, 20));
  CHECK(entries_with_prefix(ckpt("tp2", 20), "optim-") == std::vector<std::string>{"optim-00000-of-00001.safetensors"});
  CHECK(CheckpointManager::verify(ckpt("tp2", 20)) == "");
}

TEST_CASE("tensor parallel: DP2 x TP2 on 4 ranks gives the losses of one process with grad_accum 2") {
  const std::string ref = reference(2);
  auto r = run_cmd(train(recipe("dp2tp2", 20, 10, "tensor = 2\n") + " --nproc-per-node 4 --master-port 29813"));
  REQUIRE_MESSAGE(r.code == 0, r.all());
  CHECK_MESSAGE(r.all().find("data parallel: 2 ranks") != std::string::npos, r.all());
  check_close("dp2tp2 train", train_losses(run_dir("dp2tp2")), train_losses(run_dir(ref)), 20);
  check_close("dp2tp2 eval", eval_losses(run_dir("dp2tp2")), eval_losses(run_dir(ref)), 2);
  MESSAGE("DP2 x TP2 vs one process (grad_accum 2): largest relative loss difference "
          << worst_relative(train_losses(run_dir("dp2tp2")), train_losses(run_dir(ref))));
  check_weights(ckpt("dp2tp2", 20), ckpt(ref, 20));
}

TEST_CASE("tensor parallel: DP2 x TP2 with ZeRO-1 and ZeRO-2 and ZeRO-3 gives the losses of one process with grad_accum 2") {
  const std::string ref = reference(2);
  struct Layout {
    std::string name, extra;
    int port;
  };
  const std::vector<Layout> layouts = {{"dp2tp2z1", "tensor = 2\nzero = 1\n", 29881},
                                       {"dp2tp2z2", "tensor = 2\nzero = 2\n", 29883},
                                       {"dp2tp2z3", "tensor = 2\nzero = 3\n", 29885},
                                       {"dp2tp2z3sp", "tensor = 2\nzero = 3\nsequence = true\n", 29887}};
  for (const Layout& l : layouts) {
    auto r = run_cmd(train(recipe(l.name, 20, 10, l.extra) + " --nproc-per-node 4 --master-port " + std::to_string(l.port)));
    REQUIRE_MESSAGE(r.code == 0, r.all());
    CHECK_MESSAGE(r.all().find("data parallel: 2 ranks") != std::string::npos, r.all());
    check_close(l.name + " train", train_losses(run_dir(l.name)), train_losses(run_dir(ref)), 20);
    check_close(l.name + " eval", eval_losses(run_dir(l.name)), eval_losses(run_dir(ref)), 2);
    MESSAGE(l.name << " vs one process (grad_accum 2): largest relative loss difference "
                   << worst_relative(train_losses(run_dir(l.name)), train_losses(run_dir(ref))));
    // the clipped norm too: the shards' squares summed over the data group, the cut ones over tp
    check_close(l.name + " grad_norm", metric_series(run_dir(l.name), "grad_norm"),
                metric_series(run_dir(ref), "grad_norm"), 20);
    // the universal checkpoint: one optimizer file, whatever the shards were
    check_weights(ckpt(l.name, 20), ckpt(ref, 20));
    CHECK(entries_with_prefix(ckpt(l.name, 20), "optim-") ==
          std::vector<std::string>{"optim-00000-of-00001.safetensors"});
  }
  // ZeRO-3's step-10 checkpoint resumed on one process continues as the reference did
  const std::string rd = copy_run("dp2tp2z3", "dp2tp2z3_then_one", 10);
  auto b = run_cmd(train("--resume " + rd + " --set parallel.tensor=1 --set parallel.zero=0 --set train.grad_accum=2"));
  REQUIRE_MESSAGE(b.code == 0, b.all());
  const std::vector<double> all = train_losses(run_dir(ref));
  check_close("DP2 x TP2 ZeRO-3 checkpoint resumed on one process", train_losses(run_dir("dp2tp2z3_then_one")),
              std::vector<double>(all.begin() + 10, all.end()), 10);
  check_weights(ckpt("dp2tp2z3_then_one", 20), ckpt(ref, 20));
}

TEST_CASE("tensor parallel: recompute block and selective are bit-identical to none under TP=2 and under sequence parallel ZeRO-3") {
  // TP=2 (2 ranks), then DP2 x TP2 with parallel.sequence and ZeRO-3 (4 ranks): the
  // recomputed forwards run the tensor-parallel collectives again; selective keeps the GEMM
  // outputs (a row-parallel layer's reduce-scattered block among them)
  struct Case {
    std::string base, extra;
    int nproc, port;
  };
  const std::vector<Case> cases = {{"tp2rc", "tensor = 2\n", 2, 29861},
                                   {"tp2spz3rc", "tensor = 2\nsequence = true\nzero = 3\n", 4, 29863}};
  for (const Case& c : cases) {
    std::vector<double> none;
    for (const char* rc : {"none", "block", "selective"}) {
      const std::string name = c.base + "_" + rc;
      auto r = run_cmd(train(recipe(name, 12, 0, c.extra) + " --nproc-per-node " + std::to_string(c.nproc) +
                             " --master-port " + std::to_string(c.port) + " --set train.recompute=" + rc));
      REQUIRE_MESSAGE(r.code == 0, r.all());
      const std::vector<double> losses = train_losses(run_dir(name));
      REQUIRE(losses.size() == 12);
      if (none.empty()) none = losses;
      else CHECK_MESSAGE(losses == none, name << " differs from train.recompute = none");
    }
  }
}

TEST_CASE("tensor parallel: the bytes a rank sends in its tp group match the analytic volume") {
  // TP=2, 5 steps of 1 micro-batch of N = 2 x 16 tokens, width C = 32, 2 blocks, vocabulary
  // 256 (128 rows per rank), f32, AdamW, clipping on; then one evaluation batch of 2 sequences
  // and the final checkpoint. Counted by the "tp" communicator (run_end comm_bytes.tp). Per
  // training micro-batch: forward, the vocabulary-parallel embedding's all-reduce of [N, C],
  // each block's two row-parallel all-reduces of [N, C], and the cross-entropy's max all-reduce
  // of the N row maxima and sum all-reduce of 2N (sum of exp, target logit); backward, the head's
  // input-gradient all-reduce and each block's two column-parallel ones, all [N, C]. Per step
  // the clipping norm's one-float all-reduce of the cut parameters' squares and the two-float
  // agreement on a stop and an fp16 overflow (parallel::tp_agree). The evaluation
  // is a forward without gradients. The checkpoint all-gathers the rank's local parameters
  // and AdamW's two states (3 x the local element count).
  const int steps = 5, T = 2, L = 2, C = 32, V = 256, block = 16;
  const int64_t N = 2 * 16;
  const std::string path = recipe("tp_bytes", steps, 0, "tensor = 2\n");
  auto r = run_cmd(train(path + " --nproc-per-node 2 --master-port 29869 --set eval.every_steps=0 "
                                "--set eval.max_batches=1"));
  REQUIRE_MESSAGE(r.code == 0, r.all());
  const nlohmann::json end = last_event(run_dir("tp_bytes"), "run_end");
  REQUIRE_MESSAGE(end.contains("comm_bytes"), end.dump());
  REQUIRE_MESSAGE(end["comm_bytes"].contains("tp"), end.dump());
  const auto& tp = end["comm_bytes"]["tp"];
  // bytes rank 0 sends in a Gloo all-reduce of `n` floats on 2 ranks (rank 0 logs run_end)
  auto ar = [&](int64_t n) { return comm::wire::gloo_allreduce(uint64_t(n), 4, T, 0); };
  const uint64_t act = ar(N * C), ce = ar(N) + ar(2 * N);
  const uint64_t forward = (1 + 2 * L) * act + ce, backward = (1 + 2 * L) * act;
  const uint64_t want_ar = uint64_t(steps) * (forward + backward + ar(1) + ar(2)) + forward;
  // the rank's local parameters: wte's rows, wpe, per block ln_1, c_attn (q k v columns),
  // c_proj (rows), ln_2, c_fc (columns), c_proj (rows) with its replicated biases, then ln_f
  const int64_t per_block = 2 * C + (C * 3 * C / T + 3 * C / T) + (C / T * C + C) + 2 * C + (C * 4 * C / T + 4 * C / T) +
                            (4 * C / T * C + C);
  const int64_t local = V / T * C + block * C + L * per_block + 2 * C;
  const uint64_t want_ag = comm::wire::ring_allgather(uint64_t(local) * 4, T) * 3;
  CHECK(tp["allreduce"].get<uint64_t>() == want_ar);
  CHECK(tp["allgather"].get<uint64_t>() == want_ag);
  CHECK(tp["reduce_scatter"].get<uint64_t>() == 0);
  CHECK(tp["p2p"].get<uint64_t>() == 0);
  MESSAGE("TP=2: all-reduce " << want_ar << " B, all-gather " << want_ag << " B as predicted");
}

TEST_CASE("tensor parallel: a TP=2 checkpoint resumes on one process and a one-process one on TP=2") {
  const std::string ref = reference(1);
  // TP=2's step-10 checkpoint, resumed on one process
  std::string rd = copy_run(tp2_run(), "tp2_then_one", 10);
  auto b = run_cmd(train("--resume " + rd + " --set parallel.tensor=1"));
  REQUIRE_MESSAGE(b.code == 0, b.all());
  auto tail = [](std::vector<double> v) { return std::vector<double>(v.begin() + std::min<size_t>(10, v.size()), v.end()); };
  const std::vector<double> ref_tail = tail(train_losses(run_dir(ref)));
  check_close("TP=2 checkpoint resumed on one process", train_losses(run_dir("tp2_then_one")), ref_tail, 10);
  check_weights(ckpt("tp2_then_one", 20), ckpt(ref, 20));
  // one process's step-10 checkpoint, resumed on TP=2
  rd = copy_run(ref, "one_then_tp2", 10);
  auto c = run_cmd(train("--resume " + rd + " --nproc-per-node 2 --master-port 29817 --set parallel.tensor=2"));
  REQUIRE_MESSAGE(c.code == 0, c.all());
  check_close("one-process checkpoint resumed on TP=2", train_losses(run_dir("one_then_tp2")), ref_tail, 10);
  check_weights(ckpt("one_then_tp2", 20), ckpt(ref, 20));
}

// Mixed precision under tensor parallelism: the compute copy of each rank's part of the weights,
// activations in the compute dtype, the row-parallel partial products all-reduced in it (as
// Megatron does: each pairwise add in f32 rounded once), the vocabulary-parallel embedding
// exact, its cross-entropy in f32 from the 16-bit logits. One process in the same precision
// rounds the whole products once instead: 1e-3 relative over 20 steps (measured: see the
// MESSAGE; bf16's own step is 2^-8 = 3.9e-3).
TEST_CASE("tensor parallel: bf16 and fp16 (with sequence parallelism and ZeRO-3) give the losses of one process in the same precision") {
  struct Case {
    std::string dtype, extra, what;
    int nproc, port;
  };
  for (const Case& c : {Case{"bf16", "", "TP=2", 2, 29851}, Case{"fp16", "sequence = true\n", "TP=2 + sequence parallel", 2, 29853},
                        Case{"bf16", "zero = 3\n", "DP2 x TP2 with ZeRO-3", 4, 29861}}) {
    const int dp = c.nproc / 2;  // one process runs the data ranks' batches as micro-batches
    const std::string ref = "tp_ref_" + c.dtype + std::to_string(dp), name = "tp2_" + c.dtype + std::to_string(c.port);
    const std::string prec = " --set precision.dtype=" + c.dtype;
    auto a = run_cmd(train(recipe(ref, 20, 0, "") + prec + " --set train.grad_accum=" + std::to_string(dp)));
    REQUIRE_MESSAGE(a.code == 0, a.all());
    auto b = run_cmd(train(recipe(name, 20, 0, "tensor = 2\n" + c.extra) + prec + " --nproc-per-node " +
                           std::to_string(c.nproc) + " --master-port " + std::to_string(c.port)));
    REQUIRE_MESSAGE(b.code == 0, b.all());
    const auto lt = train_losses(run_dir(name)), lr = train_losses(run_dir(ref));
    check_close(name, lt, lr, 20, 1e-3);
    MESSAGE(c.what << " " << c.dtype << " vs one process in " << c.dtype
                   << " over 20 steps: largest relative loss difference " << worst_relative(lt, lr)
                   << " (fp32 TP=2: see the first test)");
    CHECK(lr.back() < lr.front());
  }
}

// Each rank of a tensor group checks its own gradients (the cut parameters differ); the
// verdict must reach the other: rank 1 overflowing alone at step 3 skips the step on both, as
// one process with the same inf does.
TEST_CASE("tensor parallel: an fp16 overflow on one rank of the tensor group skips the step on both") {
  const std::string fp16 = " --set precision.dtype=fp16 --set precision.loss_scale=256";
  auto a = run_cmd("DTRAIN_FAILPOINTS=step.grad_overflow=0:3 " + train(recipe("tp_ovf_ref", 6, 0, "") + fp16));
  REQUIRE_MESSAGE(a.code == 0, a.all());
  auto b = run_cmd("DTRAIN_FAILPOINTS=step.grad_overflow=1:3 " +
                   train(recipe("tp_ovf", 6, 0, "tensor = 2\n") + fp16 + " --nproc-per-node 2 --master-port 29855"));
  REQUIRE_MESSAGE(b.code == 0, b.all());
  check_overflow_skipped(b.all(), 2);
  check_close("tp_ovf", train_losses(run_dir("tp_ovf")), train_losses(run_dir("tp_ovf_ref")), 6, 1e-3);
}

// A preemption's SIGTERM reaches the ranks of a tensor group at different instants; the stop is
// agreed over the group, so both finish the same step, write one checkpoint and exit 0 (before,
// the signalled rank went on to the checkpoint's gathers while the other ran the next step's
// collectives: a timeout and no checkpoint). Only rank 1 is signalled here.
TEST_CASE("tensor parallel: SIGTERM to one rank of the tensor group stops both at one step with a checkpoint") {
  const std::string rec = recipe("tp_sig", 100000, 0, "tensor = 2\n");
  const std::string rd = run_dir("tp_sig");
  auto r = run_cmd("(" + train(rec + " --nproc-per-node 2 --master-port 29857") + " > " + kWork +
                   "/tp_sig.out 2>&1 & L=$!; for i in $(seq 1 300); do "
                   "[ $(grep -c '\"kind\":\"train\"' " + rd + "/metrics.jsonl 2>/dev/null || echo 0) -ge 5 ] && break; sleep 0.1; done; "
                   "W=$(pgrep -P $L | sort -n | tail -1); kill -TERM $W; wait $L; echo rc=$?)");
  INFO(r.all() << run_cmd("cat " + kWork + "/tp_sig.out").out);
  CHECK(r.out.find("rc=0") != std::string::npos);
  const auto cks = entries_with_prefix(rd + "/checkpoints", "step_");
  REQUIRE(cks.size() == 1);
  CHECK(CheckpointManager::verify(rd + "/checkpoints/" + cks[0]) == "");
  // and the run goes on from it
  auto c = run_cmd(train("--resume " + rd + " --nproc-per-node 2 --master-port 29859 --set train.max_steps=" +
                         std::to_string(std::stoll(cks[0].substr(5)) + 2)));
  CHECK_MESSAGE(c.code == 0, c.all());
}

TEST_CASE("tensor parallel: keys that do not fit exit 2 naming them") {
  struct Bad {
    std::string extra, args, words;
  };
  const std::vector<Bad> bad = {
      {"tensor = 2\n", "", "parallel.tensor = 2 must divide the world size 1"},
      {"tensor = 3\n", " --nproc-per-node 2 --master-port 29819", "parallel.tensor = 3 must divide the world size 2"},
      {"tensor = 2\n", " --nproc-per-node 2 --master-port 29821 --set model.n_head=1",
       "parallel.tensor = 2 must divide model.n_head = 1"},
  };
  for (const Bad& b : bad) {
    auto r = run_cmd(train(recipe("tp_bad", 2, 0, b.extra) + b.args));
    INFO(b.extra << b.args << "\n" << r.all());
    check_refused(r, b.words);
  }
  // another model family
  check_refuses_resnet(kBin, kWork, "tp_resnet", "tensor = 2\n", 29829);
}

}  // TEST_SUITE

TEST_SUITE("integration") {

TEST_CASE("sequence parallel: TP=2 with parallel.sequence gives the per-step losses and evaluations of one process") {
  const std::string ref = reference(1);
  tp2sp_run();
  check_close("tp2sp train", train_losses(run_dir("tp2sp")), train_losses(run_dir(ref)), 20);
  check_close("tp2sp eval", eval_losses(run_dir("tp2sp")), eval_losses(run_dir(ref)), 2);
  MESSAGE("TP=2 + sequence parallel vs one process over 20 steps: largest relative loss difference "
          << worst_relative(train_losses(run_dir("tp2sp")), train_losses(run_dir(ref))) << " (eval "
          << worst_relative(eval_losses(run_dir("tp2sp")), eval_losses(run_dir(ref))) << ")");
  check_weights(ckpt("tp2sp", 20), ckpt(ref, 20));
  CHECK(CheckpointManager::verify(ckpt("tp2sp", 20)) == "");
}

TEST_CASE("sequence parallel: DP2 x TP2 with parallel.sequence on 4 ranks gives the losses of grad_accum 2") {
  const std::string ref = reference(2);
  auto r = run_cmd(train(recipe("dp2tp2sp", 20, 10, "tensor = 2\nsequence = true\n") +
                         " --nproc-per-node 4 --master-port 29843"));
  REQUIRE_MESSAGE(r.code == 0, r.all());
  CHECK_MESSAGE(r.all().find("data parallel: 2 ranks") != std::string::npos, r.all());
  check_close("dp2tp2sp train", train_losses(run_dir("dp2tp2sp")), train_losses(run_dir(ref)), 20);
  check_close("dp2tp2sp eval", eval_losses(run_dir("dp2tp2sp")), eval_losses(run_dir(ref)), 2);
  MESSAGE("DP2 x TP2 + sequence parallel vs one process (grad_accum 2): largest relative loss difference "
          << worst_relative(train_losses(run_dir("dp2tp2sp")), train_losses(run_dir(ref))));
  check_weights(ckpt("dp2tp2sp", 20), ckpt(ref, 20));
}

TEST_CASE("sequence parallel: a TP=2 + parallel.sequence checkpoint resumes on one process") {
  const std::string ref = reference(1);
  const std::string rd = copy_run(tp2sp_run(), "tp2sp_then_one", 10);
  auto b = run_cmd(train("--resume " + rd + " --set parallel.tensor=1 --set parallel.sequence=false"));
  REQUIRE_MESSAGE(b.code == 0, b.all());
  const std::vector<double> all = train_losses(run_dir(ref));
  const std::vector<double> ref_tail(all.begin() + std::min<size_t>(10, all.size()), all.end());
  check_close("TP=2 + SP checkpoint resumed on one process", train_losses(run_dir("tp2sp_then_one")), ref_tail, 10);
  check_weights(ckpt("tp2sp_then_one", 20), ckpt(ref, 20));
}

TEST_CASE("sequence parallel: parallel.sequence without tensor parallelism or a block size it does not divide exits 2") {
  struct Bad {
    std::string extra, args, words;
  };
  const std::vector<Bad> bad = {
      {"sequence = true\n", "", "parallel.sequence = true needs parallel.tensor > 1"},
      {"sequence = true\n", " --nproc-per-node 2 --master-port 29845", "parallel.sequence = true needs parallel.tensor > 1"},
      {"tensor = 2\nsequence = true\n", " --nproc-per-node 2 --master-port 29847 --set model.block_size=15",
       "parallel.tensor = 2 and model.block_size = 15"},
  };
  for (const Bad& b : bad) {
    auto r = run_cmd(train(recipe("sp_bad", 2, 0, b.extra) + b.args));
    INFO(b.extra << b.args << "\n" << r.all());
    check_refused(r, b.words);
    CHECK(r.all().find("parallel.sequence") != std::string::npos);
  }
  // the one-process commands that take a recipe refuse every model-parallel key, naming it
  for (const std::string cmd : {"bench", "plan"})
    for (const std::string key : {"sequence = true", "tensor = 2", "pipeline = 2"}) {
      auto r = run_cmd(kBin + " " + cmd + " " + recipe("sp_bad", 5, 0, key + "\n") +
                       (cmd == "bench" ? " --steps 1 --warmup 0" : " --nproc 1"));
      INFO(cmd << " " << key << "\n" << r.all());
      CHECK(r.code == 2);
      CHECK(r.err_lines() == 1);
      CHECK(r.all().find("dtrain " + cmd + ": parallel." + key) != std::string::npos);
    }
}

}  // TEST_SUITE
