// Model-level GPU check: one full training step (forward, loss, backward, SGD update) of a
// ResNet on CUDA and on the CPU from the same recipe, seed and batch; loss, gradients and
// updated weights must agree. Skips visibly without a CUDA device.
#include <doctest/doctest.h>

#include <cmath>

#include "skip.h"
#include "session/step.h"

using namespace dtrain;

namespace {

std::unique_ptr<Session> tiny_session(const std::string& device, const std::string& extra = "",
                                      const std::string& run_extra = "") {
  std::string text = R"(
[run]
seed = 3
device = ")" + device + R"("
threads = 2
)" + run_extra + R"(
[model]
kind = "resnet"
depth = 8
width = 8
stem = "cifar"
in_channels = 3
num_classes = 10
[data]
kind = "synthetic"
synthetic_height = 16
synthetic_width = 16
[train]
batch_size = 8
max_steps = 10
[optim]
name = "sgd"
lr = 0.1
momentum = 0.9
nesterov = true
weight_decay = 5e-4
[precision]
tf32 = false
)" + extra;
  return make_session(Config::parse(text, "gpu_model_test.toml"), SessionOptions{});
}

std::vector<float> host(Session& s, const Tensor& t) {
  std::vector<float> v(size_t(t.numel()));
  s.be->copy_to_host(v.data(), t.data, t.nbytes());
  return v;
}

double max_norm_err(const std::vector<float>& a, const std::vector<float>& b) {
  double maxabs = 1e-12, err = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    maxabs = std::max(maxabs, double(std::fabs(b[i])));
    err = std::max(err, double(std::fabs(a[i] - b[i])));
  }
  return err / maxabs;
}

}  // namespace

TEST_SUITE("gpu") {
void check_steps_match_cpu(Session& cpu_s, Session& gpu_s) {
  Session* cpu = &cpu_s;
  Session* gpu = &gpu_s;
  REQUIRE(gpu->be->device().is_cuda());
  for (int step = 0; step < 3; ++step) {
    StepStats a = train_step(*cpu, step, 0.05);
    StepStats b = train_step(*gpu, step, 0.05);
    CHECK(std::isfinite(b.loss));
    CHECK(std::fabs(a.loss - b.loss) <= 1e-4 * std::max(1.0, std::fabs(a.loss)));
    double gerr = max_norm_err(host(*gpu, gpu->params.flat_grads()), host(*cpu, cpu->params.flat_grads()));
    double perr = max_norm_err(host(*gpu, gpu->params.flat_params()), host(*cpu, cpu->params.flat_params()));
    double berr = max_norm_err(host(*gpu, gpu->params.flat_buffers()), host(*cpu, cpu->params.flat_buffers()));
    MESSAGE("step " << step << ": loss cpu " << a.loss << " cuda " << b.loss << " | grad err " << gerr
                    << " | param err " << perr << " | bn-stat err " << berr);
    CHECK(gerr < 1e-3);
    CHECK(perr < 1e-4);
    CHECK(berr < 1e-4);
  }
}

TEST_CASE("resnet training step on CUDA matches the CPU") {
  GPU_OR_SKIP();
  auto cpu = tiny_session("cpu");
  auto gpu = tiny_session("cuda");
  check_steps_match_cpu(*cpu, *gpu);
}

// run.cudnn_benchmark: the convolution plans time cuDNN's algorithms (on scratch outputs, so
// the accumulated filter gradients survive the timing) and train the same model
TEST_CASE("resnet training steps on CUDA with run.cudnn_benchmark match the CPU") {
  GPU_OR_SKIP();
  auto cpu = tiny_session("cpu");
  auto gpu = tiny_session("cuda", "", "cudnn_benchmark = true");
  check_steps_match_cpu(*cpu, *gpu);
}
}
