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

struct LoraOptions;  // nn/lora.h

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
  bool read_f32 = false;      // layers read it through param() (f32) also under mixed precision
                              // (norm weights and biases): ZeRO-3 gathers its f32 values too
  int64_t offset = 0;         // element offset in the flat buffer (set by declare)
  // Tensor parallelism (nn/tp.h): tp_dim >= 0 means `shape` is rank r's part of a full tensor
  // cut along axis tp_dim, which holds tp_blocks equal blocks (c_attn's q, k, v) each cut into
  // T equal parts (rank r keeps part r of every block). tp_full: the full tensor's size along
  // tp_dim in the universal layout; it may be below T * shape[tp_dim] (tp_blocks 1: GPT's
  // vocabulary padded further under T, those rows are zeros outside the universal layout).
  int tp_dim = -1;
  int tp_blocks = 1;
  int64_t tp_full = 0;
  // A replicated parameter (tp_dim -1) whose gradient each rank computes only in part, summed
  // over the group after the backward (parallel::tp_sum_partial_grads): the norms under
  // sequence parallelism (each rank applies them to its block of rows only) and the Llama
  // family's key/value projections when their heads are replicated over the ranks (each rank's
  // query heads read them). Not part of the layout: a checkpoint does not record it.
  bool tp_partial = false;
  // The Rng stream its initial values are drawn from (set by declare: the next stream, one
  // after the last declared parameter's; ParamStore::set_next_init_stream moves it). A
  // pipeline stage declares part of a model and draws each parameter from the stream one
  // process gives it, so every layout starts from the same values.
  int64_t init_stream = -1;
};

// A contiguous element range of the flat buffers (an optimizer's or a ZeRO rank's shard).
struct FlatRange {
  int64_t begin = 0;
  int64_t end = -1;  // -1 = to the end
};

// A unit of ZeRO-3 sharding and of activation recomputation: the parameters of one
// transformer block, ResNet stage or U-Net level, a contiguous range of the flat buffers.
// Parameters declared outside begin_unit/end_unit form "root" units (each maximal run of
// them one unit), which a sharded step gathers once for the whole forward and backward.
struct UnitDesc {
  std::string name;
  int first_param = 0, end_param = 0;  // param ids [first, end)
  int64_t begin = 0, end = 0;          // flat element range
  bool root = false;
  int64_t numel() const { return end - begin; }
};

// Where a piece of the flat buffers lives in a rank's shard buffers: elements
// [global, global + count) of the flat layout are at [local, local + count).
struct FlatPiece {
  int64_t global = 0, local = 0, count = 0;
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
  // The init stream of the next declared parameter (default: its index); later ones follow.
  void set_next_init_stream(int64_t stream) { next_stream_ = stream; }

  // ---- units (ZeRO-3 / recompute) ----
  // Declaration: the parameters declared until end_unit() form unit `name`; returns its id
  // (ids follow declaration order and count the root units in between).
  int begin_unit(std::string name);
  void end_unit();
  const std::vector<UnitDesc>& units() const;  // every parameter in exactly one unit, in order
  int unit_of(int param_id) const;

  // ---- sharded storage (ZeRO-3, parallel/zero3.h) ----
  // Before finalize: keep only rank `rank`'s shard of every unit: unit u is cut into `world`
  // equal pieces of shard_size(u) = ceil(numel / world) elements (the last ones padded with
  // zeros), and this rank's pieces lie back to back in the shard buffers. The full flat
  // buffers are never allocated: param(id), cparam(id) and grad(id) resolve through the
  // window a sharder attached for the id's unit (a RuntimeFault when none is attached), and
  // flat_params()/flat_grads() are not available.
  void set_sharding(int rank, int world);
  bool sharded() const { return shard_world_ > 0; }
  int shard_rank() const { return shard_rank_; }
  int shard_world() const { return shard_world_; }
  int64_t unit_shard_size(int u) const;    // ceil(numel / world)
  int64_t unit_shard_offset(int u) const;  // where unit u's piece starts in the shard buffers
  Tensor shard_params() const;             // f32 [sum of shard sizes]
  Tensor shard_grads() const;
  Tensor unit_shard_params(int u) const;   // f32 [unit_shard_size(u)] views
  Tensor unit_shard_grads(int u) const;
  // The real elements this rank owns (padding excluded), in shard-buffer order.
  std::vector<FlatPiece> shard_pieces() const;
  // The f32 master values of shard_pieces(), back to back (reads the device): what a ZeRO-3
  // rank's model shard file holds.
  std::vector<float> shard_values() const;
  // The inverse, from the flat layout itself: `read(b, e, dst)` gives the elements [b, e) of
  // the full flat parameters; only this rank's pieces are asked for. Buffers and counters come
  // from `lookup` under their PyTorch names (validated first, UserError naming `origin`).
  using FlatRead = std::function<void(int64_t begin, int64_t end, float* dst)>;
  void import_shard(const FlatRead& read, const TensorLookup& lookup, const std::string& origin);
  // A sharder's windows over unit u's full parameters (f32, flat layout of the unit from
  // its first element), their compute-dtype cast (mixed precision; else null) and gradients
  // (null where no gradient is taken, e.g. evaluation).
  void attach_unit(int u, float* params, void* cparams, float* grads);
  void detach_unit(int u);
  bool attached(int u) const;

  // ---- tensor parallelism (nn/tp.h) ----
  // Before finalize: this store holds rank `rank` of `size`'s parts of the parameters declared
  // with ParamDesc::tp_dim (the others whole). The universal layout is the one the model has on
  // one process (the full shapes, back to back); layout_hash(), state_entries(),
  // initialize(), import_state() and export_state() speak it, so a checkpoint is the same
  // for every T: initialize() draws the full tensors and keeps this rank's parts (the values
  // of one process), import_state() slices, export_state() needs the full parameters
  // gathered (full_params, universal layout).
  void set_tensor_parallel(int rank, int size);
  int tp_rank() const { return tp_rank_; }
  int tp_size() const { return tp_size_; }
  const std::vector<ParamDesc>& universal_params() const;  // params() when tp_size() is 1
  int64_t universal_num_params() const;
  // Where rank `rank`'s flat buffer lies in the universal one (global = universal element,
  // local = this layout's element); elements in no piece are padding (zeros).
  std::vector<FlatPiece> tp_pieces(int rank) const;
  // The universal flat vector from every rank's local one (locals[r]: rank r's flat values).
  std::vector<float> tp_assemble(const std::vector<const float*>& locals) const;
  // This rank's local flat values from a universal flat vector (padding zeros).
  std::vector<float> tp_slice(const std::vector<float>& universal) const;

  // ---- frozen parameters (LoRA's base model; nn/lora.h) ----
  // Before finalize: no gradient buffer is allocated (grad(), flat_grads() are faults); layers
  // skip their parameter gradients (they still return the input gradient) and never report them
  // through Ctx::grad_ready. Nothing trains, shards or checkpoints a frozen store: it is the
  // model of model.init_from, read again on resume.
  void set_frozen(bool on);
  bool frozen() const { return frozen_; }
  // The LoRA adapters the layers of this (frozen) store attach to their targeted modules: the
  // trainable store and the options (null: no LoRA). Must outlive the model's construction.
  void set_lora(const LoraOptions* o) { lora_ = o; }
  const LoraOptions* lora() const { return lora_; }

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
  // CUDA graph does not run the host code that counts, session/step_graph.h).
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
  // Reads the device. Sharded: `full_params` must hold every parameter in the flat layout
  // (gathered by the sharder, parallel::Zero3::gather_full); unsharded it must be null.
  std::vector<Exported> export_state(const std::vector<float>* full_params = nullptr) const;
  // One parameter (a universal_params() entry) in PyTorch's name, shape and layout, from its
  // values in the universal flat layout (`src` = its first element). Needs no storage: a
  // declared-only store converts checkpoint shards with it.
  Exported export_param(const ParamDesc& d, const float* src) const;
  // The buffers and counters alone, in state order (reads the device).
  std::vector<Exported> export_buffers() const;
  // Validates every expected entry first (present, dtype, shape, byte size; UserError
  // "<origin>: tensor 'name': expected F32 [64,3,7,7], got F32 [64,3,3,3]"), then copies
  // into the model (OIHW -> OHWI for conv weights). Extra names in the source are the
  // caller's business (compare with state_entries()). keep_missing: an entry the lookup
  // does not offer keeps the model's current value instead of being an error.
  // Sharded: every rank imports the whole state and keeps its own pieces (no communication);
  // keep_missing is not supported there.
  void import_state(const TensorLookup& lookup, const std::string& origin, bool keep_missing = false);

 private:
  enum class Kind { Param, Buffer, Counter };
  struct Entry { Kind kind; int id; };
  struct BufferDesc { std::string name; Shape shape; float init_value; int64_t offset; };
  struct Counter { std::string name; int64_t value = 0; };

  void check_new_name(const std::string& name);
  std::vector<int64_t> torch_shape(const ParamDesc& d) const;
  void store_params_host(const std::vector<float>& full);  // full flat params -> storage
  struct Window { float* params = nullptr; void* cparams = nullptr; float* grads = nullptr; };
  const Window& window(int id, bool grads) const;  // the id's unit's, attached
  enum class Copy { Master, Compute, Grad };
  Tensor tensor_of(int id, Copy c) const;  // param, cparam (mixed precision) and grad

  std::vector<ParamDesc> params_;
  std::vector<BufferDesc> buffers_;
  std::vector<Counter> counters_;
  std::vector<Entry> order_;
  std::unordered_set<std::string> names_;
  int64_t num_params_ = 0, num_buf_ = 0;
  int64_t next_stream_ = 0;

  Backend* be_ = nullptr;
  DType compute_dtype_ = DType::F32;
  bool frozen_ = false;
  const LoraOptions* lora_ = nullptr;
  Buffer param_buf_, grad_buf_, buffer_buf_, compute_buf_;
  void name_for_checker() const;  // the flat buffers' ranges by parameter (stream-order checker)

  std::vector<UnitDesc> units_;    // grown by declare / begin_unit
  bool unit_open_ = false;
  std::vector<int> unit_of_;
  int shard_rank_ = 0, shard_world_ = 0;
  std::vector<int64_t> shard_off_;  // per unit; back() = total
  std::vector<Window> windows_;      // per unit
  int tp_rank_ = 0, tp_size_ = 1;
  // tp_size_ > 1: the full descriptors, planned from the declared ones when first asked
  mutable std::vector<ParamDesc> universal_;
  mutable int64_t universal_num_ = 0;
  void plan_universal() const;
};

// The initial values of `descs` (each at its offset of a flat vector of n) as
// ParamStore::initialize draws them: parameter i from Rng(seed, stream_id(i)).
std::vector<float> init_params_host(const std::vector<ParamDesc>& descs, int64_t n, uint64_t seed);

// Host-side OHWI <-> OIHW permutation of a conv weight (shape given as OHWI).
void ohwi_to_oihw(const float* src, float* dst, const Shape& ohwi);
void oihw_to_ohwi(const float* src, float* dst, const Shape& ohwi);

}  // namespace dtrain
