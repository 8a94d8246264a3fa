// `dtrain data shapes`: the synthetic-shapes segmentation generator.
#include "data/shapes.h"

#include <algorithm>
#include <cmath>
#include <tuple>

#include "core/error.h"
#include "core/log.h"
#include "core/rng.h"
#include "data/dataset_writer.h"
#include "data/image_codec.h"

namespace dtrain {
namespace data {

std::vector<std::string> shape_class_names(int classes) {
  static const char* kinds[] = {"circle", "rectangle", "triangle"};
  std::vector<std::string> v{"background"};
  for (int c = 1; c < classes; ++c) {
    std::string n = kinds[(c - 1) % 3];
    if ((c - 1) / 3 > 0) n += std::to_string((c - 1) / 3 + 1);
    v.push_back(n);
  }
  return v;
}

void make_shape_sample(uint64_t seed, int64_t index, int S, int K, std::vector<uint8_t>& rgb,
                       std::vector<uint8_t>& mask) {
  Rng r(seed, stream_id(uint64_t(index), 0x5348415045ULL));
  rgb.assign(size_t(S) * S * 3, 0);
  mask.assign(size_t(S) * S, 0);
  float bg[3];
  for (float& c : bg) c = 40.f + 80.f * r.uniform();
  for (size_t p = 0; p < size_t(S) * S; ++p)
    for (int c = 0; c < 3; ++c)
      rgb[p * 3 + size_t(c)] = uint8_t(std::clamp(bg[c] + 50.f * (r.uniform() - 0.5f), 0.f, 255.f));
  const int nshapes = 1 + int(r.below(3));
  for (int s = 0; s < nshapes && K > 1; ++s) {
    const int cls = 1 + int(r.below(uint64_t(K - 1)));
    const int kind = (cls - 1) % 3;
    float col[3];
    for (float& c : col) c = 130.f + 125.f * r.uniform();
    const float cx = S * (0.15f + 0.7f * r.uniform()), cy = S * (0.15f + 0.7f * r.uniform());
    const float rad = S * (0.08f + 0.17f * r.uniform());
    const float hw = S * (0.08f + 0.17f * r.uniform()), hh = S * (0.08f + 0.17f * r.uniform());
    // triangle: apex up, base down
    const float ax = cx, ay = cy - rad, bx = cx - rad, by = cy + rad, qx = cx + rad, qy = cy + rad;
    auto edge = [](float x0, float y0, float x1, float y1, float x, float y) {
      return (x1 - x0) * (y - y0) - (y1 - y0) * (x - x0);
    };
    for (int y = 0; y < S; ++y)
      for (int x = 0; x < S; ++x) {
        const float px = x + 0.5f, py = y + 0.5f;
        bool in = false;
        if (kind == 0) in = (px - cx) * (px - cx) + (py - cy) * (py - cy) <= rad * rad;
        if (kind == 1) in = std::abs(px - cx) <= hw && std::abs(py - cy) <= hh;
        if (kind == 2) {
          const float e0 = edge(ax, ay, bx, by, px, py), e1 = edge(bx, by, qx, qy, px, py),
                      e2 = edge(qx, qy, ax, ay, px, py);
          in = (e0 >= 0 && e1 >= 0 && e2 >= 0) || (e0 <= 0 && e1 <= 0 && e2 <= 0);
        }
        if (!in) continue;
        const size_t p = size_t(y) * S + size_t(x);
        mask[p] = uint8_t(cls);
        for (int c = 0; c < 3; ++c)
          rgb[p * 3 + size_t(c)] = uint8_t(std::clamp(col[c] + 30.f * (r.uniform() - 0.5f), 0.f, 255.f));
      }
  }
}

}  // namespace data

void data::write_shapes_dataset(const data::ShapesSpec& a) {
  if (a.out.empty()) user_error("dtrain data shapes: --out is required");
  if (a.count < 1) user_error("--count: expected a positive integer, got {}", a.count);
  if (a.size < 8 || a.size > 4096) user_error("--size: expected 8..4096 pixels, got {}", a.size);
  if (a.classes < 2 || a.classes > 255) user_error("--classes: expected 2..255 (background included), got {}", a.classes);
  if (!(a.val_fraction >= 0 && a.val_fraction < 1))
    user_error("--val-fraction: expected a number in [0, 1), got {}", a.val_fraction);
  const int64_t nval = int64_t(std::llround(a.count * a.val_fraction));
  const int64_t ntrain = a.count - nval;
  if (ntrain < 1) user_error("--val-fraction {} leaves no training samples of {}", a.val_fraction, a.count);
  data::DatasetStager stager(a.out);
  if (stager.existing())
    user_error("{}: already holds a dataset (manifest.json); remove it or use another --out", a.out);
  data::Manifest m;
  m.classes = data::shape_class_names(a.classes);
  std::vector<std::string> splits;
  std::vector<uint8_t> rgb, mask;
  for (const auto& [name, begin, end] :
       {std::tuple<std::string, int64_t, int64_t>{"train", 0, ntrain}, {"val", ntrain, a.count}}) {
    if (end <= begin) continue;
    data::ShardedSplitWriter w(stager.split_dir(name), name, 1000);
    w.expect(end - begin);
    for (int64_t i = begin; i < end; ++i) {
      data::make_shape_sample(a.seed, i, a.size, a.classes, rgb, mask);
      const std::string image = data::encode_png(rgb.data(), a.size, a.size, 3),
                        mask_png = data::encode_png(mask.data(), a.size, a.size, 1);
      w.add(fmt::format("{}_{:06d}", name, i), {{"png", image}, {"mask.png", mask_png}});
    }
    data::SplitInfo s;
    s.samples = end - begin;
    s.num_classes = a.classes;
    s.channels = 3;
    s.height = s.width = a.size;
    s.shards = w.finish();
    m.splits[name] = s;
    splits.push_back(name);
  }
  stager.commit(m, splits);
  log::console(fmt::format("{}: wrote {} train + {} val shape images ({}x{}, {} classes)", a.out,
                           ntrain, nval, a.size, a.size, a.classes));
}

}  // namespace dtrain
