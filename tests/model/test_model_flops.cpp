// Model FLOPs for MFU: every model counts its own forward FLOPs from its layer geometry
// (Model::forward_flops). The reference below is the count dtrain made before (commit
// eb142ce, src/session/flops.cpp): it rebuilt the ResNet and U-Net geometry from parameter
// names ("layer3.0.conv1.weight") and counted GPT from the ParamStore's size. The models'
// own counts must equal it exactly, for every family and size and at odd input sizes, so
// MFU and `dtrain bench --json` report the same numbers as before.
#include <doctest/doctest.h>

#include <cstdlib>
#include <string>
#include <string_view>

#include "models/gpt.h"
#include "models/resnet.h"
#include "models/unet.h"
#include "nn/params.h"
#include "session/flops.h"
#include "session/step.h"

using namespace dtrain;

namespace {

// ---- the reference: eb142ce's src/session/flops.cpp, unchanged ----
namespace ref {

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

// GPT training FLOPs per token (PaLM): 6 N + 12 L d T, N = the ParamStore's trainable scalars.
double gpt_train_flops(const ParamStore& ps, const GptSpec& g) {
  return 6.0 * double(ps.num_params()) + 12.0 * g.n_layer * double(g.n_embd) * double(g.block_size);
}

}  // namespace ref

// Input sizes: square, odd, non-square, tiny, large.
const std::vector<std::pair<int64_t, int64_t>> kSizes = {{32, 32}, {28, 28}, {224, 224}, {33, 17}, {1, 1},
                                                          {7, 9},   {64, 48}, {255, 129}, {512, 512}};

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("ResNet forward FLOPs from its blocks equal the parameter-name count (cifar and imagenet stems)") {
    struct Case {
      std::string stem;
      int depth, width, in_channels, classes;
    };
    const std::vector<Case> cases = {
        {"cifar", 8, 0, 3, 10},      {"cifar", 8, 4, 1, 10},     {"cifar", 20, 0, 3, 10},
        {"cifar", 20, 8, 1, 100},    {"cifar", 56, 0, 3, 10},    {"imagenet", 18, 0, 3, 1000},
        {"imagenet", 18, 16, 1, 10}, {"imagenet", 34, 0, 3, 1000}, {"imagenet", 50, 0, 3, 1000},
        {"imagenet", 50, 8, 3, 7},   {"imagenet", 101, 0, 3, 1000}, {"imagenet", 152, 0, 3, 1000},
    };
    for (const Case& c : cases) {
      ParamStore ps;
      ResNetSpec spec;
      spec.stem = c.stem;
      spec.depth = c.depth;
      spec.width = c.width;
      spec.in_channels = c.in_channels;
      spec.num_classes = c.classes;
      auto model = build_resnet(spec, ps);
      for (auto [h, w] : kSizes) {
        CAPTURE(c.stem);
        CAPTURE(c.depth);
        CAPTURE(c.width);
        CAPTURE(h);
        CAPTURE(w);
        CHECK(model->forward_flops(h, w) == ref::conv_forward_flops(ps, "resnet", c.stem, 0, h, w));
      }
    }
  }

  TEST_CASE("U-Net forward FLOPs from its levels equal the parameter-name count (transpose and bilinear)") {
    for (int depth = 1; depth <= 4; ++depth)
      for (const std::string up : {"transpose", "bilinear"})
        for (int base : {4, 64}) {
          ParamStore ps;
          UNetSpec spec;
          spec.depth = depth;
          spec.base_channels = base;
          spec.in_channels = depth == 2 ? 1 : 3;
          spec.num_classes = depth + 1;
          spec.upsample = up;
          auto model = build_unet(spec, ps);
          for (auto [h, w] : kSizes) {
            CAPTURE(depth);
            CAPTURE(up);
            CAPTURE(base);
            CAPTURE(h);
            CAPTURE(w);
            CHECK(model->forward_flops(h, w) == ref::conv_forward_flops(ps, "unet", "", depth, h, w));
          }
        }
  }

  TEST_CASE("GPT training FLOPs per token from its spec equal 6N + 12LdT over the ParamStore") {
    std::vector<GptSpec> specs;
    for (const char* p : {"tiny", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"}) specs.push_back(gpt_preset(p));
    GptSpec odd = gpt_preset("tiny");  // a vocabulary that pads, an odd depth and window
    odd.n_layer = 3;
    odd.n_embd = 48;
    odd.n_head = 3;
    odd.block_size = 37;
    odd.vocab_size = 1001;
    odd.padded_vocab = 0;  // re-pad (as gpt_spec_from does)
    specs.push_back(odd);
    for (GptSpec g : specs) {
      gpt_validate(g);
      ParamStore ps;
      auto model = build_gpt(g, ps);
      CAPTURE(g.preset);
      CAPTURE(g.n_layer);
      // one token's count; the image sizes mean nothing to a GPT
      CHECK(3.0 * model->forward_flops(0, 0) == ref::gpt_train_flops(ps, g));
      CHECK(model->forward_flops(0, 0) == model->forward_flops(224, 17));
    }
  }

  TEST_CASE("train_flops_per_unit of a session equals the reference for every model family") {
    const std::string head = "[run]\nseed = 1\ndevice = \"cpu\"\nthreads = 1\n[train]\nbatch_size = 2\nmax_steps = 1\n";
    struct Case {
      std::string model, data;
      std::string kind, stem;
      int unet_depth;
    };
    const std::vector<Case> cases = {
        {"kind = \"resnet\"\ndepth = 8\nwidth = 4\nstem = \"cifar\"\nin_channels = 1\nnum_classes = 10\n",
         "synthetic_height = 12\nsynthetic_width = 13\n", "resnet", "cifar", 0},
        {"kind = \"resnet\"\ndepth = 18\nwidth = 4\nstem = \"imagenet\"\nin_channels = 3\nnum_classes = 5\n",
         "synthetic_height = 35\nsynthetic_width = 33\n", "resnet", "imagenet", 0},
        {"kind = \"unet\"\ndepth = 2\nbase_channels = 4\nin_channels = 3\nnum_classes = 3\n",
         "synthetic_height = 16\nsynthetic_width = 12\n", "unet", "", 2},
        // model.depth unset: the U-Net is 4 levels deep (the task's default), and so is its
        // count (the name-parsing count read the ResNet default, 20, and got it wrong)
        {"kind = \"unet\"\nbase_channels = 2\nin_channels = 1\nnum_classes = 2\nupsample = \"bilinear\"\n",
         "synthetic_height = 32\nsynthetic_width = 48\n", "unet", "", 4},
    };
    for (const Case& c : cases) {
      CAPTURE(c.model);
      auto s = make_session(
          Config::parse(head + "[model]\n" + c.model + "[data]\nkind = \"synthetic\"\n" + c.data, "flops_test.toml"),
          SessionOptions{});
      CHECK(train_flops_per_unit(*s) ==
            3.0 * ref::conv_forward_flops(s->params, c.kind, c.stem, c.unet_depth, s->height, s->width));
    }
    auto s = make_session(Config::parse(head + "[model]\nkind = \"gpt\"\nn_layer = 3\nvocab_size = 300\n"
                                                "[data]\nkind = \"synthetic\"\n",
                                        "flops_test.toml"),
                          SessionOptions{});
    CHECK(train_flops_per_unit(*s) == ref::gpt_train_flops(s->params, static_cast<GptModel&>(*s->model).spec()));
  }
}
