#pragma once
// Dataset converters behind `dtrain data fashion-mnist` and `dtrain data images`
// (cli/data.cpp calls these and prints the summary).
#include <cstdint>
#include <string>
#include <vector>


namespace dtrain::data {

struct FashionMnistSpec {
  std::string src = "/usr/share/datasets/fashion-mnist";  // directory with the IDX .gz files
  std::string out = "data/fashion-mnist";
  int shard_size = 10000;  // samples per tar shard
  // > 0: the last `holdout` training images form split "val" (a validation set cut from the
  // training set, for choices that must not look at the test set) and "train" keeps the rest.
  int64_t holdout = 0;
};

// An ImageFolder tree SRC/<class>/<image> -> split `split` of a WebDataset dataset at `out`.
struct ImageFolderSpec {
  std::string src;
  std::string out;
  std::string split = "train";
  int shard_size = 10000;
};

struct ConvertResult {
  std::vector<std::pair<std::string, int64_t>> splits;  // split name, samples written
  bool already_prepared = false;  // output existed and verified: nothing written
  double seconds = 0;
};

// Reads a gzip'ed (or plain) IDX file; checks the magic (0x0800 | ndims, unsigned bytes)
// and that the data size is exactly the product of the dims. Errors name the file.
std::vector<uint8_t> read_idx_gz(const std::string& path, int ndims, std::vector<uint32_t>& dims);

// limit_per_split > 0 converts only the first samples of each split (tests).
ConvertResult convert_fashion_mnist(const FashionMnistSpec& a, int64_t limit_per_split = 0);
ConvertResult convert_image_folder(const ImageFolderSpec& a);

extern const std::vector<std::string> kFashionMnistClasses;

}  // namespace dtrain::data
