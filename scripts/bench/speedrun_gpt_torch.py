#!/usr/bin/env python3
"""PyTorch twin of a dtrain GPT recipe on llm.c token shards, trained end to end: it reads the
recipe (TOML) and trains the GPT of gpt_torch.py (the model of src/models/gpt.cpp) with the same
batch of random block_size windows, AdamW (weight decay on 2-D weights), global-norm clipping,
warmup + cosine/linear/constant schedule with min_lr, and the recipe's thread count (run.threads;
0 = OMP_NUM_THREADS or the affinity mask's CPUs, as dtrain). Evaluation: the mean loss over
eval.max_batches batches of eval.batch_size non-overlapping windows of the val shards in file
order, every eval.every_steps and at the end. The time to target is the wall time from the
first step to the end of the step evaluated, earlier evaluations included, as dtrain's
elapsed_s; the throughput counts training alone. Prints a line per evaluation and, at the end,
    torch: <steps> steps in <s> s of training (<tokens/s> tokens/s) | eval_loss <l> | target <t> reached at step <k> (<s> s)
Usage: speedrun_gpt_torch.py RECIPE [--data DIR]   (DIR: the recipe's data.path by default)
"""
import argparse
import glob
import os
import sys
import time
import tomllib

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import twin_common as tc  # noqa: E402
from gpt_torch import GPT  # noqa: E402
from llmc_shards import read_tokens  # noqa: E402


def read_shard(path):
    return torch.from_numpy(read_tokens(path).astype(np.int64))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("recipe")
    p.add_argument("--data", default="")
    a = p.parse_args()
    with open(a.recipe, "rb") as f:
        cfg = tomllib.load(f)
    if tc.recipe_get(cfg, "model.kind", "") != "gpt":
        sys.exit("speedrun_gpt_torch.py: the recipe must be a GPT")
    torch.set_num_threads(tc.recipe_threads(cfg))
    seed = tc.recipe_get(cfg, "run.seed", 0)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    data = a.data or tc.recipe_get(cfg, "data.path", "")
    train_split, val_split = tc.recipe_get(cfg, "data.train_split", "train"), tc.recipe_get(cfg, "data.eval_split", "val")
    train = [read_shard(f) for f in sorted(glob.glob(f"{data}/{train_split}_*.bin"))]
    val = [read_shard(f) for f in sorted(glob.glob(f"{data}/{val_split}_*.bin"))]
    if not train or not val:
        sys.exit(f"speedrun_gpt_torch.py: no {train_split}_*.bin / {val_split}_*.bin shards in {data}")

    L, H, C = tc.recipe_get(cfg, "model.n_layer", 4), tc.recipe_get(cfg, "model.n_head", 4), tc.recipe_get(cfg, "model.n_embd", 128)
    T, V = tc.recipe_get(cfg, "model.block_size", 128), tc.recipe_get(cfg, "model.vocab_size", 256)
    model = GPT(L, H, C, T, V)
    params = list(model.parameters())
    wd = tc.recipe_get(cfg, "optim.weight_decay", 0.0)
    groups = [{"params": [q for q in params if q.dim() >= 2], "weight_decay": wd},
              {"params": [q for q in params if q.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=tc.recipe_get(cfg, "optim.lr", 1e-3),
                            betas=(tc.recipe_get(cfg, "optim.beta1", 0.9), tc.recipe_get(cfg, "optim.beta2", 0.999)),
                            eps=tc.recipe_get(cfg, "optim.eps", 1e-8))
    clip = tc.recipe_get(cfg, "train.clip_grad_norm", 0.0)
    B, total = tc.recipe_get(cfg, "train.batch_size", 32), tc.recipe_get(cfg, "train.max_steps", 100)
    every, eval_b, eval_n = tc.recipe_get(cfg, "eval.every_steps", 0), tc.recipe_get(cfg, "eval.batch_size", 32), tc.recipe_get(cfg, "eval.max_batches", 0)
    target = tc.recipe_get(cfg, "expect.target", float("nan"))

    # evaluation windows: non-overlapping, file order, never across shards
    wins = [(s, o) for s in range(len(val)) for o in range(0, len(val[s]) - T, T)]
    if eval_n:
        wins = wins[:eval_n * eval_b]
    wins = wins[:len(wins) // eval_b * eval_b]

    def evaluate():
        model.eval()
        tot = 0.0
        with torch.no_grad():
            for i in range(0, len(wins), eval_b):
                w = torch.stack([val[s][o:o + T + 1] for s, o in wins[i:i + eval_b]])
                tot += model(w[:, :-1], w[:, 1:]).item()
        model.train()
        return tot / (len(wins) // eval_b)

    sizes = torch.tensor([len(t) - T - 1 for t in train], dtype=torch.float64)
    print(f"params: {sum(q.numel() for q in params)} | {total} steps of {B}x{T} tokens | "
          f"{torch.get_num_threads()} threads | PyTorch {torch.__version__}", flush=True)
    train_s, reached, loss_v = 0.0, None, float("nan")
    t_start = time.perf_counter()
    for step in range(1, total + 1):
        t0 = time.perf_counter()
        shard = torch.multinomial(sizes, B, replacement=True, generator=gen)
        rows = []
        for s in shard.tolist():
            o = int(torch.randint(0, len(train[s]) - T, (1,), generator=gen))
            rows.append(train[s][o:o + T + 1])
        w = torch.stack(rows)
        for g in opt.param_groups:
            g["lr"] = tc.recipe_lr(cfg, step - 1, total)
        loss = model(w[:, :-1], w[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        train_s += time.perf_counter() - t0
        if (every and step % every == 0) or step == total:
            wall = time.perf_counter() - t_start
            loss_v = evaluate()
            if reached is None and loss_v <= target:
                reached = (step, wall)
            print(f"step {step} | loss {loss.item():.4f} | eval_loss {loss_v:.4f} | {train_s:.1f} s", flush=True)
    hit = f"target {target} reached at step {reached[0]} ({reached[1]:.1f} s)" if reached else f"target {target} not reached"
    print(f"torch: {total} steps in {train_s:.1f} s of training ({total * B * T / train_s:.1f} tokens/s) | "
          f"eval_loss {loss_v:.4f} | {hit}", flush=True)


if __name__ == "__main__":
    main()
