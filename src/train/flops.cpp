#include "train/flops.h"

#include <cstdlib>
#include <string_view>

#include "models/gpt.h"
#include "obs/nvml.h"
#include "obs/peak_flops.h"
#include "nn/params.h"
#include "train/session.h"

namespace dtrain {

namespace {

int64_t halve(int64_t x, int times) {  // stride-2 convs/pools with "same" padding: ceil(x / 2)
  for (int i = 0; i < times; ++i) x = (x + 1) / 2;
  return x;
}

bool starts_with(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }
bool ends_with(std::string_view s, std::string_view p) {
  return s.size() >= p.size() && s.substr(s.size() - p.size()) == p;
}

// "layer3.0.conv1.weight" -> stage 3, block 0, rest "conv1.weight"
bool parse_layer(const std::string& n, int& stage, int& block, std::string& rest) {
  if (!starts_with(n, "layer")) return false;
  char* e = nullptr;
  stage = int(std::strtol(n.c_str() + 5, &e, 10));
  if (*e != '.') return false;
  block = int(std::strtol(e + 1, &e, 10));
  if (*e != '.') return false;
  rest = std::string(e + 1);
  return true;
}

// "down.2.conv.0.weight" -> 2 (after the prefix)
int index_after(const std::string& n, size_t prefix_len) { return int(std::strtol(n.c_str() + prefix_len, nullptr, 10)); }

}  // namespace

double conv_forward_flops(const ParamStore& ps, const std::string& kind, const std::string& stem, int unet_depth,
                          int64_t h, int64_t w) {
  bool bottleneck = false;
  for (const auto& p : ps.params())
    if (p.name.find(".conv3.") != std::string::npos) bottleneck = true;
  const int stem_halvings = stem == "imagenet" ? 2 : 0;
  double total = 0;
  for (const auto& p : ps.params()) {
    if (!ends_with(p.name, ".weight") || p.shape.ndim() < 2) continue;  // biases, norms
    const double numel = double(p.shape.numel());
    int64_t pos = -1;  // positions the weight is applied at
    if (kind == "resnet") {
      int stage = 0, block = 0;
      std::string rest;
      if (p.name == "conv1.weight") {
        pos = halve(h, stem == "imagenet" ? 1 : 0) * halve(w, stem == "imagenet" ? 1 : 0);
      } else if (p.name == "fc.weight") {
        pos = 1;
      } else if (parse_layer(p.name, stage, block, rest)) {
        int halvings = stem_halvings + stage - 1;
        // a Bottleneck's first 1x1 conv of a downsampling block runs before the stride
        if (bottleneck && stage > 1 && block == 0 && rest == "conv1.weight") halvings -= 1;
        pos = halve(h, halvings) * halve(w, halvings);
      }
    } else if (kind == "unet") {
      if (starts_with(p.name, "down.")) {
        int i = index_after(p.name, 5);
        pos = halve(h, i) * halve(w, i);
      } else if (starts_with(p.name, "bottleneck.")) {
        pos = halve(h, unet_depth) * halve(w, unet_depth);
      } else if (starts_with(p.name, "up.")) {
        int i = unet_depth - 1 - index_after(p.name, 3);
        // the transposed conv runs over the coarser input ("up.J.up.weight"); the others at level i
        bool transpose = ends_with(p.name, ".up.weight");
        int lv = transpose ? i + 1 : i;
        pos = halve(h, lv) * halve(w, lv);
      } else if (p.name == "head.weight") {
        pos = h * w;
      }
    }
    if (pos < 0) continue;  // unknown layer: not counted
    total += 2.0 * numel * double(pos);
  }
  return total;
}

double train_flops_per_unit(const Session& s) {
  const std::string kind = s.cfg.s("model.kind");
  if (kind == "gpt") {
    GptSpec g = gpt_spec_from(s.cfg);
    return 6.0 * double(s.params.num_params()) + 12.0 * g.n_layer * double(g.n_embd) * double(g.block_size);
  }
  if (kind == "resnet" || kind == "unet") {
    if (s.height <= 0 || s.width <= 0) return 0;
    return 3.0 * conv_forward_flops(s.params, kind, kind == "resnet" ? s.cfg.s("model.stem") : "",
                                    int(s.cfg.i("model.depth")), s.height, s.width);
  }
  return 0;
}

std::string peak_precision(const std::string& dtype, bool tf32) {
  if (dtype == "fp32") return tf32 ? "tf32" : "fp32";
  return dtype;
}

double session_peak_flops(const Session& s, Nvml& nvml, int device_index, std::string* name) {
  const double override_tf = s.cfg.f("observability.peak_tflops");
  std::string dev_name;
  if (s.be->device().is_cuda() && nvml.available()) {
    const auto gpus = nvml.sample();
    for (const auto& g : gpus)
      if (g.index == device_index) dev_name = g.name;
    if (dev_name.empty() && !gpus.empty()) dev_name = gpus.front().name;
  }
  if (name) *name = dev_name;
  if (!s.be->device().is_cuda() && override_tf <= 0) return 0;
  return resolve_peak_flops(dev_name, peak_precision(s.cfg.s("precision.dtype"), s.cfg.b("precision.tf32")),
                            override_tf);
}

}  // namespace dtrain
