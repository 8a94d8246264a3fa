#pragma once
// Vocabulary parallelism (Megatron-LM): GPT's token embedding wte [V, C] cut by rows over the
// tensor-parallel group (rank r holds rows [r*Vl, (r+1)*Vl)), and the LM head tied to it, so
// each rank computes the logits of its vocabulary slice only [N, Vl]; the full logits never
// sit on one rank.
//
//  * Embedding: each rank looks up the ids in its rows and contributes zeros for the others
//    (exactly: the row it read instead is subtracted with a rank-1 GEMM, w - w = 0), the
//    group sums, then wpe is added (as embedding_fwd adds it: the same bits as one process).
//    Sequence parallel: the sum is reduce-scattered to the ranks' blocks of rows (one rank's
//    row and zeros: exact in any order); the backward takes the gathered gradient.
//    Backward: the rank's rows of dwte get its ids' rows of dy (the others go to a scratch
//    row that is dropped), dwpe all of dy (the same on every rank).
//  * Cross-entropy: the row maxima all-reduced with max (global max), sum(exp(z - max)) and
//    the target's logit (from the rank owning it) all-reduced; loss = max + log(sum) - z_target,
//    dlogits = scale * (softmax - onehot) on the rank's columns, zero on padding columns. Three
//    device passes (Backend::vocab_xent_*) around the two all-reduces: the logits never leave
//    the device; any float dtype (read as f32, dlogits rounded once to theirs).
#include <cstdint>

#include "nn/module.h"

namespace dtrain {

// What the embedding's forward keeps for its backward.
struct VpEmbeddingSaved {
  Tensor ids;  // i32 [B,T]: the local row of each id, Vl where another rank owns it
};

// x [B,T,C] (wte's, wpe's and x's dtype: f32, or the 16-bit compute dtype) = wte[ids] + wpe[position]
// (wpe undefined: wte[ids], the Llama family) where wte_local [Vl, C] holds rows
// [vocab_lo, vocab_lo + Vl) of a wte of `vocab_rows` rows (ids outside it: UserError).
// sequence (nn/seq_parallel.h): x is [B*T/size, C], the rank's block of the rows: the group's
// sum is a reduce-scatter instead of an all-reduce, and wpe is added to those rows only.
VpEmbeddingSaved vp_embedding_fwd(Ctx& ctx, const Tensor& ids, const Tensor& wte_local, const Tensor& wpe,
                                  int64_t vocab_lo, int64_t vocab_rows, Tensor& x, bool sequence = false);
// dwte_local += the rank's rows of the embedding gradient; dwpe += its position gradient.
void vp_embedding_bwd(Ctx& ctx, const Tensor& dy, const VpEmbeddingSaved& saved, Tensor& dwte_local, Tensor& dwpe);

// Cross-entropy of logits whose columns [0, Vl) are the vocabulary's [vocab_lo, vocab_lo+Vl)
// (valid_classes: the real vocabulary; columns past it are padding, never predicted).
// labels i32 [N] in [0, valid_classes). losses f32 [N] (every rank the same values);
// dlogits [N, Vl] (undefined: not computed) = grad_scale * d(sum losses)/d(logits).
void vp_softmax_xent(Ctx& ctx, const Tensor& logits, const Tensor& labels, int64_t vocab_lo, int64_t valid_classes,
                     float grad_scale, Tensor& losses, Tensor& dlogits);

}  // namespace dtrain
