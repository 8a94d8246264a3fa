#include "nn/params.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <unordered_set>

#include "core/rng.h"
#include "core/sha256.h"

namespace dtrain {

static std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += fmt::format("{}{}", i ? "," : "", s[i]);
  return out + "]";
}

// f(ohwi, oihw) for each element of an [O,KH,KW,I] weight: its offsets in the OHWI and the
// OIHW layouts, in OHWI order.
template <class F>
static void for_each_ohwi(const Shape& s, const F& f) {
  const int64_t O = s[0], KH = s[1], KW = s[2], I = s[3];
  for (int64_t o = 0; o < O; ++o)
    for (int64_t h = 0; h < KH; ++h)
      for (int64_t w = 0; w < KW; ++w)
        for (int64_t i = 0; i < I; ++i)
          f(((o * KH + h) * KW + w) * I + i, ((o * I + i) * KH + h) * KW + w);
}

void ohwi_to_oihw(const float* src, float* dst, const Shape& s) {
  for_each_ohwi(s, [&](int64_t ohwi, int64_t oihw) { dst[oihw] = src[ohwi]; });
}

void oihw_to_ohwi(const float* src, float* dst, const Shape& s) {
  for_each_ohwi(s, [&](int64_t ohwi, int64_t oihw) { dst[ohwi] = src[oihw]; });
}

void ParamStore::check_new_name(const std::string& name) {
  DTRAIN_CHECK(!finalized(), "declare '{}' after finalize", name);
  DTRAIN_CHECK(names_.insert(name).second, "duplicate state name '{}'", name);
}

int ParamStore::declare(ParamDesc d) {
  check_new_name(d.name);
  DTRAIN_CHECK(d.shape.numel() > 0, "parameter '{}' has empty shape {}", d.name, d.shape.str());
  DTRAIN_CHECK(d.layout != Layout::OHWI || d.shape.ndim() == 4, "OHWI parameter '{}' is {}",
               d.name, d.shape.str());
  // (a row-cut tensor-parallel part: its full tensor's rows)
  const int64_t rows = d.tp_dim == 0 ? d.tp_full : d.shape[0];
  DTRAIN_CHECK(d.layout != Layout::PadRows || (d.torch_rows > 0 && d.torch_rows <= rows),
               "PadRows parameter '{}' {} with torch_rows {}", d.name, d.shape.str(), d.torch_rows);
  d.offset = num_params_;
  num_params_ += d.shape.numel();
  if (d.init_stream < 0) d.init_stream = next_stream_;
  next_stream_ = d.init_stream + 1;
  params_.push_back(std::move(d));
  order_.push_back({Kind::Param, int(params_.size() - 1)});
  const int id = int(params_.size() - 1);
  if (!unit_open_ && (units_.empty() || !units_.back().root)) {
    UnitDesc r;
    r.name = "root." + std::to_string(std::count_if(units_.begin(), units_.end(), [](auto& u) { return u.root; }));
    r.first_param = r.end_param = id;
    r.begin = r.end = params_.back().offset;
    r.root = true;
    units_.push_back(std::move(r));
  }
  units_.back().end_param = id + 1;
  units_.back().end = num_params_;
  unit_of_.push_back(int(units_.size() - 1));
  return id;
}

int ParamStore::begin_unit(std::string name) {
  DTRAIN_CHECK(!finalized() && !unit_open_, "begin_unit('{}'): after finalize or inside another unit", name);
  UnitDesc u;
  u.name = std::move(name);
  u.first_param = u.end_param = int(params_.size());
  u.begin = u.end = num_params_;
  units_.push_back(std::move(u));
  unit_open_ = true;
  return int(units_.size() - 1);
}

void ParamStore::end_unit() {
  DTRAIN_CHECK(unit_open_, "end_unit without begin_unit");
  DTRAIN_CHECK(units_.back().numel() > 0, "unit '{}' declares no parameter", units_.back().name);
  unit_open_ = false;
}

const std::vector<UnitDesc>& ParamStore::units() const { return units_; }

int ParamStore::unit_of(int param_id) const { return unit_of_.at(size_t(param_id)); }

void ParamStore::set_sharding(int rank, int world) {
  DTRAIN_CHECK(!finalized(), "ParamStore: set_sharding after finalize");
  DTRAIN_CHECK(world >= 1 && rank >= 0 && rank < world, "ParamStore: shard rank {} of {}", rank, world);
  shard_rank_ = rank;
  shard_world_ = world;
}

int64_t ParamStore::unit_shard_size(int u) const {
  const int64_t n = units_.at(size_t(u)).numel();
  return (n + shard_world_ - 1) / shard_world_;
}

int64_t ParamStore::unit_shard_offset(int u) const { return shard_off_.at(size_t(u)); }

Tensor ParamStore::shard_params() const {
  DTRAIN_CHECK(sharded(), "shard_params: the store is not sharded");
  return param_buf_.tensor(DType::F32, Shape{shard_off_.back()});
}
Tensor ParamStore::shard_grads() const {
  DTRAIN_CHECK(sharded(), "shard_grads: the store is not sharded");
  return grad_buf_.tensor(DType::F32, Shape{shard_off_.back()});
}
Tensor ParamStore::unit_shard_params(int u) const {
  return shard_params().slice0(unit_shard_offset(u), unit_shard_offset(u) + unit_shard_size(u));
}
Tensor ParamStore::unit_shard_grads(int u) const {
  return shard_grads().slice0(unit_shard_offset(u), unit_shard_offset(u) + unit_shard_size(u));
}

std::vector<FlatPiece> ParamStore::shard_pieces() const {
  std::vector<FlatPiece> out;
  for (size_t u = 0; u < units_.size(); ++u) {
    const int64_t s = unit_shard_size(int(u));
    const int64_t b = std::min(units_[u].end, units_[u].begin + shard_rank_ * s);
    const int64_t e = std::min(units_[u].end, b + s);
    if (e > b) out.push_back({b, shard_off_[u], e - b});
  }
  return out;
}

void ParamStore::attach_unit(int u, float* params, void* cparams, float* grads) {
  DTRAIN_CHECK(sharded() && params && (cparams != nullptr) == mixed(), "attach_unit({})", u);
  windows_.at(size_t(u)) = Window{params, cparams, grads};
  if (StreamChecker* c = be_->stream_checker()) {  // the window's pieces, by the names they hold now
    const UnitDesc& d = units_.at(size_t(u));
    for (int id = d.first_param; id < d.end_param; ++id) {
      const ParamDesc& p = params_[size_t(id)];
      const int64_t at = p.offset - d.begin, n = p.shape.numel();
      c->name(params + at, size_t(n) * 4, "ZeRO-3 window: param " + p.name);
      if (cparams)
        c->name(static_cast<char*>(cparams) + size_t(at) * dtype_size(compute_dtype_),
                size_t(n) * dtype_size(compute_dtype_), "ZeRO-3 window: compute copy of " + p.name);
      if (grads) c->name(grads + at, size_t(n) * 4, "ZeRO-3 window: grad of " + p.name);
    }
  }
}
void ParamStore::detach_unit(int u) { windows_.at(size_t(u)) = Window{}; }
bool ParamStore::attached(int u) const { return windows_.at(size_t(u)).params != nullptr; }

const ParamStore::Window& ParamStore::window(int id, bool grads) const {
  const Window& w = windows_.at(size_t(unit_of_.at(size_t(id))));
  const char* what = grads ? "gradient" : "parameter";
  if (!w.params || (grads && !w.grads))
    fault("ZeRO-3: {} of '{}' used while its unit '{}' is not gathered", what, params_.at(size_t(id)).name,
          units_[size_t(unit_of_[size_t(id)])].name);
  return w;
}

int ParamStore::declare_buffer(std::string name, Shape shape, float init_value) {
  check_new_name(name);
  buffers_.push_back({std::move(name), shape, init_value, num_buf_});
  num_buf_ += shape.numel();
  order_.push_back({Kind::Buffer, int(buffers_.size() - 1)});
  return int(buffers_.size() - 1);
}

int ParamStore::declare_counter(std::string name) {
  check_new_name(name);
  counters_.push_back({std::move(name), 0});
  order_.push_back({Kind::Counter, int(counters_.size() - 1)});
  return int(counters_.size() - 1);
}

void ParamStore::finalize(Backend& be) {
  DTRAIN_CHECK(!finalized(), "ParamStore finalized twice");
  DTRAIN_CHECK(!unit_open_, "finalize inside unit '{}'", units_.back().name);
  if (tp_size_ > 1) plan_universal();  // (ZeRO-3 then shards this rank's local layout)
  be_ = &be;
  buffer_buf_ = Buffer(be, size_t(num_buf_) * 4);
  if (sharded()) {
    shard_off_.assign(1, 0);
    for (size_t u = 0; u < units_.size(); ++u) shard_off_.push_back(shard_off_.back() + unit_shard_size(int(u)));
    windows_.assign(units_.size(), Window{});
    param_buf_ = Buffer(be, size_t(shard_off_.back()) * 4);
    grad_buf_ = Buffer(be, size_t(shard_off_.back()) * 4);
    if (StreamChecker* c = be.stream_checker())
      for (size_t u = 0; u < units_.size(); ++u) {
        const size_t at = size_t(shard_off_[u]) * 4, n = size_t(shard_off_[u + 1] - shard_off_[u]) * 4;
        if (n == 0) continue;
        c->name(static_cast<char*>(param_buf_.data()) + at, n, "ZeRO-3 shard of params of unit " + units_[u].name);
        c->name(static_cast<char*>(grad_buf_.data()) + at, n, "ZeRO-3 shard of grads of unit " + units_[u].name);
      }
    Tensor p = shard_params();
    if (p.numel()) be.fill(p, 0.f);  // the padding stays zero
    zero_grads();
    return;
  }
  param_buf_ = Buffer(be, size_t(num_params_) * 4);
  if (!frozen_) grad_buf_ = Buffer(be, size_t(num_params_) * 4);
  if (mixed()) compute_buf_ = Buffer(be, size_t(num_params_) * dtype_size(compute_dtype_));
  name_for_checker();
  zero_grads();
}

void ParamStore::name_for_checker() const {
  StreamChecker* c = be_->stream_checker();
  if (!c) return;
  auto name = [&](const Buffer& b, size_t esize, int64_t offset, int64_t n, const std::string& label) {
    if (b.data() && n > 0) c->name(static_cast<char*>(b.data()) + size_t(offset) * esize, size_t(n) * esize, label);
  };
  name(param_buf_, 4, 0, num_params_, "flat params");
  name(grad_buf_, 4, 0, num_params_, "flat grads");
  name(compute_buf_, dtype_size(compute_dtype_), 0, num_params_, "flat compute copy");
  for (const ParamDesc& p : params_) {
    name(param_buf_, 4, p.offset, p.shape.numel(), "param " + p.name);
    name(grad_buf_, 4, p.offset, p.shape.numel(), "grad of " + p.name);
    name(compute_buf_, dtype_size(compute_dtype_), p.offset, p.shape.numel(), "compute copy of " + p.name);
  }
  for (const BufferDesc& b : buffers_) name(buffer_buf_, 4, b.offset, b.shape.numel(), "buffer " + b.name);
}

void ParamStore::set_frozen(bool on) {
  DTRAIN_CHECK(!finalized(), "ParamStore: set_frozen after finalize");
  DTRAIN_CHECK(!on || !sharded(), "ParamStore: a frozen store is never sharded");
  frozen_ = on;
}

void ParamStore::set_compute_dtype(DType t) {
  DTRAIN_CHECK(!finalized(), "ParamStore: set_compute_dtype after finalize");
  DTRAIN_CHECK(is_float(t), "ParamStore: compute dtype {} is not a float type", dtype_name(t));
  compute_dtype_ = t;
}

void ParamStore::refresh_compute() {
  if (!mixed() || num_params_ == 0 || sharded()) return;  // sharded: cast by the sharder per unit
  Tensor master = flat_params();
  Tensor copy = compute_buf_.tensor(compute_dtype_, Shape{num_params_});
  backend().cast(master, copy);
}

Backend& ParamStore::backend() const {
  DTRAIN_CHECK(be_, "ParamStore used before finalize");
  return *be_;
}

static Tensor flat_view(const Buffer& b, Backend* be, int64_t offset, Shape s) {
  DTRAIN_CHECK(be, "ParamStore used before finalize");
  return b.tensor(DType::F32, s, size_t(offset) * 4);
}

// Parameter id in one of its three copies: the f32 master, the compute-dtype copy or the f32
// gradient; from its unit's attached window under ZeRO-3, else from the flat buffer.
Tensor ParamStore::tensor_of(int id, Copy c) const {
  const ParamDesc& d = params_.at(size_t(id));
  DTRAIN_CHECK(be_, "ParamStore used before finalize");
  const DType t = c == Copy::Compute ? compute_dtype_ : DType::F32;
  const size_t es = dtype_size(t);
  if (sharded()) {
    const int64_t at = d.offset - units_[size_t(unit_of_[size_t(id)])].begin;  // into the unit's window
    const Window& w = window(id, c == Copy::Grad);
    void* base = c == Copy::Master ? static_cast<void*>(w.params) : c == Copy::Grad ? w.grads : w.cparams;
    return Tensor(static_cast<char*>(base) + size_t(at) * es, t, be_->device(), d.shape);
  }
  const Buffer& b = c == Copy::Master ? param_buf_ : c == Copy::Grad ? grad_buf_ : compute_buf_;
  return b.tensor(t, d.shape, size_t(d.offset) * es);
}
Tensor ParamStore::param(int id) const { return tensor_of(id, Copy::Master); }
Tensor ParamStore::cparam(int id) const { return mixed() ? tensor_of(id, Copy::Compute) : param(id); }
Tensor ParamStore::grad(int id) const {
  DTRAIN_CHECK(!frozen_, "ParamStore: gradient of frozen parameter '{}'", params_.at(size_t(id)).name);
  return tensor_of(id, Copy::Grad);
}
Tensor ParamStore::buffer(int id) const {
  const BufferDesc& d = buffers_.at(size_t(id));
  return flat_view(buffer_buf_, be_, d.offset, d.shape);
}
Tensor ParamStore::flat_params() const {
  DTRAIN_CHECK(!sharded(), "flat_params: not available with sharded parameters (ZeRO-3)");
  return flat_view(param_buf_, be_, 0, {num_params_});
}
Tensor ParamStore::flat_grads() const {
  DTRAIN_CHECK(!sharded(), "flat_grads: not available with sharded parameters (ZeRO-3)");
  DTRAIN_CHECK(!frozen_, "flat_grads: a frozen store has no gradients");
  return flat_view(grad_buf_, be_, 0, {num_params_});
}
Tensor ParamStore::flat_buffers() const { return flat_view(buffer_buf_, be_, 0, {num_buf_}); }

void ParamStore::zero_grads() {
  if (frozen_) return;
  Tensor g = sharded() ? shard_grads() : flat_grads();
  if (num_params_) backend().fill(g, 0.f);
}

std::vector<int64_t> ParamStore::counter_values() const {
  std::vector<int64_t> v;
  v.reserve(counters_.size());
  for (const Counter& c : counters_) v.push_back(c.value);
  return v;
}

void ParamStore::add_counters(const std::vector<int64_t>& delta) {
  DTRAIN_CHECK(delta.size() == counters_.size(), "add_counters: {} values for {} counters", delta.size(),
               counters_.size());
  for (size_t i = 0; i < delta.size(); ++i) counters_[i].value += delta[i];
}

int ParamStore::find_param(const std::string& name) const {
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].name == name) return int(i);
  return -1;
}

std::string ParamStore::layout_hash() const {
  Sha256 h;
  for (const ParamDesc& d : universal_params()) {
    std::string line = d.name + " " + d.shape.str() + " @" + std::to_string(d.offset) + "\n";
    h.update(line.data(), line.size());
  }
  return h.hex();
}

std::vector<float> init_params_host(const std::vector<ParamDesc>& descs, int64_t num, uint64_t seed) {
  std::vector<float> host(static_cast<size_t>(num));
  for (size_t i = 0; i < descs.size(); ++i) {
    const ParamDesc& d = descs[i];
    float* p = host.data() + d.offset;
    const int64_t n = d.shape.numel();
    Rng rng(seed, stream_id(d.init_stream >= 0 ? uint64_t(d.init_stream) : uint64_t(i)));
    switch (d.init) {
      case Init::Zeros: std::fill(p, p + n, 0.f); break;
      case Init::Ones: std::fill(p, p + n, 1.f); break;
      case Init::KaimingNormalFanOut: {
        DTRAIN_CHECK(d.fan_out > 0, "'{}': fan_out not set", d.name);
        const float std = std::sqrt(2.0f / float(d.fan_out));
        for (int64_t k = 0; k < n; ++k) p[k] = std * rng.normal();
        break;
      }
      case Init::LinearDefault: {
        DTRAIN_CHECK(d.fan_in > 0, "'{}': fan_in not set", d.name);
        const float bound = 1.0f / std::sqrt(float(d.fan_in));
        for (int64_t k = 0; k < n; ++k) p[k] = (2.f * rng.uniform() - 1.f) * bound;
        break;
      }
      case Init::Normal:
        for (int64_t k = 0; k < n; ++k) p[k] = d.init_arg * rng.normal();
        break;
      case Init::Uniform:
        for (int64_t k = 0; k < n; ++k) p[k] = (2.f * rng.uniform() - 1.f) * d.init_arg;
        break;
    }
    if (d.layout == Layout::PadRows)
      std::fill(p + d.torch_rows * (n / d.shape[0]), p + n, 0.f);
  }
  return host;
}

void ParamStore::initialize(uint64_t seed) {
  Backend& be = backend();
  // tensor parallel: the full tensors as one process draws them, this rank's parts kept
  if (tp_size_ > 1)
    store_params_host(tp_slice(init_params_host(universal_, universal_num_, seed)));
  else
    store_params_host(init_params_host(params_, num_params_, seed));
  std::vector<float> bufs(static_cast<size_t>(num_buf_));
  for (const auto& b : buffers_)
    std::fill(bufs.begin() + b.offset, bufs.begin() + b.offset + b.shape.numel(), b.init_value);
  if (num_buf_) be.copy_from_host(buffer_buf_.data(), bufs.data(), bufs.size() * 4);
  for (auto& c : counters_) c.value = 0;
  zero_grads();
  refresh_compute();
}

void ParamStore::store_params_host(const std::vector<float>& full) {
  DTRAIN_CHECK(int64_t(full.size()) == num_params_, "store_params_host: {} values", full.size());
  if (!num_params_) return;
  if (!sharded()) {
    backend().copy_from_host(param_buf_.data(), full.data(), full.size() * 4);
    return;
  }
  for (const FlatPiece& p : shard_pieces())
    backend().copy_from_host(static_cast<float*>(param_buf_.data()) + p.local, full.data() + p.global,
                             size_t(p.count) * 4);
}

std::vector<ParamSegment> ParamStore::segments(bool decay_bias_and_norm) const {
  std::vector<ParamSegment> out;
  for (const auto& d : params_) {
    const bool decay = decay_bias_and_norm || d.decay;
    const int64_t n = d.shape.numel();
    if (!out.empty() && out.back().decay == decay && out.back().offset + out.back().count == d.offset)
      out.back().count += n;
    else
      out.push_back({d.offset, n, decay});
  }
  return out;
}

std::vector<int64_t> ParamStore::torch_shape(const ParamDesc& d) const {
  if (d.layout == Layout::OHWI) return {d.shape[0], d.shape[3], d.shape[1], d.shape[2]};
  if (d.layout == Layout::PadRows) {
    std::vector<int64_t> s(d.shape.begin(), d.shape.end());
    s[0] = d.torch_rows;
    return s;
  }
  return std::vector<int64_t>(d.shape.begin(), d.shape.end());
}

std::vector<StateEntry> ParamStore::state_entries() const {
  std::vector<StateEntry> out;
  for (const auto& e : order_) {
    if (e.kind == Kind::Param) {
      const ParamDesc& d = universal_params()[size_t(e.id)];
      out.push_back({d.name, "F32", torch_shape(d)});
    } else if (e.kind == Kind::Buffer) {
      const BufferDesc& b = buffers_[size_t(e.id)];
      out.push_back({b.name, "F32", std::vector<int64_t>(b.shape.begin(), b.shape.end())});
    } else {
      out.push_back({counters_[size_t(e.id)].name, "I64", {}});
    }
  }
  return out;
}

// The lookup's tensor for `w`, checked (present, dtype, shape, byte size; UserError naming
// `origin` and the tensor); nullopt when it is absent and `may_miss`.
static std::optional<ImportTensor> checked_tensor(const StateEntry& w, const TensorLookup& lookup,
                                                  const std::string& origin, bool may_miss) {
  std::optional<ImportTensor> t = lookup(w.name);
  if (!t && may_miss) return std::nullopt;
  if (!t) user_error("{}: tensor '{}' is missing (expected {} {})", origin, w.name, w.dtype, shape_str(w.shape));
  if (t->dtype != w.dtype || t->shape != w.shape)
    user_error("{}: tensor '{}': expected {} {}, got {} {}", origin, w.name, w.dtype, shape_str(w.shape), t->dtype,
               shape_str(t->shape));
  int64_t n = 1;
  for (int64_t d : w.shape) n *= d;
  const size_t bytes = size_t(n) * (w.dtype == "I64" ? 8 : 4);
  if (t->nbytes != bytes || (bytes && !t->data))
    user_error("{}: tensor '{}': expected {} bytes of data, got {}", origin, w.name, bytes, t->nbytes);
  return t;
}

ParamStore::Exported ParamStore::export_param(const ParamDesc& d, const float* src) const {
  const int64_t n = d.layout == Layout::PadRows ? d.torch_rows * (d.shape.numel() / d.shape[0]) : d.shape.numel();
  Exported x{d.name, "F32", torch_shape(d), std::vector<uint8_t>(size_t(n) * 4)};
  if (d.layout == Layout::OHWI)
    ohwi_to_oihw(src, reinterpret_cast<float*>(x.bytes.data()), d.shape);
  else
    std::memcpy(x.bytes.data(), src, x.bytes.size());
  return x;
}

std::vector<ParamStore::Exported> ParamStore::export_state(const std::vector<float>* full_params) const {
  const bool gathered = sharded() || tp_size_ > 1;
  DTRAIN_CHECK(gathered == (full_params != nullptr) &&
                   (!full_params || int64_t(full_params->size()) == universal_num_params()),
               "export_state: the gathered parameters are required exactly when sharded or tensor parallel");
  std::vector<float> params(full_params ? 0 : static_cast<size_t>(num_params_));
  if (!full_params && num_params_) backend().copy_to_host(params.data(), param_buf_.data(), params.size() * 4);
  std::vector<Exported> bufs = export_buffers();
  std::vector<Exported> out;
  size_t b = 0;
  for (const auto& e : order_) {
    if (e.kind == Kind::Param) {
      const ParamDesc& d = universal_params()[size_t(e.id)];
      out.push_back(export_param(d, (full_params ? full_params->data() : params.data()) + d.offset));
    } else {
      out.push_back(std::move(bufs.at(b++)));
    }
  }
  return out;
}

std::vector<ParamStore::Exported> ParamStore::export_buffers() const {
  std::vector<float> bufs(static_cast<size_t>(num_buf_));
  if (num_buf_) backend().copy_to_host(bufs.data(), buffer_buf_.data(), bufs.size() * 4);
  std::vector<Exported> out;
  for (const auto& e : order_) {
    if (e.kind == Kind::Buffer) {
      const BufferDesc& b = buffers_[size_t(e.id)];
      Exported x{b.name, "F32", std::vector<int64_t>(b.shape.begin(), b.shape.end()),
                 std::vector<uint8_t>(size_t(b.shape.numel()) * 4)};
      std::memcpy(x.bytes.data(), bufs.data() + b.offset, x.bytes.size());
      out.push_back(std::move(x));
    } else if (e.kind == Kind::Counter) {
      const Counter& c = counters_[size_t(e.id)];
      Exported x{c.name, "I64", {}, std::vector<uint8_t>(8)};
      std::memcpy(x.bytes.data(), &c.value, 8);
      out.push_back(std::move(x));
    }
  }
  return out;
}

std::vector<float> ParamStore::shard_values() const {
  DTRAIN_CHECK(sharded(), "shard_values: the store is not sharded");
  std::vector<float> out;
  for (const FlatPiece& p : shard_pieces()) {
    const size_t at = out.size();
    out.resize(at + size_t(p.count));
    backend().copy_to_host(out.data() + at, static_cast<const float*>(param_buf_.data()) + p.local,
                           size_t(p.count) * 4);
  }
  return out;
}

void ParamStore::import_shard(const FlatRead& read, const TensorLookup& lookup, const std::string& origin) {
  DTRAIN_CHECK(sharded() && tp_size_ == 1, "import_shard: the store is not sharded (or tensor parallel)");
  // 1. the buffers and counters, validated before anything is touched
  const std::vector<StateEntry> want = state_entries();  // order_'s order
  std::vector<std::pair<Entry, ImportTensor>> got;
  for (size_t i = 0; i < order_.size(); ++i)
    if (order_[i].kind != Kind::Param) got.push_back({order_[i], *checked_tensor(want[i], lookup, origin, false)});
  // 2. this rank's pieces of the parameters (a read error leaves the store as it was)
  std::vector<float> values;
  const std::vector<FlatPiece> pieces = shard_pieces();
  for (const FlatPiece& p : pieces) {
    const size_t at = values.size();
    values.resize(at + size_t(p.count));
    read(p.global, p.global + p.count, values.data() + at);
  }
  size_t at = 0;
  for (const FlatPiece& p : pieces) {
    backend().copy_from_host(static_cast<float*>(param_buf_.data()) + p.local, values.data() + at,
                             size_t(p.count) * 4);
    at += size_t(p.count);
  }
  std::vector<float> bufs(static_cast<size_t>(num_buf_));
  for (const auto& [e, t] : got)
    if (e.kind == Kind::Buffer)
      std::memcpy(bufs.data() + buffers_[size_t(e.id)].offset, t.data, t.nbytes);
    else
      std::memcpy(&counters_[size_t(e.id)].value, t.data, 8);
  if (num_buf_) backend().copy_from_host(buffer_buf_.data(), bufs.data(), bufs.size() * 4);
  refresh_compute();
}

void ParamStore::import_state(const TensorLookup& lookup, const std::string& origin, bool keep_missing) {
  Backend& be = backend();
  const std::vector<StateEntry> want = state_entries();
  std::vector<ImportTensor> got(want.size());
  std::vector<bool> keep(want.size(), false);
  // 1. validate everything before touching the model
  for (size_t i = 0; i < want.size(); ++i) {
    std::optional<ImportTensor> t = checked_tensor(want[i], lookup, origin, keep_missing);
    if (t)
      got[i] = *t;
    else
      keep[i] = true;
  }
  // 2. copy (over the current values where some are kept)
  std::vector<float> params(static_cast<size_t>(universal_num_params())), bufs(static_cast<size_t>(num_buf_));
  if (std::find(keep.begin(), keep.end(), true) != keep.end()) {
    if (sharded()) user_error("{}: importing only some tensors is not supported with ZeRO-3", origin);
    if (tp_size_ > 1)
      user_error("{}: importing only some tensors is not supported with tensor parallelism (parallel.tensor = {})",
                 origin, tp_size_);
    if (num_params_) be.copy_to_host(params.data(), param_buf_.data(), params.size() * 4);
    if (num_buf_) be.copy_to_host(bufs.data(), buffer_buf_.data(), bufs.size() * 4);
  }
  for (size_t i = 0; i < order_.size(); ++i) {
    if (keep[i]) continue;
    const Entry& e = order_[i];
    const ImportTensor& t = got[i];
    if (e.kind == Kind::Param) {
      const ParamDesc& d = universal_params()[size_t(e.id)];
      float* dst = params.data() + d.offset;
      if (d.layout == Layout::OHWI) {
        std::vector<float> tmp(size_t(d.shape.numel()));
        std::memcpy(tmp.data(), t.data, t.nbytes);
        oihw_to_ohwi(tmp.data(), dst, d.shape);
      } else {
        std::memcpy(dst, t.data, t.nbytes);
        if (d.layout == Layout::PadRows)  // padding rows: zeros
          std::fill(dst + t.nbytes / 4, dst + d.shape.numel(), 0.f);
      }
    } else if (e.kind == Kind::Buffer) {
      std::memcpy(bufs.data() + buffers_[size_t(e.id)].offset, t.data, t.nbytes);
    } else {
      std::memcpy(&counters_[size_t(e.id)].value, t.data, 8);
    }
  }
  store_params_host(tp_size_ > 1 ? tp_slice(params) : params);
  if (num_buf_) be.copy_from_host(buffer_buf_.data(), bufs.data(), bufs.size() * 4);
  refresh_compute();
}

}  // namespace dtrain
