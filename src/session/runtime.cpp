#include "session/runtime.h"

#include "session/pipeline.h"

#include <algorithm>

#include "core/error.h"
#include "core/log.h"

namespace dtrain {

Runtime::Runtime(const Config& c) : cfg(c) {}
Runtime::~Runtime() = default;

Tensor Runtime::loss_slot(int64_t i) {
  const size_t need = size_t(i + 1) * sizeof(double);
  if (loss_slots_.bytes() < need) loss_slots_ = Buffer(*be, std::max<size_t>(need, 8 * sizeof(double)));
  return loss_slots_.tensor(DType::F64, Shape{1}, size_t(i) * sizeof(double));
}

std::vector<double> Runtime::read_loss_slots(int64_t n) {
  std::vector<double> v(static_cast<size_t>(n));
  if (n > 0) {
    DTRAIN_CHECK(loss_slots_.bytes() >= size_t(n) * sizeof(double), "read_loss_slots({}) of {} bytes", n,
                 loss_slots_.bytes());
    be->copy_to_host(v.data(), loss_slots_.data(), size_t(n) * sizeof(double));
  }
  return v;
}

Tensor stage_upload(Backend& be, Buffer& buf, const void* src, DType dtype, const Shape& shape) {
  const size_t bytes = size_t(shape.numel()) * dtype_size(dtype);
  if (buf.bytes() < bytes) buf = Buffer(be, bytes);
  be.copy_from_host(buf.data(), src, bytes);
  return buf.tensor(dtype, shape);
}

void prepare_lora(Runtime& s) {
  if (!s.cfg.lora.enabled) return;
  s.base = std::make_unique<ParamStore>();
  s.base->set_frozen(true);
  if (s.params.tp_size() > 1) s.base->set_tensor_parallel(s.params.tp_rank(), s.params.tp_size());
  s.lora.adapters = &s.params;
  s.lora.rank = int(s.cfg.lora.rank);
  s.lora.alpha = float(s.cfg.lora.alpha);
  s.lora.targets = lora_targets(s.cfg.lora.target_modules);
  s.base->set_lora(&s.lora);
}

void finalize_lora(Runtime& s, DType compute) {
  if (!s.base) return;
  s.base->set_lora(nullptr);  // the layers are built
  if (s.params.num_params() == 0)
    user_error("{}: lora.target_modules = \"{}\" matches no layer of this model", s.cfg.source(),
               s.cfg.lora.target_modules);
  s.base->set_compute_dtype(compute);
  if (!s.be) return;
  s.base->finalize(*s.be);
  s.base->initialize(uint64_t(s.cfg.run.seed));
}

DType compute_dtype_of(const std::string& precision) {
  if (precision == "bf16") return DType::BF16;
  if (precision == "fp16") return DType::F16;
  if (precision == "fp32") return DType::F32;
  user_error("precision.dtype: expected \"fp32\", \"bf16\" or \"fp16\", got \"{}\"", precision);
}

Tensor to_compute(Runtime& s, const Tensor& x) {
  const DType t = s.params.compute_dtype();
  if (x.dtype == t || !is_float(x.dtype)) return x;
  Tensor y = s.arena->alloc(t, x.shape);
  s.be->cast(x, y);
  return y;
}

}  // namespace dtrain
