// ParamStore's tensor-parallel layout (nn/params.h, "tensor parallelism"): the full
// descriptors of the universal layout and where a rank's parts lie in it.
#include <algorithm>

#include "nn/params.h"

namespace dtrain {

void ParamStore::set_tensor_parallel(int rank, int size) {
  DTRAIN_CHECK(!finalized() && params_.empty(), "set_tensor_parallel after declarations");
  DTRAIN_CHECK(size >= 1 && rank >= 0 && rank < size, "tensor parallel rank {} of {}", rank, size);
  tp_rank_ = rank;
  tp_size_ = size;
}

void ParamStore::plan_universal() const {
  if (tp_size_ == 1 || universal_.size() == params_.size()) return;
  universal_.clear();
  int64_t off = 0;
  for (const ParamDesc& d : params_) {
    ParamDesc u = d;
    if (d.tp_dim >= 0) {
      DTRAIN_CHECK(d.tp_dim < d.shape.ndim() && d.tp_blocks >= 1 && d.shape[d.tp_dim] % d.tp_blocks == 0 &&
                       d.tp_full > 0 && d.tp_full % d.tp_blocks == 0 &&
                       d.tp_full <= d.shape[d.tp_dim] * tp_size_ &&
                       (d.tp_blocks == 1 || d.tp_full == d.shape[d.tp_dim] * tp_size_),
                   "'{}': tensor-parallel cut of {} along {} in {} blocks to {}", d.name, d.shape.str(), d.tp_dim,
                   d.tp_blocks, d.tp_full);
      u.shape[d.tp_dim] = d.tp_full;
      u.tp_dim = -1;
    }
    u.offset = off;
    off += u.shape.numel();
    universal_.push_back(std::move(u));
  }
  universal_num_ = off;
}

const std::vector<ParamDesc>& ParamStore::universal_params() const {
  if (tp_size_ == 1) return params_;
  plan_universal();
  return universal_;
}

int64_t ParamStore::universal_num_params() const {
  if (tp_size_ == 1) return num_params_;
  plan_universal();
  return universal_num_;
}

std::vector<FlatPiece> ParamStore::tp_pieces(int rank) const {
  DTRAIN_CHECK(rank >= 0 && rank < tp_size_, "tp_pieces: rank {} of {}", rank, tp_size_);
  const std::vector<ParamDesc>& full = universal_params();
  std::vector<FlatPiece> out;
  auto add = [&](int64_t global, int64_t local, int64_t count) {
    if (count <= 0) return;
    if (!out.empty() && out.back().global + out.back().count == global && out.back().local + out.back().count == local)
      out.back().count += count;
    else
      out.push_back({global, local, count});
  };
  for (size_t i = 0; i < params_.size(); ++i) {
    const ParamDesc& d = params_[i];
    const ParamDesc& u = full[i];
    if (d.tp_dim < 0) {
      add(u.offset, d.offset, d.shape.numel());
      continue;
    }
    // [outer, axis, inner] around the cut axis; block k of rank r's part starts at axis
    // k * full_block + r * local_block of the full tensor
    int64_t outer = 1, inner = 1;
    for (int a = 0; a < d.tp_dim; ++a) outer *= d.shape[a];
    for (int a = d.tp_dim + 1; a < d.shape.ndim(); ++a) inner *= d.shape[a];
    const int64_t la = d.shape[d.tp_dim], fa = u.shape[d.tp_dim];
    const int64_t lb = la / d.tp_blocks, fb = fa / d.tp_blocks;
    const int64_t rows = std::clamp<int64_t>(fb - int64_t(rank) * lb, 0, lb);  // past tp_full: padding
    for (int64_t o = 0; o < outer; ++o)
      for (int64_t k = 0; k < d.tp_blocks; ++k)
        add(u.offset + (o * fa + k * fb + int64_t(rank) * lb) * inner, d.offset + (o * la + k * lb) * inner,
            rows * inner);
  }
  return out;
}

std::vector<float> ParamStore::tp_assemble(const std::vector<const float*>& locals) const {
  DTRAIN_CHECK(int(locals.size()) == tp_size_, "tp_assemble: {} ranks of {}", locals.size(), tp_size_);
  std::vector<float> full(static_cast<size_t>(universal_num_params()));
  for (int r = 0; r < tp_size_; ++r)
    for (const FlatPiece& p : tp_pieces(r))
      std::copy(locals[size_t(r)] + p.local, locals[size_t(r)] + p.local + p.count, full.begin() + p.global);
  return full;
}

std::vector<float> ParamStore::tp_slice(const std::vector<float>& universal) const {
  DTRAIN_CHECK(int64_t(universal.size()) == universal_num_params(), "tp_slice: {} values", universal.size());
  std::vector<float> local(static_cast<size_t>(num_params_), 0.f);
  for (const FlatPiece& p : tp_pieces(tp_rank_))
    std::copy(universal.begin() + p.global, universal.begin() + p.global + p.count, local.begin() + p.local);
  return local;
}

}  // namespace dtrain
