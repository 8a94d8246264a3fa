#!/usr/bin/env python3
"""Reference forward/backward of Hugging Face transformers' LlamaForCausalLM and
Qwen2ForCausalLM (4.46.3; torch 1.13 works) in float64, for dtrain's Llama-family tests.

  python scripts/llama_reference.py DIR [DIR ...]

(one process for several cases: importing transformers costs seconds) reads, for each DIR,
DIR/config.json (config.json keys: model_type "llama" or "qwen2", vocab_size,
hidden_size, ...), DIR/weights.safetensors (the model's tensors under Hugging Face's names, as
dtrain exports them) and DIR/inputs.safetensors (ids and targets i32 [B,T], optionally
positions i32 [B,T] passed as position_ids), loads the weights strictly (only lm_head.weight
may be missing, when tie_word_embeddings), runs the forward in float64 with eager attention,
takes the mean next-token cross-entropy of the logits against the targets, runs the backward,
and writes DIR/reference.safetensors: logits [B*T, vocab], loss [1], inv_freq (the rotary
embedding's, as transformers computes it in f32), cos/sin [P, head_dim/2] (its tables for
positions 0..P-1, P = max_position_embeddings, computed in f32 as its forward does) and
grad.<name> for every parameter (f32). scripts/make_llama_fixtures.py uses the same functions.
"""
import json
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM


def build(cfg):
    """The model of a config.json dict, float64, eager attention (transformers' own init)."""
    kw = dict(cfg)
    model_type = kw.pop("model_type")
    kw["attn_implementation"] = "eager"
    if model_type == "llama":
        return LlamaForCausalLM(LlamaConfig(**kw)).double()
    if model_type == "qwen2":
        for k in ("attention_bias", "mlp_bias", "head_dim"):  # Qwen2Config has none of them
            kw.pop(k, None)
        return Qwen2ForCausalLM(Qwen2Config(**kw)).double()
    raise SystemExit(f"model_type {model_type!r}: expected llama or qwen2")


def load(model, weights):
    """Loads {name: tensor}; every parameter must be given (lm_head.weight may be tied)."""
    tied = model.config.tie_word_embeddings
    missing, unexpected = model.load_state_dict({k: v.double() for k, v in weights.items()}, strict=False)
    missing = [m for m in missing if not (tied and m == "lm_head.weight")]
    if missing or unexpected:
        raise SystemExit(f"the weights do not map onto {type(model).__name__}: missing {missing}, "
                         f"unexpected {unexpected}")


def run(model, ids, targets, positions=None):
    """Forward, mean cross-entropy over every position, backward; f32 results."""
    model.zero_grad()
    out = model(input_ids=ids.long(), position_ids=None if positions is None else positions.long())
    V = out.logits.shape[-1]
    logits = out.logits.reshape(-1, V)
    loss = F.cross_entropy(logits, targets.long().reshape(-1))
    loss.backward()
    res = {"logits": logits.detach().float().contiguous(), "loss": loss.detach().float().reshape(1)}
    rot = model.model.rotary_emb
    res["inv_freq"] = rot.inv_freq.float().contiguous()
    P = model.config.max_position_embeddings
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rot(x, torch.arange(P).reshape(1, P))
    half = res["inv_freq"].numel()
    res["cos"] = cos[0, :, :half].float().contiguous()
    res["sin"] = sin[0, :, :half].float().contiguous()
    for name, p in model.named_parameters():  # a tied lm_head is embed_tokens (listed once)
        res["grad." + name] = p.grad.float().contiguous()
    return res


def main(d):
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    torch.manual_seed(0)
    model = build(cfg)
    load(model, load_file(os.path.join(d, "weights.safetensors")))
    inp = load_file(os.path.join(d, "inputs.safetensors"))
    res = run(model, inp["ids"], inp["targets"], inp.get("positions"))
    save_file(res, os.path.join(d, "reference.safetensors"))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    for d in sys.argv[1:]:
        main(d)
