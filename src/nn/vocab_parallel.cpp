#include "nn/vocab_parallel.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace dtrain {

namespace {

TensorParallelOps& group(Ctx& ctx, const char* what) {
  DTRAIN_CHECK(ctx.tp, "{}: no tensor-parallel group", what);
  return *ctx.tp;
}

Tensor upload_f32(Ctx& ctx, const std::vector<float>& v, const Shape& shape) {
  Tensor t = ctx.arena.alloc(DType::F32, shape);
  if (!v.empty()) ctx.be.copy_from_host(t.data, v.data(), v.size() * 4);
  return t;
}

// v on the device in dtype dt (exact for the 0/1 values the embedding uploads)
Tensor upload(Ctx& ctx, const std::vector<float>& v, const Shape& shape, DType dt) {
  Tensor f = upload_f32(ctx, v, shape);
  if (dt == DType::F32) return f;
  Tensor t = ctx.arena.alloc(dt, shape);
  ctx.be.cast(f, t);
  return t;
}

}  // namespace

VpEmbeddingSaved vp_embedding_fwd(Ctx& ctx, const Tensor& ids, const Tensor& wte_local, const Tensor& wpe,
                                  int64_t vocab_lo, int64_t vocab_rows, Tensor& x_out, bool sequence) {
  TensorParallelOps& tp = group(ctx, "vocab-parallel embedding");
  const DType dt = x_out.dtype;
  DTRAIN_CHECK(ids.dtype == DType::I32 && ids.ndim() == 2 && wte_local.ndim() == 2 && is_float(dt) &&
                   wte_local.dtype == dt && (!wpe.defined() || wpe.dtype == dt),
               "vocab-parallel embedding: ids {} wte {} wpe {} x {}", ids.str(), wte_local.str(), wpe.str(),
               x_out.str());
  const int64_t B = ids.dim(0), T = ids.dim(1), N = B * T, Vl = wte_local.dim(0), C = wte_local.dim(1);
  const int64_t W = tp.size(), rows = sequence ? N / W : N;  // the rows x_out holds
  DTRAIN_CHECK(x_out.numel() == rows * C && (!sequence || N % W == 0), "vocab-parallel embedding: x {} for {} tokens",
               x_out.str(), N);
  Tensor x = sequence ? ctx.arena.alloc(dt, Shape{B, T, C}) : x_out;
  std::vector<int32_t> host(static_cast<size_t>(N)), first(host.size()), scratch(host.size());
  std::vector<float> miss(host.size());
  ctx.be.copy_to_host(host.data(), ids.data, host.size() * 4);
  for (int64_t i = 0; i < N; ++i) {
    const int32_t id = host[size_t(i)];
    if (id < 0 || id >= vocab_rows)
      user_error("embedding: token id {} at position {} is outside the vocabulary [0, {})", id, i, vocab_rows);
    const bool mine = id >= vocab_lo && id < vocab_lo + Vl;
    first[size_t(i)] = mine ? int32_t(id - vocab_lo) : 0;        // forward: row 0, cancelled below
    scratch[size_t(i)] = mine ? int32_t(id - vocab_lo) : int32_t(Vl);  // backward: a dropped row
    miss[size_t(i)] = mine ? 0.f : 1.f;
  }
  VpEmbeddingSaved saved;
  saved.ids = ctx.arena.alloc(DType::I32, Shape{B, T});
  ctx.be.copy_from_host(saved.ids.data, scratch.data(), scratch.size() * 4);
  Tensor ids0 = ctx.arena.alloc(DType::I32, Shape{B, T});
  ctx.be.copy_from_host(ids0.data, first.data(), first.size() * 4);
  Tensor zero_pe = ctx.arena.alloc(dt, Shape{T, C});
  ctx.be.fill(zero_pe, 0.f);
  ctx.be.embedding_fwd(ids0, wte_local, zero_pe, x);  // x = wte_local[ids0] exactly
  // rows another rank owns read row 0: x -= miss (x) wte_local[0], exactly zero there
  Tensor x2 = x.view(Shape{N, C});
  ctx.be.gemm(false, false, -1.f, upload(ctx, miss, Shape{N, 1}, dt), wte_local.slice0(0, 1), 1.f, x2);
  // one rank's row, zeros elsewhere: wte[id] exactly (16-bit too: adding zeros rounds nothing);
  // then + wpe rounds once, as embedding_fwd does in one process
  if (!sequence) {
    tp.allreduce_sum(x2);
  } else {
    Tensor mine = x_out.view(Shape{rows * C});
    tp.reduce_scatter_sum(x2.view(Shape{N * C}), mine);
  }
  if (!wpe.defined()) return saved;  // no position embedding (the Llama family)
  // + wpe: x_out's rows are tokens [lo, lo + rows) of the flattened [B*T]; each run within one
  // sequence gets its positions
  Tensor xo = x_out.view(Shape{rows, C});
  const int64_t lo = sequence ? int64_t(tp.rank()) * rows : 0;
  for (int64_t i = lo; i < lo + rows;) {
    const int64_t pos = i % T, run = std::min(T - pos, lo + rows - i);
    Tensor xr = xo.slice0(i - lo, i - lo + run);
    ctx.be.add(xr, wpe.slice0(pos, pos + run), xr);
    i += run;
  }
  return saved;
}

void vp_embedding_bwd(Ctx& ctx, const Tensor& dy, const VpEmbeddingSaved& saved, Tensor& dwte_local, Tensor& dwpe) {
  DTRAIN_CHECK(saved.ids.defined() && dwte_local.ndim() == 2, "vocab-parallel embedding: backward without forward");
  const int64_t Vl = dwte_local.dim(0), C = dwte_local.dim(1);
  // the rank's rows plus one scratch row for the ids it does not own, then added into dwte
  Tensor rows = ctx.arena.alloc(DType::F32, Shape{Vl + 1, C});
  ctx.be.fill(rows, 0.f);
  ctx.be.embedding_bwd(dy, saved.ids, rows, dwpe, /*accumulate=*/true);
  Tensor mine = rows.slice0(0, Vl);
  ctx.be.add(dwte_local, mine, dwte_local);
}

void vp_softmax_xent(Ctx& ctx, const Tensor& logits, const Tensor& labels, int64_t vocab_lo, int64_t valid_classes,
                     float grad_scale, Tensor& losses, Tensor& dlogits) {
  TensorParallelOps& tp = group(ctx, "vocab-parallel cross-entropy");
  DTRAIN_CHECK(logits.ndim() == 2 && is_float(logits.dtype) && labels.dtype == DType::I32 &&
                   labels.numel() == logits.dim(0) && losses.numel() == logits.dim(0),
               "vocab-parallel cross-entropy: logits {} labels {} losses {}", logits.str(), labels.str(),
               losses.str());
  const int64_t N = logits.dim(0), Vl = logits.dim(1);
  const int64_t V = std::clamp<int64_t>(valid_classes - vocab_lo, 0, Vl);  // the rank's real columns
  // 1. the global max of each row; 2. sum(exp(z - max)) and the target's logit, summed over
  // the ranks; 3. the loss and dlogits. All on the device (16-bit logits read as f32).
  Tensor mx = ctx.arena.alloc(DType::F32, Shape{N});
  ctx.be.vocab_xent_max(logits, V, mx);
  tp.allreduce_max(mx);
  Tensor sums = ctx.arena.alloc(DType::F32, Shape{2 * N});
  ctx.be.vocab_xent_parts(logits, labels, vocab_lo, V, valid_classes, mx, sums);
  tp.allreduce_sum(sums);
  if (dlogits.defined())
    DTRAIN_CHECK(dlogits.numel() == N * Vl && dlogits.dtype == logits.dtype,
                 "vocab-parallel cross-entropy: dlogits {}", dlogits.str());
  ctx.be.vocab_xent_finish(logits, labels, vocab_lo, V, mx, sums, grad_scale, losses, dlogits);
}

}  // namespace dtrain
