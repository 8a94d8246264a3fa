#!/usr/bin/env python3
"""transformers' side of the Llama-family interop tests (tests/interop/test_llama_hf.cpp).

  llama_hf_check.py check MODEL_DIR VAL_SHARD BLOCK WINDOWS NEW PROMPT...
      AutoModelForCausalLM.from_pretrained(MODEL_DIR) (its config.json and safetensors), in
      float64: prints "arch <class name>", then "loss <float>", the mean next-token loss over the
      first WINDOWS non-overlapping BLOCK-token windows of the llm.c shard VAL_SHARD (dtrain
      eval's windows); then in float32, for each PROMPT (bytes: a byte-level model), NEW greedy
      tokens printed as "greedy <i> <prompt and continuation bytes in hex>"
  llama_hf_check.py save MODEL_DIR KIND SHARD_BYTES
      a small random model saved with save_pretrained: KIND llama (LlamaForCausalLM, grouped
      keys/values, untied head, llama3 rope scaling, rms_norm_eps 1e-5) or qwen2
      (Qwen2ForCausalLM, tied head, rope_theta 1e6); SHARD_BYTES > 0 shards the safetensors
      (max_shard_size). Prints "saved <n tensors> <files>"
"""
import os
import sys

import numpy as np
import torch


def tokens_of(shard):
    raw = open(shard, "rb").read()
    head = np.frombuffer(raw[:1024], dtype=np.int32)
    assert head[0] == 20240520 and head[1] == 1, head[:3]
    tokens = torch.from_numpy(np.frombuffer(raw[1024:], dtype=np.uint16).astype(np.int64))
    assert tokens.numel() == head[2]
    return tokens


def check(model_dir, shard, block, windows, new, *prompts):
    from transformers import AutoModelForCausalLM
    block, windows, new = int(block), int(windows), int(new)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    print(f"arch {type(model).__name__}")
    tokens = tokens_of(shard)
    assert (tokens.numel() - 1) // block >= windows
    m64 = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager",
                                               torch_dtype=torch.float64).eval()
    total = 0.0
    with torch.no_grad():
        for w in range(windows):
            ids = tokens[w * block: w * block + block + 1]
            out = m64(ids[None, :-1]).logits[0]
            total += torch.nn.functional.cross_entropy(out, ids[1:]).item()
        print(f"loss {total / windows:.10f}")
        for i, p in enumerate(prompts):
            ids = torch.tensor([list(p.encode())])
            for _ in range(new):
                ids = torch.cat([ids, model(ids).logits[0, -1].argmax().view(1, 1)], 1)
            print(f"greedy {i} " + bytes(ids[0].tolist()).hex())


def save(model_dir, kind, shard_bytes):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    if kind == "llama":
        cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                          rms_norm_eps=1e-5, tie_word_embeddings=False,
                          rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 2.0, "original_max_position_embeddings": 16})
        model = LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = Qwen2Config(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=32,
                          rope_theta=1e6, tie_word_embeddings=True)
        model = Qwen2ForCausalLM(cfg)
    else:
        raise SystemExit(f"unknown model {kind}")
    with torch.no_grad():  # biases and norms away from their 0 / 1 init: a wrong mapping shows;
        for name, p in model.named_parameters():  # weights 5x init: peaked logits, no greedy near-ties
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.mul_(5.0)
    shard = int(shard_bytes)
    if shard > 0:
        model.save_pretrained(model_dir, max_shard_size=shard)
    else:
        model.save_pretrained(model_dir)
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    print(f"saved {len(model.state_dict())} {' '.join(files)}")


def main():
    kind = sys.argv[1]
    if kind == "check":
        check(*sys.argv[2:])
    elif kind == "save":
        save(*sys.argv[2:])
    else:
        raise SystemExit(f"unknown check {kind}")


if __name__ == "__main__":
    main()
