#pragma once
// The safetensors file format (https://github.com/huggingface/safetensors):
//   u64 little-endian header length N | N bytes of JSON header, space-padded so the data
//   starts 8-byte aligned | data (tensors contiguous, no gaps).
// Header: {"<name>": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
//          "__metadata__": {"<key>": "<string>"}}; offsets are relative to the data start.
// Loading never executes anything from the file and validates the whole header up front.
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace dtrain {

struct StTensor {
  std::string name;
  std::string dtype;  // "F32", "F16", "BF16", "I32", "I64", "U8", "U16", ... (safetensors names)
  std::vector<int64_t> shape;
  const void* data = nullptr;
  size_t nbytes = 0;  // must equal prod(shape) * dtype size
};

// Bytes per element of a safetensors dtype name; 0 when the name is unknown.
size_t safetensors_dtype_size(const std::string& dtype);

// Writes `path` (tensors in the given order) and fsyncs it. Atomicity is the caller's
// (checkpoints are written into a temporary directory). Bad arguments -> RuntimeFault
// (they are a bug in the caller, not user input).
void write_safetensors(const std::string& path, const std::vector<StTensor>& tensors,
                       const std::map<std::string, std::string>& metadata);

// Named tensors to read (PyTorch's names, safetensors' dtype names "F32", "BF16", ...): a
// safetensors file (SafetensorsReader) or a model in any of a checkpoint's forms
// (checkpoint/model_tensors.h).
class TensorSource {
 public:
  TensorSource() = default;
  virtual ~TensorSource() = default;
  TensorSource(const TensorSource&) = delete;
  TensorSource& operator=(const TensorSource&) = delete;

  virtual const std::string& origin() const = 0;  // what messages name: the file, or the shards
  virtual bool has(const std::string& name) const = 0;
  virtual const std::string& dtype(const std::string& name) const = 0;  // UserError naming origin() when absent
  virtual std::vector<int64_t> shape(const std::string& name) const = 0;
  virtual size_t nbytes(const std::string& name) const = 0;
  // Copies the tensor's bytes (PyTorch layout) into dst; nbytes must equal its size (else UserError).
  virtual void read(const std::string& name, void* dst, size_t nbytes) const = 0;
};

class SafetensorsReader final : public TensorSource {
 public:
  // Opens the file and validates the header; any problem -> UserError naming the file.
  explicit SafetensorsReader(const std::string& path);
  ~SafetensorsReader() override;

  const std::string& path() const { return path_; }
  const std::string& origin() const override { return path_; }
  std::vector<std::string> names() const;  // in data-offset order
  bool has(const std::string& name) const override;
  const std::string& dtype(const std::string& name) const override;
  std::vector<int64_t> shape(const std::string& name) const override;
  size_t nbytes(const std::string& name) const override;
  void read(const std::string& name, void* dst, size_t nbytes) const override;
  // Copies `nbytes` bytes of the tensor starting `offset` bytes into it (only that range is
  // read from the file); a range past the tensor's end -> UserError.
  void read_range(const std::string& name, uint64_t offset, void* dst, size_t nbytes) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  struct Entry {
    std::string dtype;
    std::vector<int64_t> shape;
    uint64_t begin = 0, end = 0;  // relative to data_start_
  };
  const Entry& entry(const std::string& name) const;

  std::string path_;
  int fd_ = -1;
  uint64_t data_start_ = 0;
  std::map<std::string, Entry> entries_;
  std::vector<std::string> order_;
  std::map<std::string, std::string> metadata_;
};

// A floating-point tensor of `r` as f32 values (F16 and BF16 widened); UserError naming the
// origin and tensor for any other dtype.
std::vector<float> read_f32(const TensorSource& r, const std::string& name);

}  // namespace dtrain
