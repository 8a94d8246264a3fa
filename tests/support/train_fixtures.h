#pragma once
// Shared by the end-to-end training tests: a small slice of the real Fashion-MNIST
// (prepared once per build directory, under a file lock because ctest runs test cases as
// parallel processes), a tiny ResNet recipe writer and readers of a run directory.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "fmnist_fixture.h"
#include "run_cmd.h"
#include "run_readers.h"

namespace stdfs = std::filesystem;

namespace {

const std::string kBin = dtrain_bin();
const std::string kWork = std::string(DTRAIN_BUILD_DIR) + "/test_train";

// A small slice of the real Fashion-MNIST (tests/support/fmnist_fixture.h).
const std::string& dataset() { return fmnist_slice(); }

std::string recipe(const std::string& name, const std::string& extra = "") {
  const std::string& data = dataset();  // creates kWork too, before the file is opened
  std::string path = kWork + "/" + name + ".toml";
  std::ofstream f(path);
  REQUIRE_MESSAGE(f.good(), "cannot write " << path);
  f << "[run]\nname = \"" << name << "\"\nout_dir = \"" << kWork << "/runs\"\nseed = 7\ndevice = \"cpu\"\nthreads = 1\n"
    << "[model]\nkind = \"resnet\"\ndepth = 8\nwidth = 4\nstem = \"cifar\"\nin_channels = 1\nnum_classes = 10\n"
    << "[data]\npath = \"" << data << "\"\nmean = [0.286]\nstd = [0.353]\ncrop_padding = 2\nhflip = true\nworkers = 2\n"
    << "[train]\nbatch_size = 16\nmax_steps = 12\n"
    << "[optim]\nname = \"sgd\"\nlr = 0.05\nmomentum = 0.9\nnesterov = true\nweight_decay = 5e-4\n"
    << "[schedule]\nkind = \"cosine\"\nwarmup_steps = 3\n"
    << "[checkpoint]\nevery_steps = 4\nkeep_last = 5\n"
    << "[eval]\nevery_steps = 0\nbatch_size = 100\nmax_batches = 2\n"
    << "[log]\nevery_steps = 1\n"
    << extra;
  return path;
}

std::string run_dir(const std::string& name) { return kWork + "/runs/" + name; }

void clean(const std::string& name) { stdfs::remove_all(run_dir(name)); }

std::vector<nlohmann::json> jsonl(const std::string& path) { return read_jsonl(path); }

std::vector<double> losses(const std::string& name) { return train_losses(run_dir(name)); }

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string final_weights(const std::string& name) {
  std::string latest = slurp(run_dir(name) + "/checkpoints/latest");
  while (!latest.empty() && (latest.back() == '\n' || latest.back() == ' ')) latest.pop_back();
  return slurp(run_dir(name) + "/checkpoints/" + latest + "/model.safetensors");
}

}  // namespace
