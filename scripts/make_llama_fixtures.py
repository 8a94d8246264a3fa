#!/usr/bin/env python3
"""Writes tests/fixtures/llama.<case>.safetensors: transformers' LlamaForCausalLM /
Qwen2ForCausalLM (4.46.3) with small random configs, one forward + backward of the mean
next-token cross-entropy in float64 (scripts/llama_reference.py), for tests/model/test_llama_torch.cpp
on machines without transformers.

Each file holds the model's weights under "w.<Hugging Face name>" (transformers' init with a
fixed seed, the RMSNorm weights and biases perturbed so that none is 1 or 0), the inputs ids /
targets (and positions where the case passes position_ids), the outputs logits and loss, the
rotary inv_freq, and grad.<name> for every parameter, all f32 (ids as i32); its metadata
"config" is the config.json (Hugging Face keys). One decoder layer each, to stay small.

  gqa      llama, 4 query heads over 2 key/value heads, untied head, rope_theta 10000,
           rms_norm_eps 1e-5 (Llama's; the others 1e-6, Qwen2's)
  mqa      llama, multi-query (1 key/value head), tied head, Llama 3.1 rope scaling, positions
           restarting per document
  qwen2    qwen2 (q/k/v biases), 4 query heads over 2 key/value heads, untied head, rope_theta
           1e6 (Qwen2's)
  bias     llama with attention_bias and mlp_bias, head_dim 6 (not hidden / heads), 3 heads

Run: .venv/bin/python scripts/make_llama_fixtures.py
"""
import json
import os
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_reference  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures")

BASE = dict(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
            rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.02)
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8}

CASES = {
    "gqa": dict(BASE, model_type="llama", rms_norm_eps=1e-5),
    "mqa": dict(BASE, model_type="llama", num_key_value_heads=1, tie_word_embeddings=True,
                rope_theta=500000.0, rope_scaling=LLAMA3),
    "qwen2": dict(BASE, model_type="qwen2", rope_theta=1000000.0),
    "bias": dict(BASE, model_type="llama", num_attention_heads=3, num_key_value_heads=3, head_dim=6,
                 attention_bias=True, mlp_bias=True),
}
B, T = 2, 7


def make(name, cfg, seed):
    torch.manual_seed(seed)
    model = llama_reference.build(cfg)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
            elif pname.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            p.copy_(p.float().double())  # the stored f32 values are the model
    V = cfg["vocab_size"]
    ids = torch.randint(0, V, (B, T), dtype=torch.int32)
    targets = torch.randint(0, V, (B, T), dtype=torch.int32)
    positions = None
    if name == "mqa":  # documents of 3, 2 and 2 tokens
        positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1]] * B, dtype=torch.int32)
    res = llama_reference.run(model, ids, targets, positions)
    out = {"w." + k: v.float().contiguous() for k, v in model.named_parameters()}
    out.update({"ids": ids, "targets": targets, "logits": res["logits"], "loss": res["loss"],
                "inv_freq": res["inv_freq"]})
    if positions is not None:
        out["positions"] = positions
    out.update({k: v for k, v in res.items() if k.startswith("grad.")})
    path = os.path.join(OUT, f"llama.{name}.safetensors")
    save_file(out, path, metadata={"config": json.dumps(cfg, sort_keys=True)})
    print(f"{path}: {os.path.getsize(path)} bytes, loss {res['loss'].item():.6f}")


if __name__ == "__main__":
    for i, (name, cfg) in enumerate(CASES.items()):
        make(name, cfg, 100 + i)
