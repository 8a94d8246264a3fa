#!/usr/bin/env python3
"""PyTorch twin of `dtrain bench configs/bench/llama3_1b.toml`: the same Llama as
src/models/llama.cpp (model.arch = "llama"; Hugging Face's LlamaForCausalLM written out in
plain PyTorch): token embedding, pre-norm blocks with RMSNorm (statistics in fp32, eps),
rotary positions (theta, optional Llama 3.1 "llama3" frequency scaling, inv_freq computed as
transformers computes it), grouped-query causal attention (n_kv_head key/value heads; query
head h reads key/value head h // (n_head / n_kv_head)), SwiGLU MLP (gate/up/down, intermediate
size), final RMSNorm, LM head untied or tied to the embedding, no biases, vocabulary padded to
a multiple of 128 rows (embedding and head, as dtrain pads them) whose logits are never
predicted; the same synthetic data (one random batch of token windows kept on the device,
targets shifted by one), AdamW with weight decay on the 2-D weights only, optional global-norm
clipping, batch size and precision (bf16/fp16 through torch.autocast).
Attention: F.scaled_dot_product_attention (causal) when this PyTorch has it (>= 2.0), with
enable_gqa where it exists (>= 2.5) and the key/value heads repeated to the query heads
otherwise (as transformers does); a masked softmax on older PyTorch (Debian's 1.13).
Prints the parameter count and steady-state tokens/s (MFU with --peak-tflops; FLOPs per
token 6*N + 12*L*(n_head*head_dim)*T as PaLM and dtrain count them, N = parameters with the
padded rows):
    params: <N> (<without padding> without the vocabulary padding)
    torch: <tokens/s> tokens/s [| mfu ...]
Defaults are configs/bench/llama3_1b.toml's (Llama-3.2-1B-like: 16 layers, 2048 wide, 32 heads,
8 key/value heads, intermediate 8192, vocab 128256, tied head, rms eps 1e-5, theta 500000 with
llama3 scaling 32/1/4/8192, block 2048, batch 2, AdamW 3e-4 (0.9, 0.95) wd 0.1, clip 1.0).
Usage:
    llama_torch.py --device cuda --precision bf16 [--compile] [--peak-tflops 989]
    llama_torch.py --n-layer 4 --n-head 4 --n-kv-head 2 --n-embd 128 --intermediate 352 \\
        --block 128 --vocab 256 --untied --rms-eps 1e-6 --rope-theta 10000 --rope-scaling none \\
        --batch 16                     (configs/llama_fortunes.toml's model, CPU)
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


def sdpa_has_gqa():
    """Whether F.scaled_dot_product_attention takes enable_gqa (PyTorch >= 2.5)."""
    if not HAS_SDPA:
        return False
    try:
        q = torch.zeros(1, 2, 1, 4)
        kv = torch.zeros(1, 1, 1, 4)
        F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        return True
    except (TypeError, RuntimeError):
        return False


def rope_inv_freq(head_dim, theta, scaling, factor, low, high, original):
    """transformers' _compute_default_rope_parameters / _compute_llama3_parameters, in f32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling == "none":
        return inv_freq
    low_wavelen = original / low
    high_wavelen = original / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, c, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(c))
        self.eps = eps

    def forward(self, x):
        # as transformers' LlamaRMSNorm: statistics in fp32, x * rstd rounded to the input dtype
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class Attention(nn.Module):
    def __init__(self, c, n_head, n_kv_head, head_dim, gqa):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim, self.gqa = n_head, n_kv_head, head_dim, gqa
        self.q_proj = nn.Linear(c, n_head * head_dim, bias=False)
        self.k_proj = nn.Linear(c, n_kv_head * head_dim, bias=False)
        self.v_proj = nn.Linear(c, n_kv_head * head_dim, bias=False)
        self.o_proj = nn.Linear(n_head * head_dim, c, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        hs = self.head_dim
        q = self.q_proj(x).view(B, T, self.n_head, hs).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, hs).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, hs).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # transformers rounds the tables to the dtype
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        group = self.n_head // self.n_kv_head
        if HAS_SDPA and self.gqa == "enable_gqa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            if group > 1:  # query head h reads key/value head h // group
                k = k.repeat_interleave(group, dim=1)
                v = v.repeat_interleave(group, dim=1)
            if HAS_SDPA:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
                mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
                att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
                y = att @ v
        return self.o_proj(y.transpose(1, 2).contiguous().view(B, T, self.n_head * hs))


class Mlp(nn.Module):
    def __init__(self, c, inter):
        super().__init__()
        self.gate_proj = nn.Linear(c, inter, bias=False)
        self.up_proj = nn.Linear(c, inter, bias=False)
        self.down_proj = nn.Linear(inter, c, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c, n_head, n_kv_head, head_dim, inter, eps, gqa):
        super().__init__()
        self.input_layernorm = RMSNorm(c, eps)
        self.self_attn = Attention(c, n_head, n_kv_head, head_dim, gqa)
        self.post_attention_layernorm = RMSNorm(c, eps)
        self.mlp = Mlp(c, inter)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, a, gqa):
        super().__init__()
        c = a.n_embd
        self.head_dim = a.head_dim or c // a.n_head
        self.vocab_size = a.vocab
        self.padded_vocab = (a.vocab + 127) // 128 * 128
        self.tied = a.tied
        self.embed_tokens = nn.Embedding(self.padded_vocab, c)
        self.layers = nn.ModuleList([Block(c, a.n_head, a.n_kv_head, self.head_dim, a.intermediate, a.rms_eps, gqa)
                                     for _ in range(a.n_layer)])
        self.norm = RMSNorm(c, a.rms_eps)
        self.lm_head = None if a.tied else nn.Linear(c, self.padded_vocab, bias=False)
        # init as transformers / dtrain: Normal(0, 0.02) for every Linear and the embedding, norms
        # 1, no residual scaling; the padding rows of the vocabulary stay 0
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02)
        with torch.no_grad():
            self.embed_tokens.weight[a.vocab:].zero_()
            if self.lm_head is not None:
                self.lm_head.weight[a.vocab:].zero_()
        # rotary tables of positions 0..block-1 (buffers, not parameters): the f32 angle
        inv_freq = rope_inv_freq(self.head_dim, a.rope_theta, a.rope_scaling, a.rope_factor,
                                 a.rope_low_freq_factor, a.rope_high_freq_factor, a.rope_original_max_positions)
        freqs = torch.outer(torch.arange(a.block, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, idx, targets):
        T = idx.shape[1]
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.embed_tokens(idx)
        for b in self.layers:
            x = b(x, cos, sin)
        x = self.norm(x)
        w = self.embed_tokens.weight if self.tied else self.lm_head.weight
        logits = F.linear(x, w)
        # the padded columns are never predicted (dtrain: softmax_xent_masked)
        logits = logits[..., :self.vocab_size]
        return F.cross_entropy(logits.reshape(-1, self.vocab_size), targets.reshape(-1))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n-layer", type=int, default=16)
    p.add_argument("--n-head", type=int, default=32)
    p.add_argument("--n-kv-head", type=int, default=8, help="key/value heads (0: n_head)")
    p.add_argument("--n-embd", type=int, default=2048)
    p.add_argument("--head-dim", type=int, default=0, help="0: n_embd / n_head")
    p.add_argument("--intermediate", type=int, default=8192, help="SwiGLU width (model.intermediate_size)")
    p.add_argument("--block", type=int, default=2048, help="context length (model.block_size)")
    p.add_argument("--vocab", type=int, default=128256, help="real vocabulary (padded to a multiple of 128)")
    tie = p.add_mutually_exclusive_group()
    tie.add_argument("--tied", dest="tied", action="store_true", default=True,
                     help="LM head tied to the embedding (model.tie_word_embeddings = true; the default)")
    tie.add_argument("--untied", dest="tied", action="store_false", help="an lm_head of its own")
    p.add_argument("--rms-eps", type=float, default=1e-5, help="model.rms_norm_eps (dtrain's default: 1e-6)")
    p.add_argument("--rope-theta", type=float, default=500000.0, help="model.rope_theta (dtrain's default: 10000)")
    p.add_argument("--rope-scaling", default="llama3", choices=["none", "llama3"])
    p.add_argument("--rope-factor", type=float, default=32.0)
    p.add_argument("--rope-low-freq-factor", type=float, default=1.0)
    p.add_argument("--rope-high-freq-factor", type=float, default=4.0)
    p.add_argument("--rope-original-max-positions", type=int, default=8192)
    p.add_argument("--gqa", default="auto", choices=["auto", "repeat"],
                   help="auto: SDPA's enable_gqa where it exists, else repeat the key/value heads")
    tc.add_lm_args(p, batch=2, lr=3e-4)
    a = p.parse_args()
    if a.n_kv_head == 0:
        a.n_kv_head = a.n_head
    if a.n_head % a.n_kv_head:
        tc.fail(f"--n-head {a.n_head} must be a multiple of --n-kv-head {a.n_kv_head}")
    if not a.head_dim and a.n_embd % a.n_head:
        tc.fail(f"--n-embd {a.n_embd} must be a multiple of --n-head {a.n_head} (or give --head-dim)")
    dev, amp, scaler = tc.setup(a)
    gqa = "repeat"
    if a.gqa == "auto" and a.n_kv_head < a.n_head and sdpa_has_gqa():
        gqa = "enable_gqa"

    model = Llama(a, gqa).to(dev)
    n = tc.num_params(model)
    unpadded = n - (model.padded_vocab - a.vocab) * a.n_embd * (1 if a.tied else 2)
    step, fused = tc.lm_training_step(a, model, dev, amp, scaler)

    if not HAS_SDPA:
        attn = "masked softmax" + (", key/value heads repeated" if a.n_kv_head < a.n_head else "")
    elif a.n_kv_head == a.n_head:
        attn = "scaled_dot_product_attention"
    else:
        attn = "scaled_dot_product_attention, " + ("enable_gqa" if gqa == "enable_gqa" else "key/value heads repeated")
    flops_per_token = 6 * n + 12 * a.n_layer * a.n_head * model.head_dim * a.block
    rope = f"theta {a.rope_theta:g}" + (f" llama3 x{a.rope_factor:g}" if a.rope_scaling == "llama3" else "")
    tc.run_lm(a, n, unpadded, flops_per_token,
              f"llama {a.n_layer} layers, {a.n_head} heads / {a.n_kv_head} key-value, {a.n_embd} wide, "
              f"head_dim {model.head_dim}, SwiGLU {a.intermediate}, block {a.block}, vocab {a.vocab} -> "
              f"{model.padded_vocab}, {'tied' if a.tied else 'untied'} head, rms eps {a.rms_eps:g}, rope {rope}",
              attn, step, fused)

if __name__ == "__main__":
    main()
