#pragma once
// ParamStore: the single list of a model's parameters (name, shape, initializer,
// weight-decay flag, layout) from which the flat buffers, optimizer segments and
// checkpoint names/layouts are all derived (DESIGN: flat buffers).
//
//  * Parameters live back to back (no padding) in one flat f32 buffer, in declaration
//    order; gradients in a second flat f32 buffer with the same layout.
//  * Non-trained float state (BatchNorm running_mean/var) lives in a third flat f32
//    buffer. Integer counters (BatchNorm num_batches_tracked) are host int64 values,
//    exported as I64 scalars as torchvision has them.
//  * The state order (params, buffers and counters interleaved in declaration order)
//    is PyTorch's state_dict order when modules declare params then buffers.
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include "backend/backend.h"
#include "core/buffer.h"

namespace dtrain {

enum class Init {
  Zeros,
  Ones,
  KaimingNormalFanOut,  // torchvision conv: N(0, sqrt(2 / fan_out))
  LinearDefault,        // PyTorch nn.Linear (weight and bias): U(-1/sqrt(fan_in), 1/sqrt(fan_in))
  Normal,               // N(0, init_arg)
  Uniform,              // U(-init_arg, init_arg)
};

enum class Layout {
  Plain,  // same shape in the checkpoint as inside
  OHWI,   // internal conv weight [O,KH,KW,I]; PyTorch checkpoint layout is OIHW
  PadRows,  // internal [R, ...] with R >= torch_rows; the checkpoint holds the first
            // torch_rows rows (GPT's vocabulary padded to a multiple of 128); the padding
            // rows are initialised and imported as zeros
};

struct ParamDesc {
  std::string name;           // PyTorch module path, e.g. "layer1.0.conv1.weight"
  Shape shape;                // internal shape
  Init init = Init::Zeros;
  float init_arg = 0.f;       // std for Normal, bound for Uniform
  bool decay = true;          // false for biases and norm weights
  Layout layout = Layout::Plain;
  int64_t fan_in = 0, fan_out = 0;
  int64_t torch_rows = 0;     // Layout::PadRows: rows present in the checkpoint
  int64_t offset = 0;         // element offset in the flat buffer (set by declare)
};

// A contiguous element range of the flat buffers (an optimizer's or a ZeRO rank's shard).
struct FlatRange {
  int64_t begin = 0;
  int64_t end = -1;  // -1 = to the end
};

// One entry of the checkpointed state (params, buffers, counters), PyTorch's view.
struct StateEntry {
  std::string name;
  std::string dtype;            // safetensors dtype: "F32" or "I64"
  std::vector<int64_t> shape;   // PyTorch shape (conv OIHW); {} for a scalar
};

// A tensor offered to import_state (e.g. from a safetensors file); `data` is
// little-endian row-major bytes that stay valid during the call.
struct ImportTensor {
  std::string dtype;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  size_t nbytes = 0;
};
using TensorLookup = std::function<std::optional<ImportTensor>(const std::string& name)>;

class ParamStore {
 public:
  struct Exported {
    std::string name;
    std::string dtype;  // "F32" | "I64"
    std::vector<int64_t> shape;
    std::vector<uint8_t> bytes;
  };

  ParamStore() = default;
  ParamStore(const ParamStore&) = delete;
  ParamStore& operator=(const ParamStore&) = delete;

  // ---- declaration (model build; before finalize) ----
  int declare(ParamDesc d);                                          // returns param id
  int declare_buffer(std::string name, Shape shape, float init_value);  // returns buffer id
  int declare_counter(std::string name);                             // host int64, returns id

  // ---- mixed precision (DESIGN: Precision) ----
  // Before finalize: the dtype layers compute in. With BF16/F16, finalize also allocates a
  // third flat buffer, a cast copy of the f32 master parameters, which layers read through
  // cparam(); refresh_compute() re-casts it after the master copy changed (optimizer step,
  // all-gather, import). Grads and everything else stay f32.
  void set_compute_dtype(DType t);
  DType compute_dtype() const { return compute_dtype_; }
  bool mixed() const { return compute_dtype_ != DType::F32; }
  void refresh_compute();

  // ---- storage ----
  void finalize(Backend& be);     // allocates params, grads (zeroed), buffers
  void initialize(uint64_t seed); // params from Rng(seed, stream_id(index)); buffers to init
                                  // values; counters to 0; grads to 0. Same on every backend.
  bool finalized() const { return be_ != nullptr; }
  Backend& backend() const;

  Tensor param(int id) const;   // f32 master copy
  Tensor cparam(int id) const;  // compute-dtype copy (the master itself without mixed precision)
  Tensor grad(int id) const;
  Tensor buffer(int id) const;
  int64_t& counter(int id) { return counters_.at(size_t(id)).value; }
  int64_t counter(int id) const { return counters_.at(size_t(id)).value; }
  // Every counter's value, in id order; add_counters adds a delta of such values (a replayed
  // CUDA graph does not run the host code that counts, train/step_graph.h).
  std::vector<int64_t> counter_values() const;
  void add_counters(const std::vector<int64_t>& delta);

  Tensor flat_params() const;   // f32 [num_params]
  Tensor flat_grads() const;    // f32 [num_params]
  Tensor flat_buffers() const;  // f32 [num_buffer_elements]
  void zero_grads();

  int64_t num_params() const { return num_params_; }         // trainable scalars
  int64_t num_buffer_elements() const { return num_buf_; }
  const std::vector<ParamDesc>& params() const { return params_; }
  int find_param(const std::string& name) const;  // -1 when absent
  // SHA-256 (hex) of the flat layout: every parameter's name, internal shape and offset.
  // Flat state saved under one layout (optimizer shards) means nothing under another.
  std::string layout_hash() const;

  // Contiguous runs of the flat buffer with one weight-decay setting. With
  // decay_bias_and_norm every parameter is decayed (one segment).
  std::vector<ParamSegment> segments(bool decay_bias_and_norm) const;

  // ---- checkpoint support (PyTorch names, layouts and dtypes) ----
  std::vector<StateEntry> state_entries() const;       // no allocation needed
  std::vector<Exported> export_state() const;          // reads the device
  // Validates every expected entry first (present, dtype, shape, byte size; UserError
  // "<origin>: tensor 'name': expected F32 [64,3,7,7], got F32 [64,3,3,3]"), then copies
  // into the model (OIHW -> OHWI for conv weights). Extra names in the source are the
  // caller's business (compare with state_entries()). keep_missing: an entry the lookup
  // does not offer keeps the model's current value instead of being an error.
  void import_state(const TensorLookup& lookup, const std::string& origin, bool keep_missing = false);

 private:
  enum class Kind { Param, Buffer, Counter };
  struct Entry { Kind kind; int id; };
  struct BufferDesc { std::string name; Shape shape; float init_value; int64_t offset; };
  struct Counter { std::string name; int64_t value = 0; };

  void check_new_name(const std::string& name);
  std::vector<int64_t> torch_shape(const ParamDesc& d) const;

  std::vector<ParamDesc> params_;
  std::vector<BufferDesc> buffers_;
  std::vector<Counter> counters_;
  std::vector<Entry> order_;
  std::unordered_set<std::string> names_;
  int64_t num_params_ = 0, num_buf_ = 0;

  Backend* be_ = nullptr;
  DType compute_dtype_ = DType::F32;
  Buffer param_buf_, grad_buf_, buffer_buf_, compute_buf_;
};

// Host-side OHWI <-> OIHW permutation of a conv weight (shape given as OHWI).
void ohwi_to_oihw(const float* src, float* dst, const Shape& ohwi);
void oihw_to_ohwi(const float* src, float* dst, const Shape& ohwi);

}  // namespace dtrain
