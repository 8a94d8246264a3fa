#!/usr/bin/env python3
"""PyTorch twin of a dtrain ResNet recipe on Fashion-MNIST, trained end to end: it reads the
recipe (TOML) and trains the same model (CIFAR ResNet-6n+2 of resnet_torch.py), batch size,
epochs, SGD (momentum, Nesterov, weight decay on conv/linear weights only unless
optim.decay_bias_and_norm), warmup + linear/cosine/constant schedule, label smoothing,
augmentation (pad-and-crop with zeros, horizontal flip) and normalisation, on the IDX files of
Debian's dataset-fashion-mnist, channels_last, with the recipe's thread count (run.threads; 0 =
OMP_NUM_THREADS or the affinity mask's CPUs, as dtrain). The time to target is the wall time
from the first step to the end of the step evaluated, earlier evaluations included, as dtrain's
elapsed_s; the throughput counts training alone.
Prints a line per evaluation and, at the end,
    torch: <steps> steps in <s> s of training (<images/s> images/s) | eval_accuracy <a> | target <t> reached at step <k> (<s> s)
Usage: speedrun_resnet_torch.py RECIPE [--src /usr/share/datasets/fashion-mnist] [--holdout N]
  --holdout N: train on the first 60000-N training images and evaluate on the last N (the
               split `dtrain data fashion-mnist --holdout N` writes), instead of the test set.
               Without it the recipe decides: `--holdout N` in its data.prepare keeps the last N
               out of training, and data.eval_split = "val" evaluates them instead of the test set.
"""
import argparse
import gzip
import os
import re
import sys
import time
import tomllib

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import twin_common as tc  # noqa: E402
from resnet_torch import CifarResNet  # noqa: E402


def read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def augment(x, pad, hflip, gen):
    """x: uint8 [B, 28, 28]; pad-and-crop with zeros, then flip, per sample."""
    b, h, w = x.shape
    if pad:
        xp = torch.zeros(b, h + 2 * pad, w + 2 * pad, dtype=x.dtype)
        xp[:, pad:pad + h, pad:pad + w] = x
        dy = torch.randint(0, 2 * pad + 1, (b,), generator=gen)
        dx = torch.randint(0, 2 * pad + 1, (b,), generator=gen)
        rows = (dy[:, None] + torch.arange(h)[None, :])[:, :, None]
        cols = (dx[:, None] + torch.arange(w)[None, :])[:, None, :]
        x = xp[torch.arange(b)[:, None, None], rows, cols]
    if hflip:
        flip = torch.rand(b, generator=gen) < 0.5
        x = torch.where(flip[:, None, None], x.flip(2), x)
    return x


def main():
    p = argparse.ArgumentParser()
    p.add_argument("recipe")
    p.add_argument("--src", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--holdout", type=int, default=None)
    a = p.parse_args()
    with open(a.recipe, "rb") as f:
        cfg = tomllib.load(f)
    if tc.recipe_get(cfg, "model.kind", "") != "resnet" or tc.recipe_get(cfg, "model.stem", "cifar") != "cifar":
        sys.exit("speedrun_resnet_torch.py: the recipe must be a CIFAR-stem ResNet")
    torch.set_num_threads(tc.recipe_threads(cfg))
    torch.manual_seed(tc.recipe_get(cfg, "run.seed", 0))
    gen = torch.Generator().manual_seed(tc.recipe_get(cfg, "run.seed", 0))

    xs = torch.from_numpy(read_idx(f"{a.src}/train-images-idx3-ubyte.gz").copy())
    ys = torch.from_numpy(read_idx(f"{a.src}/train-labels-idx1-ubyte.gz").astype(np.int64))
    # the recipe's own split: `--holdout N` in data.prepare keeps the last N training images out
    # of training (split "val"); data.eval_split says whether those or the test set are evaluated
    m = re.search(r"--holdout\s+(\d+)", tc.recipe_get(cfg, "data.prepare", ""))
    holdout = a.holdout if a.holdout is not None else (int(m.group(1)) if m else 0)
    eval_val = a.holdout is not None or tc.recipe_get(cfg, "data.eval_split", "test") == "val"
    if holdout and eval_val:
        xt, yt, xs, ys = xs[-holdout:], ys[-holdout:], xs[:-holdout], ys[:-holdout]
    else:
        if holdout:
            xs, ys = xs[:-holdout], ys[:-holdout]
        xt = torch.from_numpy(read_idx(f"{a.src}/t10k-images-idx3-ubyte.gz").copy())
        yt = torch.from_numpy(read_idx(f"{a.src}/t10k-labels-idx1-ubyte.gz").astype(np.int64))
    mean, std = tc.recipe_get(cfg, "data.mean", [0.0])[0], tc.recipe_get(cfg, "data.std", [1.0])[0]
    norm = lambda u8: ((u8.float() / 255.0 - mean) / std)[:, None].contiguous(memory_format=torch.channels_last)

    model = CifarResNet(tc.recipe_get(cfg, "model.depth", 20), tc.recipe_get(cfg, "model.width", 0) or 16,
                        tc.recipe_get(cfg, "model.in_channels", 1), tc.recipe_get(cfg, "model.num_classes", 10))
    model = model.to(memory_format=torch.channels_last)
    wd = tc.recipe_get(cfg, "optim.weight_decay", 0.0)
    decay_all = tc.recipe_get(cfg, "optim.decay_bias_and_norm", False)
    groups = [{"params": [q for q in model.parameters() if decay_all or q.dim() > 1], "weight_decay": wd},
              {"params": [q for q in model.parameters() if not decay_all and q.dim() <= 1], "weight_decay": 0.0}]
    if tc.recipe_get(cfg, "optim.name", "sgd") != "sgd":
        sys.exit("speedrun_resnet_torch.py: only optim.name = \"sgd\" is implemented in the twin")
    opt = torch.optim.SGD(groups, lr=tc.recipe_get(cfg, "optim.lr", 0.1), momentum=tc.recipe_get(cfg, "optim.momentum", 0.0),
                          nesterov=tc.recipe_get(cfg, "optim.nesterov", False))

    batch = tc.recipe_get(cfg, "train.batch_size", 128)
    per_epoch = len(xs) // batch  # whole batches, as dtrain's training loader deals them
    total = tc.recipe_get(cfg, "train.max_steps", 0) or int(round(tc.recipe_get(cfg, "train.epochs", 1.0) * per_epoch))
    every = tc.recipe_get(cfg, "eval.every_steps", 0)
    smooth = tc.recipe_get(cfg, "train.label_smoothing", 0.0)
    target = tc.recipe_get(cfg, "expect.target", float("nan"))
    pad, hflip = tc.recipe_get(cfg, "data.crop_padding", 0), tc.recipe_get(cfg, "data.hflip", False)

    def evaluate():
        model.eval()
        correct = 0
        with torch.no_grad():
            for i in range(0, len(xt), 1000):
                correct += (model(norm(xt[i:i + 1000])).argmax(1) == yt[i:i + 1000]).sum().item()
        model.train()
        return correct / len(xt)

    print(f"params: {sum(q.numel() for q in model.parameters())} | {total} steps of {batch} | "
          f"{torch.get_num_threads()} threads | PyTorch {torch.__version__}", flush=True)
    train_s, reached, step, acc = 0.0, None, 0, float("nan")
    t_start = time.perf_counter()
    while step < total:
        perm = torch.randperm(len(xs), generator=gen)
        for k in range(per_epoch):
            if step == total:
                break
            t0 = time.perf_counter()
            idx = perm[k * batch:(k + 1) * batch]
            x = norm(augment(xs[idx], pad, hflip, gen))
            for g in opt.param_groups:
                g["lr"] = tc.recipe_lr(cfg, step, total)
            loss = F.cross_entropy(model(x), ys[idx], label_smoothing=smooth)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            train_s += time.perf_counter() - t0
            if (every and step % every == 0) or step == total:
                wall = time.perf_counter() - t_start
                acc = evaluate()
                if reached is None and acc >= target:
                    reached = (step, wall)
                print(f"step {step} | loss {loss.item():.4f} | eval_accuracy {acc:.4f} | {train_s:.1f} s", flush=True)
    hit = f"target {target} reached at step {reached[0]} ({reached[1]:.1f} s)" if reached else f"target {target} not reached"
    print(f"torch: {total} steps in {train_s:.1f} s of training ({total * batch / train_s:.1f} images/s) | "
          f"eval_accuracy {acc:.4f} | {hit}", flush=True)


if __name__ == "__main__":
    main()
