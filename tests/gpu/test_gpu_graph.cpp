// train.cuda_graph on CUDA: training with the forward/loss/backward of each micro-batch
// captured once and replayed (session/step_graph.h) must give what eager training gives:
// the same losses, weights, batch-norm statistics and counters, step after step, for each
// model family; the graph must really be captured and replayed, the step's phases still
// timed, freed memory must force a new capture, and the combinations a graph cannot
// replay are refused. Skips visibly without a CUDA device.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "skip.h"
#include "core/buffer.h"
#include "session/layout.h"
#include "session/step.h"

using namespace dtrain;

namespace {

const char* kResnet = R"(
[model]
kind = "resnet"
depth = 8
width = 8
stem = "imagenet"
in_channels = 3
num_classes = 10
[data]
kind = "synthetic"
synthetic_height = 32
synthetic_width = 32
[train]
batch_size = 8
[optim]
name = "sgd"
lr = 0.1
momentum = 0.9
weight_decay = 5e-4
)";

const char* kUnet = R"(
[model]
kind = "unet"
depth = 2
base_channels = 8
in_channels = 3
num_classes = 3
upsample = "transpose"
[data]
kind = "synthetic"
synthetic_height = 32
synthetic_width = 32
[train]
batch_size = 2
dice_weight = 1.0
[optim]
name = "adamw"
lr = 0.001
)";

const char* kGpt = R"(
[model]
kind = "gpt"
n_layer = 2
n_head = 2
n_embd = 64
block_size = 64
vocab_size = 300
[data]
kind = "synthetic"
[train]
batch_size = 4
clip_grad_norm = 1.0
[optim]
name = "adamw"
lr = 0.001
)";

std::unique_ptr<Session> session(const char* recipe, bool graph, const std::string& extra = "",
                                 int64_t grad_accum = 1) {
  std::string text = std::string(R"(
[run]
seed = 5
device = "cuda"
)") + recipe + extra;
  Config cfg = Config::parse(text, "gpu_graph_test.toml");
  cfg.set("train.max_steps", "100");
  cfg.set("train.grad_accum", std::to_string(grad_accum));
  cfg.set("train.cuda_graph", graph ? "true" : "false");
  return make_session(cfg, SessionOptions{});
}

std::vector<uint8_t> bytes(Session& s, const Tensor& t) {
  std::vector<uint8_t> v(t.nbytes());
  if (!v.empty()) s.be->copy_to_host(v.data(), t.data, v.size());
  return v;
}

struct Trace {
  std::vector<double> losses;
  std::vector<uint8_t> params, buffers;
  std::vector<int64_t> counters;
};

Trace finish(Session& s, std::vector<double> losses) {
  return Trace{std::move(losses), bytes(s, s.params.flat_params()), bytes(s, s.params.flat_buffers()),
               s.params.counter_values()};
}

bool same(const Trace& a, const Trace& b) {
  return a.losses == b.losses && a.params == b.params && a.buffers == b.buffers && a.counters == b.counters;
}

// Largest relative difference of the f32 parameters.
double param_err(const Trace& a, const Trace& b) {
  const size_t n = a.params.size() / 4;
  std::vector<float> x(n), y(n);
  std::memcpy(x.data(), a.params.data(), n * 4);
  std::memcpy(y.data(), b.params.data(), n * 4);
  double m = 1e-12, e = 0;
  for (size_t i = 0; i < n; ++i) {
    m = std::max(m, double(std::fabs(x[i])));
    e = std::max(e, double(std::fabs(x[i] - y[i])));
  }
  return e / m;
}

// `steps` steps at a fixed learning rate; every step's loss.
std::vector<double> run(Session& s, int first, int steps) {
  std::vector<double> l;
  for (int i = 0; i < steps; ++i) {
    StepStats st = train_step(s, first + i, 1e-3);
    REQUIRE(std::isfinite(st.loss));
    l.push_back(st.loss);
  }
  return l;
}

// Graph training against eager training of the same recipe. Eager training twice first:
// where it is bit-for-bit reproducible (our kernels, cuBLASLt), the graph must be too;
// where it is not (a cuDNN algorithm with atomics), the graph must stay within the spread
// of two eager runs.
void check_family(const char* name, const char* recipe, const std::string& extra, int micro_batches) {
  CAPTURE(name);
  CAPTURE(extra);
  const int steps = 6;
  auto e1 = session(recipe, false, extra), e2 = session(recipe, false, extra), g = session(recipe, true, extra);
  REQUIRE(g->graphs);
  Trace a = finish(*e1, run(*e1, 0, steps));
  Trace b = finish(*e2, run(*e2, 0, steps));
  std::vector<double> gl;
  for (int i = 0; i < steps; ++i) {
    StepStats st = train_step(*g, i, 1e-3);
    gl.push_back(st.loss);
    if (i >= 3) {  // replayed: the phases inside the graph are still timed
      CHECK(st.t.forward_s > 0);
      CHECK(st.t.backward_s > 0);
      CHECK(st.t.optimizer_s > 0);
    }
  }
  Trace c = finish(*g, gl);
  // steps 0 and 1 eager (the first plans memory), step 2 captures, 3..5 replay
  CHECK(g->graphs->captures() == micro_batches);
  CHECK(g->graphs->replays() == 3 * micro_batches);
  const bool eager_exact = same(a, b);
  MESSAGE(name << extra << ": eager runs bit-identical: " << eager_exact << " | graph vs eager: bit-identical "
               << same(a, c) << ", param err " << param_err(a, c) << ", last loss " << a.losses.back() << " / "
               << c.losses.back());
  CHECK(c.counters == a.counters);
  if (eager_exact) {
    CHECK(c.losses == a.losses);
    CHECK(c.params == a.params);
    CHECK(c.buffers == a.buffers);
  } else {
    // cuDNN's atomics make reruns differ in the last bits; a graph replaying stale inputs or
    // missing work would be off by far more than that
    CHECK(param_err(a, c) <= 2 * param_err(a, b) + 1e-4);
    for (int i = 0; i < steps; ++i)
      CHECK(std::fabs(c.losses[size_t(i)] - a.losses[size_t(i)]) <=
            2 * std::fabs(b.losses[size_t(i)] - a.losses[size_t(i)]) + 1e-4 * std::fabs(a.losses[size_t(i)]));
  }
}

}  // namespace

TEST_SUITE("gpu") {
  TEST_CASE("cuda graphs: graph training equals eager training for ResNet U-Net and GPT") {
    GPU_OR_SKIP();
    for (const char* p : {"bf16", "fp32"}) {
      const std::string prec = std::string("\n[precision]\ndtype = \"") + p + "\"\n";
      check_family("resnet", kResnet, prec, 1);
      check_family("unet", kUnet, prec, 1);
      check_family("gpt", kGpt, prec, 1);
    }
  }

  TEST_CASE("cuda graphs: one graph per micro-batch with gradient accumulation") {
    GPU_OR_SKIP();
    auto e = session(kGpt, false, "", 2), g = session(kGpt, true, "", 2);
    const auto le = run(*e, 0, 5), lg = run(*g, 0, 5);
    // micro-batch 0 plans the memory in step 0, so micro-batch 1 may be steady one step
    // earlier (captured in step 1): 4 or 5 replays in 5 steps
    MESSAGE("captures " << g->graphs->captures() << ", replays " << g->graphs->replays());
    CHECK(g->graphs->captures() == 2);
    CHECK(g->graphs->replays() >= 4);
    CHECK(lg == le);  // GPT's kernels are deterministic
    CHECK(bytes(*g, g->params.flat_params()) == bytes(*e, e->params.flat_params()));
  }

  TEST_CASE("cuda graphs: freed device memory makes the next steps capture again") {
    GPU_OR_SKIP();
    auto e = session(kGpt, false), g = session(kGpt, true);
    auto le = run(*e, 0, 4), lg = run(*g, 0, 4);  // eager, eager, capture, replay
    CHECK(g->graphs->captures() == 1);
    { Buffer tmp(*g->be, 1 << 20); }  // a free: the graph could point into memory given back
    auto le2 = run(*e, 4, 4), lg2 = run(*g, 4, 4);  // eager (steady), capture, replay, replay
    CHECK(g->graphs->captures() == 2);
    CHECK(g->graphs->replays() == 3);
    le.insert(le.end(), le2.begin(), le2.end());
    lg.insert(lg.end(), lg2.begin(), lg2.end());
    CHECK(lg == le);  // GPT's kernels are deterministic
  }

  TEST_CASE("cuda graphs: fp16 and data parallelism are refused with a user error") {
    GPU_OR_SKIP();
    CHECK_THROWS_AS(session(kGpt, true, "\n[precision]\ndtype = \"fp16\"\n"), UserError);
    std::string text = std::string("[run]\nseed = 5\ndevice = \"cuda\"\n") + kGpt;
    Config cfg = Config::parse(text, "gpu_graph_test.toml");
    cfg.set("train.cuda_graph", "true");
    CHECK_THROWS_AS(resolve_layout(cfg, 2), UserError);  // the layout's rule, before any session
  }
}
