#pragma once
// `dtrain data index DIR`: writes DIR/manifest.json for WebDataset shards that another tool
// wrote (webdataset's TarWriter/ShardWriter, tar, ...), so the loaders can read them.
//
// Splits: by default every subdirectory of DIR that holds *.tar files is a split named after
// it (DIR/train/*.tar -> "train"); `--split NAME=GLOB` names them instead, GLOB relative to
// DIR with wildcards in its last component only ("train-*.tar", "val/shard-??.tar"). Shards
// are taken in name order.
//
// Every shard is read: its sha256, every sample (consecutive members sharing a key, as the
// loaders group them) and every image header. A sample needs one image (png, jpg, jpeg, bmp)
// and either KEY.cls (classification) or KEY.mask.png (segmentation); members of samples
// without an image or label (e.g. __meta__) are ignored. All images of a split must have
// one size; channels are 1 when every image is grayscale, else 3. num_classes is the
// largest label (or mask value) over all splits + 1, or --num-classes. A classification
// split is one where every sample has KEY.cls; otherwise every sample needs a mask.
// Any problem is a UserError naming the shard and sample. An existing manifest.json is
// kept unless --force.
#include <string>
#include <vector>

namespace dtrain::data {

struct IndexSpec {
  std::string dir;
  std::vector<std::string> splits;  // NAME=GLOB
  int num_classes = 0;              // 0: from the labels
  bool force = false;
};
void index_dataset(const IndexSpec& a);

}  // namespace dtrain::data
