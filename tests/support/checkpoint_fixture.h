#pragma once
// Checkpoints across layouts, for the tests that resume one layout's checkpoint under another
// and compare final weights: a run directory made from another's recipe and checkpoint, and
// the weights of two checkpoints compared (model.safetensors or a ZeRO-3 run's model shards,
// read through checkpoint/model_tensors.h as dtrain itself reads them).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "core/fsutil.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/model_tensors.h"
#include "checkpoint/safetensors.h"

// `to` (replaced) holds `from`'s config.toml and its checkpoint at `step`, marked latest.
inline std::string copy_run_at(const std::string& from, const std::string& to, int64_t step) {
  namespace stdfs = std::filesystem;
  const std::string name = dtrain::CheckpointManager::dir_name(step);
  stdfs::remove_all(to);
  stdfs::create_directories(to + "/checkpoints");
  stdfs::copy_file(from + "/config.toml", to + "/config.toml");
  stdfs::copy(from + "/checkpoints/" + name, to + "/checkpoints/" + name);
  dtrain::fs::write_file(to + "/checkpoints/latest", name + "\n");
  return to;
}

// The model of checkpoint `dir` as one string: every tensor's name, dtype, shape and bytes in
// PyTorch's layout, in order (for bit-for-bit comparisons across checkpoint formats).
inline std::string model_state(const std::string& dir) {
  dtrain::ModelTensors m(dir);
  std::string out;
  for (const auto& n : m.names()) {
    out += n + "|" + m.dtype(n) + "|";
    for (int64_t d : m.shape(n)) out += std::to_string(d) + ",";
    std::string bytes(m.nbytes(n), '\0');
    m.read(n, bytes.data(), bytes.size());
    out += bytes;
  }
  return out;
}

// Every f32 tensor of checkpoint dir's model within 1e-5 of the largest weight of ref_dir's
// (BatchNorm running statistics skipped: each rank keeps its own).
inline void check_weights(const std::string& dir, const std::string& ref_dir) {
  dtrain::ModelTensors a(dir), b(ref_dir);
  REQUIRE(a.names() == b.names());
  double scale = 0, worst = 0;
  std::string worst_name;
  for (const auto& n : b.names()) {
    if (n.find("running_") != std::string::npos || b.dtype(n) != "F32") continue;
    REQUIRE(a.shape(n) == b.shape(n));
    std::vector<float> u(a.nbytes(n) / 4), v(b.nbytes(n) / 4);
    a.read(n, u.data(), u.size() * 4);
    b.read(n, v.data(), v.size() * 4);
    for (size_t i = 0; i < v.size(); ++i) {
      scale = std::max(scale, double(std::fabs(v[i])));
      if (std::fabs(u[i] - v[i]) > worst) {
        worst = std::fabs(u[i] - v[i]);
        worst_name = n;
      }
    }
  }
  INFO(dir << " vs " << ref_dir << ": " << worst_name << " differs by " << worst << " (largest weight " << scale << ")");
  CHECK(scale > 0);
  CHECK(worst <= 1e-5 * scale);
}

// Every tensor of two safetensors files holds the same bytes.
inline void same_tensors(const std::string& fa, const std::string& fb) {
  dtrain::SafetensorsReader a(fa), b(fb);
  REQUIRE(a.names() == b.names());
  for (const auto& n : b.names()) {
    INFO(fa << " vs " << fb << ": tensor " << n);
    REQUIRE(a.nbytes(n) == b.nbytes(n));
    std::vector<uint8_t> u(a.nbytes(n)), v(b.nbytes(n));
    a.read(n, u.data(), u.size());
    b.read(n, v.data(), v.size());
    CHECK(std::memcmp(u.data(), v.data(), u.size()) == 0);
  }
}
