#!/usr/bin/env python3
"""Interop checks of a dtrain checkpoint with the real ecosystem readers (used by
tests/test_interop.cpp).

  interop_check.py cifar MODEL.safetensors DEPTH WIDTH IDX_DIR MEAN STD
      loads the checkpoint strictly into a PyTorch CIFAR ResNet (the twin in
      scripts/bench/resnet_torch.py, torchvision-style names), evaluates it on the
      Fashion-MNIST test set from the IDX files, prints "accuracy <float> top5 <float>"
  interop_check.py torchvision MODEL.safetensors ARCH NUM_CLASSES
      torchvision.models.<ARCH>(num_classes=...).load_state_dict(..., strict=True),
      prints "ok <num tensors>"
  interop_check.py hfgpt2 CHECKPOINT_DIR VAL_SHARD BLOCK BATCHES PROMPT NEW
      transformers.GPT2LMHeadModel.from_pretrained(CHECKPOINT_DIR) (its config.json and
      model.safetensors), the mean next-token loss over the first BATCHES non-overlapping
      BLOCK-token windows of the llm.c shard VAL_SHARD (dtrain eval's windows), printed as
      "loss <float>", then NEW greedy tokens after PROMPT, tokenized and decoded by
      transformers.AutoTokenizer.from_pretrained(CHECKPOINT_DIR) (its vocab.json and
      merges.txt), printed as "greedy <the text's UTF-8 bytes in hex>"
  interop_check.py shards MODEL.safetensors CHECKPOINT_DIR
      a ZeRO-3 checkpoint's model-<i>-of-<N>.safetensors read with the safetensors package
      alone: each file's "params" cut by its __metadata__ ranges into the flat vector; for a
      model whose parameters are all plain (a GPT without vocabulary padding) that vector is
      the consolidated MODEL.safetensors' tensors, in order, flattened. Prints "flat <n>"
"""
import gzip
import json
import os
import sys

import numpy as np
import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts", "bench"))


def idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def hf_gpt2(ckpt, shard, block, batches, prompt, new):
    from transformers import AutoTokenizer, GPT2LMHeadModel
    block, batches, new = int(block), int(batches), int(new)
    model = GPT2LMHeadModel.from_pretrained(ckpt).eval()
    raw = open(shard, "rb").read()
    head = np.frombuffer(raw[:1024], dtype=np.int32)
    assert head[0] == 20240520 and head[1] == 1, head[:3]
    tokens = torch.from_numpy(np.frombuffer(raw[1024:], dtype=np.uint16).astype(np.int64))
    assert tokens.numel() == head[2] and (tokens.numel() - 1) // block >= batches
    total = 0.0
    with torch.no_grad():
        for w in range(batches):
            ids = tokens[w * block: w * block + block + 1]
            out = model(ids[None, :-1], labels=None).logits[0]
            total += torch.nn.functional.cross_entropy(out.double(), ids[1:]).item()
        print(f"loss {total / batches:.6f}")
        if new == 0:  # no tokenizer needed (a byte-level model)
            return
        tok = AutoTokenizer.from_pretrained(ckpt)
        assert type(tok).__name__ == "GPT2TokenizerFast" and tok.eos_token_id == 50256, tok
        ids = torch.tensor([tok.encode(prompt)])
        for _ in range(new):
            nxt = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], 1)
        print("greedy " + tok.decode(ids[0].tolist()).encode().hex())


def main():
    kind, path = sys.argv[1], sys.argv[2]
    state = load_file(path) if kind not in ("hfgpt2", "tvsave", "hfsave", "hfgreedy") else None
    if kind == "cifar":
        from resnet_torch import CifarResNet
        depth, width, idx_dir = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
        mean, std = float(sys.argv[6]), float(sys.argv[7])
        model = CifarResNet(depth, width, 1, 10)
        model.load_state_dict(state, strict=True)
        model.eval()
        x = idx(os.path.join(idx_dir, "t10k-images-idx3-ubyte.gz")).astype(np.float32) / 255.0
        y = idx(os.path.join(idx_dir, "t10k-labels-idx1-ubyte.gz")).astype(np.int64)
        x = (torch.from_numpy(x)[:, None] - mean) / std
        with torch.no_grad():
            logits = torch.cat([model(x[i:i + 500]) for i in range(0, len(x), 500)])
        top5 = (logits.topk(5, dim=1).indices == torch.from_numpy(y)[:, None]).any(1).float().mean().item()
        print(f"accuracy {(logits.argmax(1).numpy() == y).mean():.6f} top5 {top5:.6f}")
    elif kind == "torchvision":
        import torchvision
        arch, classes = sys.argv[3], int(sys.argv[4])
        model = getattr(torchvision.models, arch)(num_classes=classes)
        model.load_state_dict(state, strict=True)
        print(f"ok {len(state)}")
    elif kind == "tvsave":  # a pretrained-looking torchvision model, saved as safetensors
        import torchvision
        from safetensors.torch import save_file
        torch.manual_seed(0)
        model = getattr(torchvision.models, sys.argv[3])(num_classes=int(sys.argv[4]))
        with torch.no_grad():  # non-trivial batch-norm statistics too
            for m in model.modules():
                if isinstance(m, torch.nn.BatchNorm2d):
                    m.running_mean.uniform_(-0.5, 0.5)
                    m.running_var.uniform_(0.5, 2.0)
                    m.weight.uniform_(0.5, 1.5)
                    m.bias.uniform_(-0.2, 0.2)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
        print(f"saved {len(model.state_dict())}")
    elif kind == "tvcompare":  # dtrain's checkpoint after one step of lr ~0 vs the torchvision file
        ref = load_file(sys.argv[3])
        same = 0
        for k, v in ref.items():
            if k.startswith("fc.") or "running_" in k or "num_batches" in k:
                continue  # the new classifier; statistics updated by the step
            d = (state[k] - v).abs().max().item()
            if d > 1e-6:
                raise SystemExit(f"{k}: differs by {d}")
            same += 1
        print(f"match {same} fc {list(state['fc.weight'].shape)}")
    elif kind == "hfsave":  # a tiny GPT2LMHeadModel [N_HEAD N_EMBD]: save_pretrained(DIR), and the hub's layout in DIR/hub.safetensors
        from transformers import GPT2Config, GPT2LMHeadModel
        from safetensors.torch import save_file
        torch.manual_seed(0)
        n_head = int(sys.argv[3]) if len(sys.argv) > 3 else 2  # optional: N_HEAD N_EMBD
        n_embd = int(sys.argv[4]) if len(sys.argv) > 4 else 32
        cfg = GPT2Config(n_layer=2, n_head=n_head, n_embd=n_embd, n_positions=32, vocab_size=256,
                         activation_function="gelu_new")
        model = GPT2LMHeadModel(cfg)
        model.save_pretrained(path)
        sd = {k[len("transformer."):]: v.contiguous() for k, v in model.state_dict().items() if k.startswith("transformer.")}
        for i in range(cfg.n_layer):  # what the hub's gpt2 file also holds: the causal-mask buffers
            sd[f"h.{i}.attn.bias"] = torch.tril(torch.ones(32, 32)).view(1, 1, 32, 32)
        save_file(sd, os.path.join(path, "hub.safetensors"))
        print(f"saved {len(sd)}")
    elif kind == "hfcompare":  # dtrain's checkpoint after one step of lr ~0 vs the Hugging Face file
        ref = load_file(sys.argv[3])
        same = 0
        for k, v in ref.items():
            if k.endswith(".attn.bias") or k.endswith(".attn.masked_bias") or k == "lm_head.weight":
                continue
            kk = k if k.startswith("transformer.") else "transformer." + k
            d = (state[kk] - v).abs().max().item()
            if d > 1e-6:
                raise SystemExit(f"{k}: differs by {d}")
            same += 1
        print(f"match {same}")
    elif kind == "hfgreedy":  # a byte-level GPT2LMHeadModel's greedy continuation of a prompt
        from transformers import GPT2LMHeadModel
        model = GPT2LMHeadModel.from_pretrained(path).eval()
        ids = torch.tensor([list(sys.argv[3].encode())])
        with torch.no_grad():
            for _ in range(int(sys.argv[4])):
                ids = torch.cat([ids, model(ids).logits[0, -1].argmax().view(1, 1)], 1)
        print("greedy " + bytes(ids[0].tolist()).hex())
    elif kind == "hfgpt2":
        hf_gpt2(*sys.argv[2:])
    elif kind == "shards":
        from safetensors import safe_open
        files = sorted(f for f in os.listdir(sys.argv[3]) if f.startswith("model-"))
        flat = None
        for f in files:
            with safe_open(os.path.join(sys.argv[3], f), "pt") as sf:
                meta = sf.metadata()
                if flat is None:
                    flat = torch.full((int(meta["num_params"]),), float("nan"))
                ranges = meta.get("ranges", meta["range_begin"] + ":" + meta["range_end"])
                values, at = sf.get_tensor("params"), 0
                for r in ranges.split(","):
                    b, e = (int(x) for x in r.split(":"))
                    flat[b:e] = values[at:at + e - b]
                    at += e - b
                if at != values.numel():
                    raise SystemExit(f"{f}: ranges cover {at} of {values.numel()} values")
        with open(path, "rb") as fh:  # the consolidated file's tensors in their data order
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        order = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
        params = [state[k].flatten() for k in order if "running_" not in k and "num_batches" not in k]
        want = torch.cat(params)
        if want.numel() != flat.numel() or not torch.equal(want, flat):
            raise SystemExit(f"the shards' flat vector ({flat.numel()}) is not the consolidated model ({want.numel()})")
        print(f"flat {flat.numel()}")
    else:
        raise SystemExit(f"unknown check {kind}")


if __name__ == "__main__":
    main()
