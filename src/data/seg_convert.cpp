// `dtrain data segmentation IMAGES MASKS --out DIR --split S`: pairs IMAGES/<stem>.<img>
// with MASKS/<stem>.png (8-bit gray, value = class) into WebDataset shards
// (KEY.<ext> + KEY.mask.png). Checks every pair: decodable, the mask the size of its image,
// single-channel mask. Images of mixed sizes are recorded as 0x0 (data.image_size then
// resizes them). num_classes = max mask value + 1.
#include <algorithm>
#include <filesystem>
#include <map>

#include "core/error.h"
#include "core/log.h"
#include "data/dataset_writer.h"
#include "data/image_codec.h"
#include "data/shapes.h"

namespace dtrain {

namespace fs = std::filesystem;

void data::convert_segmentation(const data::SegmentationSpec& a) {
  std::error_code ec;
  if (a.images.empty() || !fs::is_directory(a.images, ec))
    user_error("{}: image folder not found (expected IMAGES/<name>.png|jpg|jpeg|bmp)", a.images);
  if (a.masks.empty() || !fs::is_directory(a.masks, ec))
    user_error("{}: mask folder not found (expected MASKS/<name>.png)", a.masks);
  if (a.out.empty()) user_error("dtrain data segmentation: --out is required");
  if (a.split.empty() || a.split.find('/') != std::string::npos || a.split[0] == '.')
    user_error("--split '{}' must be a plain name like train or val", a.split);
  std::map<std::string, fs::path> images, masks;
  for (const auto& e : fs::directory_iterator(a.images)) {
    std::string ext = e.path().extension().string();
    std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return char(std::tolower(c)); });
    if (e.is_regular_file() && (ext == ".png" || ext == ".jpg" || ext == ".jpeg" || ext == ".bmp"))
      images[e.path().stem().string()] = e.path();
  }
  for (const auto& e : fs::directory_iterator(a.masks))
    if (e.is_regular_file() && e.path().extension() == ".png") masks[e.path().stem().string()] = e.path();
  if (images.empty()) user_error("{}: no images (.png .jpg .jpeg .bmp)", a.images);
  for (const auto& [stem, p] : images)
    if (!masks.count(stem)) user_error("{}: no mask {}/{}.png for this image", p.string(), a.masks, stem);

  data::DatasetStager stager(a.out);
  data::Manifest m = stager.existing() ? *stager.existing() : data::Manifest{};
  if (m.splits.count(a.split))
    user_error("{}: split '{}' already exists; remove {} to rebuild it, or use another --out", a.out, a.split, a.out);
  data::SplitInfo s;
  data::ShardedSplitWriter w(stager.split_dir(a.split), a.split, 1000);
  w.expect(int64_t(images.size()));
  int maxv = 0;
  size_t i = 0;
  data::SplitSize sizes;
  for (const auto& [stem, ip] : images) {
    const fs::path& mp = masks[stem];
    auto ib = data::read_file_bytes(ip.string()), mb = data::read_file_bytes(mp.string());
    data::ImageInfo ii, mi;
    std::vector<uint8_t> mpx;
    std::string why;
    if (!data::check_image(ib.data(), ib.size(), ii, why, mpx))
      user_error("{}: not a decodable PNG/JPEG/BMP image ({})", ip.string(), why);
    if (!data::decode_image(mb.data(), mb.size(), 1, mpx, mi, why))
      user_error("{}: mask does not decode: {}", mp.string(), why);
    if (mi.channels != 1)
      user_error("{}: mask has {} channels, expected a single-channel 8-bit PNG (value = class)", mp.string(), mi.channels);
    if (mi.width != ii.width || mi.height != ii.height)
      user_error("{}: mask is {}x{} but its image {} is {}x{}", mp.string(), mi.width, mi.height, ip.string(),
                 ii.width, ii.height);
    sizes.add(ii.width, ii.height, ip.string());
    s.channels = std::max<int64_t>(s.channels, ii.channels >= 3 ? 3 : 1);
    for (uint8_t v : mpx) maxv = std::max<int>(maxv, v);
    std::string ext = ip.extension().string().substr(1);
    std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return char(std::tolower(c)); });
    w.add(fmt::format("{}_{:06d}", a.split, i),
          {{ext, std::string_view(reinterpret_cast<const char*>(ib.data()), ib.size())},
           {"mask.png", std::string_view(reinterpret_cast<const char*>(mb.data()), mb.size())}});
    ++i;
  }
  s.samples = int64_t(i);
  sizes.apply(s, a.split);
  s.num_classes = std::max<int64_t>(maxv + 1, m.classes.empty() ? 0 : int64_t(m.classes.size()));
  s.shards = w.finish();
  m.splits[a.split] = s;
  if (int64_t(m.classes.size()) < s.num_classes) {
    m.classes.clear();
    for (int64_t c = 0; c < s.num_classes; ++c) m.classes.push_back(c == 0 ? "background" : "class" + std::to_string(c));
  }
  stager.commit(m, {a.split});
  log::console(fmt::format("{}: wrote split '{}' ({} image/mask pairs, {} classes)", a.out, a.split, i, s.num_classes));
}

}  // namespace dtrain
