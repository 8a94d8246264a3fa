#!/usr/bin/env python3
"""Writes tests/fixtures/: reference forward/backward results of small PyTorch models with
fixed random weights, for tests/test_fixtures.cpp (no Python needed when the tests run).

  gpt2.*.safetensors  2-layer GPT-2 (n_embd 64, 2 heads, vocab 100, block 16), Hugging Face
                      names and Conv1D layout; one forward + backward of the mean next-token
                      cross-entropy on fixed ids/targets, computed in float64.

Each model's tensors are packed into shards under 200 KB: <model>.weights.<k>,
<model>.io.<k> (inputs, outputs, loss) and <model>.grads.<k> (gradient of every weight,
named like the weight). Stored as f32. Run: .venv/bin/python scripts/make_fixtures.py
"""
import math
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures")
LIMIT = 190 * 1024


def save_sharded(prefix, tensors):
    shards, cur, size = [], {}, 0
    for name, t in tensors.items():
        t = t.detach().float().contiguous()
        n = t.numel() * 4
        if cur and size + n > LIMIT:
            shards.append(cur)
            cur, size = {}, 0
        if n > LIMIT:
            sys.exit(f"{prefix}: tensor {name} alone is {n} bytes")
        cur[name] = t
        size += n
    if cur:
        shards.append(cur)
    for k, s in enumerate(shards):
        save_file(s, os.path.join(OUT, f"{prefix}.{k}.safetensors"))


def gpt2():
    torch.manual_seed(1)
    L, H, C, V, P, B, T = 2, 2, 64, 100, 16, 2, 8
    W = {}

    def p(name, *shape, std, mean=0.0):
        W[name] = (torch.randn(*shape, dtype=torch.float64) * std + mean).float().double()

    p("transformer.wte.weight", V, C, std=0.1)
    p("transformer.wpe.weight", P, C, std=0.1)
    for i in range(L):
        h = f"transformer.h.{i}."
        p(h + "ln_1.weight", C, std=0.1, mean=1.0); p(h + "ln_1.bias", C, std=0.1)
        p(h + "attn.c_attn.weight", C, 3 * C, std=0.1); p(h + "attn.c_attn.bias", 3 * C, std=0.05)
        p(h + "attn.c_proj.weight", C, C, std=0.05); p(h + "attn.c_proj.bias", C, std=0.05)
        p(h + "ln_2.weight", C, std=0.1, mean=1.0); p(h + "ln_2.bias", C, std=0.1)
        p(h + "mlp.c_fc.weight", C, 4 * C, std=0.1); p(h + "mlp.c_fc.bias", 4 * C, std=0.05)
        p(h + "mlp.c_proj.weight", 4 * C, C, std=0.05); p(h + "mlp.c_proj.bias", C, std=0.05)
    p("transformer.ln_f.weight", C, std=0.1, mean=1.0); p("transformer.ln_f.bias", C, std=0.1)
    for t in W.values():
        t.requires_grad_(True)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V, (B, T), generator=g)
    tgt = torch.randint(0, V, (B, T), generator=g)

    def ln(x, pre):
        return F.layer_norm(x, (C,), W[pre + ".weight"], W[pre + ".bias"], 1e-5)

    x = W["transformer.wte.weight"][ids] + W["transformer.wpe.weight"][:T]
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
    for i in range(L):
        h = f"transformer.h.{i}."
        qkv = ln(x, h + "ln_1") @ W[h + "attn.c_attn.weight"] + W[h + "attn.c_attn.bias"]
        q, k, v = [t.view(B, T, H, C // H).transpose(1, 2) for t in qkv.split(C, -1)]
        att = ((q @ k.transpose(-1, -2)) / math.sqrt(C // H)).masked_fill(mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + y @ W[h + "attn.c_proj.weight"] + W[h + "attn.c_proj.bias"]
        m = F.gelu(ln(x, h + "ln_2") @ W[h + "mlp.c_fc.weight"] + W[h + "mlp.c_fc.bias"], approximate="tanh")
        x = x + m @ W[h + "mlp.c_proj.weight"] + W[h + "mlp.c_proj.bias"]
    logits = ln(x, "transformer.ln_f") @ W["transformer.wte.weight"].t()
    loss = F.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1))
    loss.backward()
    save_sharded("gpt2.weights", W)
    save_sharded("gpt2.io", {"ids": ids.float(), "targets": tgt.float(), "logits": logits,
                             "loss": loss.reshape(1)})
    save_sharded("gpt2.grads", {n: t.grad for n, t in W.items()})


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    gpt2()
