#!/usr/bin/env python3
"""Cuts a tuning split out of a token dataset's training shards, so that a speedrun recipe's
choices are made without its eval split: OUT/val_000000.bin holds the first FRACTION of the
training tokens and OUT/train_000000.bin the rest (llm.c's shard format: 256 x int32 header,
magic 20240520, version 1, token count, then uint16 tokens). The eval split of SRC is not read.
    tune_split.py data/fortunes data/fortunes-tune [--fraction 0.1]
Then: dtrain train RECIPE --set data.path='"data/fortunes-tune"'
"""
import argparse
import glob
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llmc_shards import read_tokens, write_tokens  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("src")
    p.add_argument("out")
    p.add_argument("--fraction", type=float, default=0.1)
    a = p.parse_args()
    shards = sorted(glob.glob(os.path.join(a.src, "train_*.bin")))
    if not shards:
        raise SystemExit(f"{a.src}: no train_*.bin shards")
    tokens = np.concatenate([read_tokens(s) for s in shards])
    n = int(len(tokens) * a.fraction)
    os.makedirs(a.out, exist_ok=True)
    write_tokens(os.path.join(a.out, "val_000000.bin"), tokens[:n])
    write_tokens(os.path.join(a.out, "train_000000.bin"), tokens[n:])
    print(f"{a.out}: val {n} tokens, train {len(tokens) - n} tokens (from {len(shards)} train shards of {a.src})")


if __name__ == "__main__":
    main()
