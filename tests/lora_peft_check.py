#!/usr/bin/env python3
"""PEFT's side of the LoRA tests (tests/interop/test_lora_peft.cpp).

  lora_peft_check.py save MODEL_DIR KIND
      a small random base model saved with save_pretrained: KIND llama (LlamaForCausalLM, grouped
      keys/values, untied head, llama3 rope scaling, rms_norm_eps 1e-5: llama_hf_check.py's) or
      gpt2 (GPT2LMHeadModel, 2 layers, 4 heads, 32 wide, block 32, vocabulary 256)
  lora_peft_check.py check BASE_DIR ADAPTER_DIR MERGED_DIR VAL_SHARD BLOCK WINDOWS NEW PROMPT...
      in float64: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE_DIR),
      ADAPTER_DIR) and AutoModelForCausalLM.from_pretrained(MERGED_DIR) (dtrain checkpoint
      merge-lora's output): prints "peft_loss <float>" and "merged_loss <float>", the mean
      next-token loss over the first WINDOWS non-overlapping BLOCK-token windows of the llm.c shard
      VAL_SHARD (dtrain eval's windows); "logits_max_diff <float>", the largest |peft - merged|
      logit over those windows; "adapter_effect <float>", the largest |peft - base| logit (the
      adapters changed the model); then for each PROMPT (bytes) NEW greedy tokens of the PEFT model
      as "greedy <i> <hex>"; "peft <version>" first.
  lora_peft_check.py logits BASE_DIR ADAPTER_DIR PROMPT FILE...
      the PEFT model's logits (float64) of one forward over PROMPT's bytes against each FILE's
      "logits" tensor (dtrain sample --logits): "logits_max_diff <i> <float>" (max |d|) and
      "logits_max_abs <float>" (max |PEFT logit|)
"""
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


def save(model_dir, kind):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    if kind == "llama":
        cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                          rms_norm_eps=1e-5, tie_word_embeddings=False,
                          rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 2.0, "original_max_position_embeddings": 16})
        model = LlamaForCausalLM(cfg)
    elif kind == "gpt2":
        cfg = GPT2Config(n_layer=2, n_head=4, n_embd=32, n_positions=32, vocab_size=256,
                         activation_function="gelu_new")
        model = GPT2LMHeadModel(cfg)
    else:
        raise SystemExit(f"unknown model {kind}")
    with torch.no_grad():  # norms and biases away from 1 / 0, weights 5x: a wrong mapping shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or ".ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.mul_(5.0)
    model.save_pretrained(model_dir)
    print(f"saved {len(model.state_dict())}")


def check(base_dir, adapter_dir, merged_dir, shard, block, windows, new, *prompts):
    import peft
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    print(f"peft {peft.__version__}")
    block, windows, new = int(block), int(windows), int(new)
    load = lambda d: AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager",
                                                          torch_dtype=torch.float64).eval()
    base = load(base_dir)
    with torch.no_grad():
        tokens = tokens_of(shard)
        ids = [tokens[w * block: w * block + block + 1] for w in range(windows)]
        base_logits = [base(x[None, :-1]).logits[0].clone() for x in ids]
    model = PeftModel.from_pretrained(base, adapter_dir).double().eval()
    merged = load(merged_dir)
    loss_p = loss_m = 0.0
    diff = effect = 0.0
    with torch.no_grad():
        for x, b in zip(ids, base_logits):
            lp = model(x[None, :-1]).logits[0]
            lm = merged(x[None, :-1]).logits[0]
            loss_p += torch.nn.functional.cross_entropy(lp, x[1:]).item()
            loss_m += torch.nn.functional.cross_entropy(lm, x[1:]).item()
            diff = max(diff, (lp - lm).abs().max().item())
            effect = max(effect, (lp - b).abs().max().item())
        print(f"peft_loss {loss_p / windows:.10f}")
        print(f"merged_loss {loss_m / windows:.10f}")
        print(f"logits_max_diff {diff:.3e}")
        print(f"adapter_effect {effect:.3e}")
        for i, p in enumerate(prompts):
            x = torch.tensor([list(p.encode())])
            for _ in range(new):
                x = torch.cat([x, model(x).logits[0, -1].argmax().view(1, 1)], 1)
            print(f"greedy {i} " + bytes(x[0].tolist()).hex())


def logits(base_dir, adapter_dir, prompt, *files):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager",
                                                torch_dtype=torch.float64).eval()
    model = PeftModel.from_pretrained(base, adapter_dir).double().eval()
    with torch.no_grad():
        ref = model(torch.tensor([list(prompt.encode())])).logits[0]
    print(f"logits_max_abs {ref.abs().max().item():.6e}")
    for i, f in enumerate(files):
        got = load_file(f)["logits"].double()
        assert got.shape == ref.shape, (got.shape, ref.shape)
        print(f"logits_max_diff {i} {(got - ref).abs().max().item():.3e}")


def main():
    kind = sys.argv[1]
    if kind == "save":
        save(*sys.argv[2:])
    elif kind == "check":
        check(*sys.argv[2:])
    elif kind == "logits":
        logits(*sys.argv[2:])
    else:
        raise SystemExit(f"unknown command {kind}")


if __name__ == "__main__":
    main()
