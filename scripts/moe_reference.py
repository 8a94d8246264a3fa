#!/usr/bin/env python3
"""Reference forward/backward of Hugging Face transformers' MixtralForCausalLM and
Qwen2MoeForCausalLM (4.46.3; torch 1.13 works) in float64, for dtrain's mixture-of-experts tests.

  python scripts/moe_reference.py DIR [DIR ...]

reads, for each DIR, DIR/config.json (as dtrain's checkpoints write it: model_type "mixtral" or
"qwen2_moe"), DIR/weights.safetensors (the model's tensors under Hugging Face's names) and
DIR/inputs.safetensors (ids and targets i32 [B,T]); loads the weights strictly (lm_head.weight
may be missing when tied), runs the forward in float64 with eager attention and
output_router_logits, takes the loss transformers trains with: the mean next-token
cross-entropy of the logits against the targets plus router_aux_loss_coef *
load_balancing_loss_func(router logits of every MoE layer, num_experts, top_k); runs the
backward and writes DIR/reference.safetensors: logits [B*T, vocab], loss [1], aux [1] (the
load-balancing loss without its coefficient) and grad.<name> for every parameter (f32).
"""
import json
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func


def build(cfg):
    kw = dict(cfg)
    model_type = kw.pop("model_type")
    kw.pop("architectures", None)
    kw["attn_implementation"] = "eager"
    kw["output_router_logits"] = True
    if model_type == "mixtral":
        return MixtralForCausalLM(MixtralConfig(**kw)).double()
    if model_type == "qwen2_moe":
        return Qwen2MoeForCausalLM(Qwen2MoeConfig(**kw)).double()
    raise SystemExit(f"model_type {model_type!r}: expected mixtral or qwen2_moe")


def main(d):
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    torch.manual_seed(0)
    model = build(cfg)
    weights = load_file(os.path.join(d, "weights.safetensors"))
    tied = model.config.tie_word_embeddings
    missing, unexpected = model.load_state_dict({k: v.double() for k, v in weights.items()}, strict=False)
    missing = [m for m in missing if not (tied and m == "lm_head.weight")]
    if missing or unexpected:
        raise SystemExit(f"{d}: the weights do not map onto {type(model).__name__}: missing {missing}, "
                         f"unexpected {unexpected}")
    inp = load_file(os.path.join(d, "inputs.safetensors"))
    model.zero_grad()
    out = model(input_ids=inp["ids"].long())
    V = out.logits.shape[-1]
    logits = out.logits.reshape(-1, V)
    ce = F.cross_entropy(logits, inp["targets"].long().reshape(-1))
    E = model.config.num_local_experts if cfg["model_type"] == "mixtral" else model.config.num_experts
    aux = load_balancing_loss_func(out.router_logits, E, model.config.num_experts_per_tok, None)
    loss = ce + model.config.router_aux_loss_coef * aux
    loss.backward()
    res = {"logits": logits.detach().float().contiguous(), "loss": loss.detach().float().reshape(1),
           "aux": aux.detach().float().reshape(1)}
    for name, p in model.named_parameters():
        res["grad." + name] = p.grad.float().contiguous()
    save_file(res, os.path.join(d, "reference.safetensors"))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    for d in sys.argv[1:]:
        main(d)
