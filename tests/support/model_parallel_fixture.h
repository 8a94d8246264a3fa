#pragma once
// What test_tensor_parallel.cpp and test_pipeline.cpp share: the refusals (keys that do not fit
// exit 2 naming them before any worker starts; tensor and pipeline parallelism are GPT's) and
// the check of an fp16 overflow's skip.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "run_cmd.h"

// A `train` that must be refused: exit 2, `words` in its output, no worker launched.
inline void check_refused(const CmdResult& r, const std::string& words) {
  CHECK(r.code == 2);
  CHECK(r.all().find(words) != std::string::npos);
  CHECK(r.all().find("launching") == std::string::npos);  // refused before any worker starts
}

// `bin train` of a 1-step ResNet on synthetic data with `parallel` (e.g. "tensor = 2\n") under
// [parallel], on 2 ranks at `port`, in `work`/runs/`name`.
inline void check_refuses_resnet(const std::string& bin, const std::string& work, const std::string& name,
                                 const std::string& parallel, int port) {
  std::filesystem::create_directories(work);
  const std::string path = work + "/" + name + ".toml";
  std::ofstream(path) << "[run]\nname = \"" << name << "\"\nout_dir = \"" << work << "/runs\"\ndevice = \"cpu\"\n"
                      << "[model]\nkind = \"resnet\"\ndepth = 8\nwidth = 4\nstem = \"cifar\"\nin_channels = 1\n"
                      << "num_classes = 10\n[data]\nkind = \"synthetic\"\nsynthetic_height = 8\nsynthetic_width = 8\n"
                      << "[train]\nmax_steps = 1\n[parallel]\n" << parallel << "timeout_s = 30\n";
  auto r = run_cmd(bin + " train " + path + " --nproc-per-node 2 --master-port " + std::to_string(port));
  INFO(r.all());
  CHECK(r.code == 2);
  CHECK(r.all().find("model.kind = \"resnet\"") != std::string::npos);
}

// An fp16 overflow injected at step 3 was skipped by `ranks` ranks (each logs the line once).
inline void check_overflow_skipped(const std::string& out, size_t ranks) {
  const std::string skip = "step 3: fp16 gradients overflowed (inf/nan): update skipped, loss scale 256 -> 128";
  size_t n = 0;
  for (size_t at = out.find(skip); at != std::string::npos; at = out.find(skip, at + 1)) ++n;
  CHECK_MESSAGE(n == ranks, out);
}
