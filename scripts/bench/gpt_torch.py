#!/usr/bin/env python3
"""PyTorch twin of `dtrain bench configs/bench/gpt2_124m.toml`: the same GPT-2 as
src/models/gpt.cpp (token + position embeddings, pre-LN blocks with LayerNorm eps 1e-5,
causal self-attention, tanh-GELU MLP, final LayerNorm, LM head tied to the token embedding,
vocabulary padded to a multiple of 128 rows whose logits are never predicted), the same
synthetic data (one random batch of token windows kept on the device, targets shifted by one),
AdamW with weight decay on the 2-D weights only, optional global-norm clipping, batch size and
precision (bf16/fp16 through torch.autocast). Attention is F.scaled_dot_product_attention
(causal) when this PyTorch has it (>= 2.0), else a masked softmax.
Prints the parameter count and steady-state tokens/s (MFU with --peak-tflops; FLOPs per
token 6*N + 12*L*C*T as PaLM and dtrain count them, N = parameters with the padded rows):
    params: <N> (<without padding> without the vocabulary padding)
    torch: <tokens/s> tokens/s [| mfu ...]
Defaults are the recipe's (GPT-2 124M, block 1024, batch 16, AdamW 6e-4 (0.9, 0.95) wd 0.1,
clip 1.0). Usage:
    gpt_torch.py --device cuda --batch 16 --precision bf16 [--compile] [--peak-tflops 989]
    gpt_torch.py --n-layer 2 --block 64 --batch 2 --steps 2 --warmup 1      (CPU smoke)
"""
import argparse
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import twin_common as tc  # noqa: E402

HAS_SDPA = hasattr(F, "scaled_dot_product_attention")


class CausalSelfAttention(nn.Module):
    def __init__(self, c, n_head):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(c, 3 * c)
        self.c_proj = nn.Linear(c, c)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if HAS_SDPA:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            y = att @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Mlp(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_fc = nn.Linear(c, 4 * c)
        self.c_proj = nn.Linear(4 * c, c)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, c, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(c, eps=1e-5)
        self.attn = CausalSelfAttention(c, n_head)
        self.ln_2 = nn.LayerNorm(c, eps=1e-5)
        self.mlp = Mlp(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, n_layer, n_head, n_embd, block_size, vocab_size):
        super().__init__()
        self.vocab_size = vocab_size
        self.padded_vocab = (vocab_size + 127) // 128 * 128
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(self.padded_vocab, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd, eps=1e-5),
        ))
        # init as GPT-2 / llm.c / dtrain: N(0, 0.02), residual projections 0.02/sqrt(2L),
        # biases 0, LayerNorm 1/0; the padding rows of the vocabulary stay 0
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))
            elif p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02)
            elif ".ln_" in name or name.startswith("transformer.ln_f"):
                nn.init.ones_(p) if name.endswith("weight") else nn.init.zeros_(p)
            else:
                nn.init.zeros_(p)
        with torch.no_grad():
            self.transformer.wte.weight[vocab_size:].zero_()

    def forward(self, idx, targets):
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for b in self.transformer.h:
            x = b(x)
        logits = F.linear(self.transformer.ln_f(x), self.transformer.wte.weight)  # tied LM head
        # the padded columns are never predicted (dtrain: softmax_xent_masked)
        logits = logits[..., :self.vocab_size]
        return F.cross_entropy(logits.reshape(-1, self.vocab_size), targets.reshape(-1))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--block", type=int, default=1024, help="context length (model.block_size)")
    p.add_argument("--vocab", type=int, default=50257, help="real vocabulary (padded to a multiple of 128)")
    tc.add_lm_args(p, batch=16, lr=6e-4)
    a = p.parse_args()
    dev, amp, scaler = tc.setup(a)

    model = GPT(a.n_layer, a.n_head, a.n_embd, a.block, a.vocab).to(dev)
    n = tc.num_params(model)
    unpadded = n - (model.padded_vocab - a.vocab) * a.n_embd
    step, fused = tc.lm_training_step(a, model, dev, amp, scaler)

    attn = "scaled_dot_product_attention" if HAS_SDPA else "masked softmax"
    flops_per_token = 6 * n + 12 * a.n_layer * a.n_embd * a.block
    tc.run_lm(a, n, unpadded, flops_per_token,
              f"gpt {a.n_layer} layers, {a.n_head} heads, {a.n_embd} wide, block {a.block}, "
              f"vocab {a.vocab} -> {model.padded_vocab}", attn, step, fused)

if __name__ == "__main__":
    main()
