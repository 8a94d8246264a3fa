#include "models/decoder_lm.h"

#include "models/llama.h"
#include "nn/seq_parallel.h"

namespace dtrain {

template <class I>
DecoderLm<I>::DecoderLm(const GptSpec& spec, ParamStore& ps, Names names, int64_t cache_heads, int64_t head_dim)
    : s_(spec), ps_(ps), vl_(gpt_local_vocab(spec)), names_(names), cache_heads_(cache_heads), head_dim_(head_dim) {
  if (s_.moe.enabled()) moe_stats_ = std::make_unique<MoeStats>(s_.moe, s_.moe.moe_layers(s_.n_layer));
}

template <class I>
ParamDesc DecoderLm<I>::vocab_desc(const std::string& name, float std, int64_t stream) const {
  ParamDesc d;
  d.name = name;
  d.shape = Shape{vl_, s_.n_embd};
  if (s_.tp_size > 1) {  // rows [rank * vl_, (rank + 1) * vl_) of the padded vocabulary
    DTRAIN_CHECK(ps_.tp_size() == s_.tp_size, "{}: tensor parallel {} but the ParamStore has {}", names_.model,
                 s_.tp_size, ps_.tp_size());
    d.tp_dim = 0;
    d.tp_full = s_.padded_vocab;
  }
  d.init = Init::Normal;
  d.init_arg = std;
  d.decay = true;
  d.layout = Layout::PadRows;
  d.torch_rows = s_.vocab_size;
  d.init_stream = stream;
  return d;
}

template <class I>
int64_t DecoderLm<I>::add_blocks(const std::string& prefix, int64_t first_stream, const MakeBlock& make) {
  int64_t per_block = 0;
  {
    ParamStore probe;
    if (s_.tp_size > 1) probe.set_tensor_parallel(0, s_.tp_size);
    make(probe, "probe", -1);
    per_block = int64_t(probe.params().size());
  }
  const int first = s_.pp_layers >= 0 ? s_.pp_first : 0;
  const int count = s_.pp_layers >= 0 ? s_.pp_layers : s_.n_layer;
  for (int i = first; i < first + count; ++i) {
    const std::string name = prefix + std::to_string(i);
    ps_.set_next_init_stream(first_stream + int64_t(i) * per_block);
    units_.push_back(ps_.begin_unit(name));
    blocks_.push_back(make(ps_, name, i));
    ps_.end_unit();
  }
  return first_stream + int64_t(s_.n_layer) * per_block;
}

template <class I>
void DecoderLm<I>::check_len(int64_t B, int64_t T) const {
  if (T < 1 || T > s_.block_size)
    user_error("{}: sequence length {} must be in [1, model.{} = {}]", names_.model, T, names_.length_key,
               s_.block_size);
  // sequence parallel: between the tensor-parallel regions the rank's block of the B*T rows
  if (sp() && (B * T) % s_.tp_size != 0)
    user_error("{}: parallel.sequence: {} tokens ({} sequences of {}) do not split over parallel.tensor = {} ranks",
               names_.model, B * T, B, T, s_.tp_size);
}

template <class I>
void DecoderLm<I>::take_positions(int64_t B, int64_t T) {
  positions_ = next_positions_;
  const Tensor docs = next_documents_ ? positions_ : Tensor();
  next_positions_ = Tensor();
  next_documents_ = false;
  if (positions_.defined() &&
      (positions_.dtype != DType::I32 || positions_.ndim() != 2 || positions_.dim(0) != B || positions_.dim(1) != T))
    fault("{}: positions {} must be i32 [{},{}]", names_.model, positions_.str(), B, T);
  for (auto& b : blocks_) b->set_documents(docs);
}

template <class I>
Tensor DecoderLm<I>::forward(Ctx& ctx, const Tensor& ids) {
  if (!s_.pp_embed) return forward_from(ctx, ids);
  if (ids.dtype != DType::I32 || ids.ndim() != 2)
    fault("{}: input {} must be token ids i32 [B,T]", names_.model, ids.str());
  const int64_t B = ids.dim(0), T = ids.dim(1), C = s_.n_embd;
  check_len(B, T);
  take_positions(B, T);
  Tensor x = ctx.arena.alloc(ps_.compute_dtype(), sp() ? Shape{B * T / s_.tp_size, C} : Shape{B, T, C});
  // GPT-2's learned positions: added in the embedding's kernel for 0..T-1, else gathered
  const bool gather = pos_ >= 0 && positions_.defined();
  const Tensor pos = pos_ >= 0 && !gather ? ps_.cparam(pos_) : Tensor();
  if (tp())
    emb_ = vp_embedding_fwd(ctx, ids, ps_.cparam(embed_), pos, int64_t(ps_.tp_rank()) * vl_,
                            int64_t(vl_) * s_.tp_size, x, sp());
  else
    ctx.be.embedding_fwd(ids, ps_.cparam(embed_), pos, x);
  if (gather) {  // x += wpe[positions] (x: the rank's block of the B*T rows under sequence parallelism)
    Tensor rows = ctx.arena.alloc(x.dtype, Shape{B, T, C});
    ctx.be.embedding_fwd(positions_, ps_.cparam(pos_), Tensor(), rows);
    Tensor mine = rows.view(Shape{B * T, C});
    if (sp()) {
      const int64_t n = B * T / s_.tp_size, lo = int64_t(ps_.tp_rank()) * n;
      mine = mine.slice0(lo, lo + n);
    }
    Tensor x2 = x.view(mine.shape);
    ctx.be.add(x2, mine, x2);
  }
  ids_ = ids;
  return forward_blocks(ctx, x, B, T);
}

// a pipeline stage after the first: x is the previous stage's output [B,T,C]
template <class I>
Tensor DecoderLm<I>::forward_from(Ctx& ctx, const Tensor& x) {
  if (x.ndim() != 3 || x.dim(2) != s_.n_embd || x.dtype != ps_.compute_dtype())
    fault("{}: pipeline stage input {} must be [B,T,{}] {}", names_.model, x.str(), s_.n_embd,
          dtype_name(ps_.compute_dtype()));
  check_len(x.dim(0), x.dim(1));
  take_positions(x.dim(0), x.dim(1));
  ids_ = Tensor();
  return forward_blocks(ctx, x, x.dim(0), x.dim(1));
}

template <class I>
Tensor DecoderLm<I>::forward_blocks(Ctx& ctx, Tensor x, int64_t B, int64_t T) {
  const int64_t C = s_.n_embd;
  before_forward(ctx.be);
  if (moe_stats_ && ctx.training) moe_stats_->begin_micro();
  B_ = B;
  T_ = T;
  block_in_.resize(blocks_.size());
  for (size_t i = 0; i < blocks_.size(); ++i) {
    block_in_[i] = x;  // what a recomputing block runs on again
    blocks_[i]->set_seq_len(T);  // (take_positions set their documents)
    x = ctx.unit_forward(units_[i], [&, i](Ctx& c) { return blocks_[i]->forward(c, block_in_[i]); });
  }
  if (!s_.pp_head) return x;  // a pipeline stage before the last: the activations
  h_ = norm_->forward(ctx, x);
  h_ = sp() ? sp_gather_rows(ctx, h_) : h_.view(Shape{B * T, C});  // the LM head takes every row
  Tensor logits = ctx.arena.alloc(h_.dtype, Shape{B * T, vl_});
  ctx.be.gemm(false, true, 1.f, h_, ps_.cparam(head_), 0.f, logits);  // h W^T (the rank's vocabulary)
  return logits;
}

template <class I>
void DecoderLm<I>::backward(Ctx& ctx, const Tensor& dout) {
  DTRAIN_CHECK(!block_in_.empty() || blocks_.empty(), "{}: backward without forward", names_.model);
  const int64_t B = B_, T = T_, C = s_.n_embd;
  Tensor dx;
  if (s_.pp_head) {
    DTRAIN_CHECK(dout.numel() == B * T * vl_, "{}: dlogits {}", names_.model, dout.str());
    Tensor dl = dout.view(Shape{B * T, vl_});
    if (!ps_.frozen()) {  // a frozen (LoRA base) head takes no gradient
      Tensor dhead = ps_.grad(head_);
      ctx.be.gemm(true, false, 1.f, dl, h_, 1.f, dhead);  // dW += dlogits^T h (the LM head)
    }
    Tensor dh = ctx.arena.alloc(dl.dtype, Shape{B, T, C});
    Tensor dh2 = dh.view(Shape{B * T, C});
    ctx.be.gemm(false, false, 1.f, dl, ps_.cparam(head_), 0.f, dh2);
    // the head is column-parallel in h: the ranks' parts summed (sequence parallel: this
    // rank's block of rows of the sum)
    if (sp()) dh = sp_scatter_rows(ctx, dh2);
    else if (tp()) ctx.tp->allreduce_sum(dh2);
    if (head_ != embed_ && !ps_.frozen()) ctx.notify_grad(head_);  // a tied head's gradient is complete after the embedding's
    dx = norm_->backward(ctx, dh);
  } else {  // a pipeline stage before the last: the gradient of its output activations
    DTRAIN_CHECK(dout.numel() == B * T * C, "{}: pipeline stage output gradient {}", names_.model, dout.str());
    dx = dout.view(Shape{B, T, C});
  }
  for (size_t i = blocks_.size(); i-- > 0;)
    dx = ctx.unit_backward(
        units_[i], [&, i](Ctx& c) { return blocks_[i]->forward(c, block_in_[i]); },
        [&, i](Ctx& c) { return blocks_[i]->backward(c, dx); });
  block_in_.clear();
  if (s_.pp_embed && ps_.frozen()) {  // a frozen (LoRA base) embedding: nothing to compute
    dx_in_ = Tensor();
  } else if (s_.pp_embed) {
    Tensor dembed = ps_.grad(embed_);
    const bool gather = pos_ >= 0 && positions_.defined();  // wpe's rows gathered by the positions
    Tensor dpos = pos_ >= 0 ? ps_.grad(pos_) : Tensor();
    Tensor dpos_fused = gather ? Tensor() : dpos;
    if (sp()) dx = sp_gather_rows(ctx, dx).view(Shape{B, T, C});
    if (tp())
      vp_embedding_bwd(ctx, dx, emb_, dembed, dpos_fused);
    else
      ctx.be.embedding_bwd(dx, ids_, dembed, dpos_fused, /*accumulate=*/true);
    if (gather) {  // wpe's rows as an embedding table indexed by the positions
      Tensor none;
      ctx.be.embedding_bwd(dx, positions_, dpos, none, /*accumulate=*/true);
    }
    emb_ = VpEmbeddingSaved{};
    if (pos_ >= 0) ctx.notify_grad(pos_);
    dx_in_ = Tensor();
  } else {
    dx_in_ = dx;
  }
  if (embed_ >= 0 && !ps_.frozen()) ctx.notify_grad(embed_);
  ids_ = h_ = positions_ = Tensor();
}

template <class I>
void DecoderLm<I>::decode_begin(Backend& be, int64_t batch) {
  DTRAIN_CHECK(batch > 0, "{}: decode batch {}", names_.model, batch);
  DTRAIN_CHECK(s_.tp_size == 1, "{}: incremental decoding of a tensor-parallel model", names_.model);
  DTRAIN_CHECK(!s_.staged(), "{}: incremental decoding of a pipeline stage", names_.model);
  cache_shape_ = Shape{batch, cache_heads_, int64_t(s_.block_size), head_dim_};
  const size_t half = size_t(cache_shape_.numel()) * dtype_size(ps_.compute_dtype());
  if (cache_.size() != blocks_.size() || cache_[0].bytes() != 2 * half) {
    cache_.clear();
    for (size_t i = 0; i < blocks_.size(); ++i) cache_.emplace_back(be, 2 * half);
  }
}

template <class I>
Tensor DecoderLm<I>::decode_step(Ctx& ctx, const Tensor& ids, int64_t pos) {
  DTRAIN_CHECK(!cache_.empty(), "{}: decode_step without decode_begin", names_.model);
  const int64_t B = cache_shape_[0], C = s_.n_embd;
  if (ids.dtype != DType::I32 || ids.numel() != B) fault("{}: decode ids {} must be i32 [{}]", names_.model, ids.str(), B);
  if (pos < 0 || pos >= s_.block_size)
    user_error("{}: decode position {} must be in [0, model.{} = {})", names_.model, pos, names_.length_key,
               s_.block_size);
  before_decode(ctx.be);
  Tensor x = ctx.arena.alloc(ps_.compute_dtype(), Shape{B, 1, C});
  const Tensor position = pos_ >= 0 ? ps_.cparam(pos_).slice0(pos, pos + 1) : Tensor();
  ctx.be.embedding_fwd(ids.view(Shape{B, 1}), ps_.cparam(embed_), position, x);
  const DType cd = ps_.compute_dtype();
  const size_t half = size_t(cache_shape_.numel()) * dtype_size(cd);
  for (size_t i = 0; i < blocks_.size(); ++i) {
    Tensor k = cache_[i].tensor(cd, cache_shape_);
    Tensor v = cache_[i].tensor(cd, cache_shape_, half);
    ctx.unit_begin(units_[i], false);
    x = blocks_[i]->decode(ctx, x, k, v, pos);
    ctx.unit_end(units_[i], false);
  }
  Tensor h = norm_->forward(ctx, x).view(Shape{B, C});
  Tensor logits = ctx.arena.alloc(h.dtype, Shape{B, s_.padded_vocab});
  ctx.be.gemm(false, true, 1.f, h, ps_.cparam(head_), 0.f, logits);
  return logits;
}

template class DecoderLm<GptModel>;
template class DecoderLm<LlamaModel>;

}  // namespace dtrain
