// dtrain's checkpoints read by the real ecosystem: the `safetensors` library loads
// model.safetensors into PyTorch modules with torchvision's names and layouts, strictly,
// and the loaded model predicts what dtrain predicts.
#include <doctest/doctest.h>

#include <cstdlib>
#include <regex>

#include "train_fixtures.h"

namespace {
const std::string kPy = std::string(DTRAIN_SOURCE_DIR) + "/.venv/bin/python";
const std::string kCheck = std::string(DTRAIN_TEST_DIR) + "/interop_check.py";

std::string latest_dir(const std::string& name) {
  std::string latest = slurp(run_dir(name) + "/checkpoints/latest");
  while (!latest.empty() && (latest.back() == '\n' || latest.back() == ' ')) latest.pop_back();
  return run_dir(name) + "/checkpoints/" + latest;
}

double number_after(const std::string& text, const std::string& regex) {
  std::smatch m;
  REQUIRE_MESSAGE(std::regex_search(text, m, std::regex(regex)), text);
  return std::atof(m[1].str().c_str());
}
}  // namespace

TEST_SUITE("integration") {

TEST_CASE("interop: PyTorch loads model.safetensors strictly and predicts what dtrain predicts") {
  clean("interop");
  auto t = run_cmd(kBin + " train " + recipe("interop") + " --set train.max_steps=30 --set eval.max_batches=0");
  REQUIRE_MESSAGE(t.code == 0, t.all());
  auto ev = run_cmd(kBin + " eval " + recipe("interop") + " --set eval.max_batches=0 --checkpoint " + run_dir("interop"));
  REQUIRE_MESSAGE(ev.code == 0, ev.all());
  double acc = number_after(ev.out, "test accuracy ([0-9.]+)%") / 100.0;
  CHECK(acc > 0.15);  // 30 steps of training: above chance (0.1)
  auto py = run_cmd(kPy + " " + kCheck + " cifar " + latest_dir("interop") +
                    "/model.safetensors 8 4 /usr/share/datasets/fashion-mnist 0.286 0.353");
  REQUIRE_MESSAGE(py.code == 0, py.all());
  double py_acc = number_after(py.out, "accuracy ([0-9.]+)");
  MESSAGE("dtrain eval accuracy " << acc << ", PyTorch on the same checkpoint " << py_acc);
  CHECK(std::abs(acc - py_acc) <= 0.0005);  // at most 5 of 10000 predictions differ (argmax ties)
}

TEST_CASE("interop: a ResNet-18 checkpoint loads into torchvision.models.resnet18 strictly") {
  clean("interop18");
  // the fixture recipe describes a CIFAR ResNet on Fashion-MNIST: override it to ResNet-18
  auto t = run_cmd(kBin + " train " + recipe("interop18") +
                   " --set model.depth=18 --set model.stem=imagenet --set model.width=0 --set model.in_channels=3"
                   " --set data.kind=synthetic --set data.synthetic_height=32 --set data.synthetic_width=32"
                   " --set data.mean=[] --set data.std=[] --set train.batch_size=2 --set train.max_steps=1"
                   " --set schedule.warmup_steps=0 --set checkpoint.every_steps=0");
  REQUIRE_MESSAGE(t.code == 0, t.all());
  auto py = run_cmd(kPy + " " + kCheck + " torchvision " + latest_dir("interop18") + "/model.safetensors resnet18 10");
  CHECK_MESSAGE(py.code == 0, py.all());
  CHECK(py.out.find("ok 122") != std::string::npos);  // 62 params + 60 BN buffers, as torchvision's state_dict
}
}
