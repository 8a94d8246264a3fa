#!/usr/bin/env python3
"""Interop checks of a dtrain checkpoint with the real ecosystem readers (used by
tests/test_interop.cpp).

  interop_check.py cifar MODEL.safetensors DEPTH WIDTH IDX_DIR MEAN STD
      loads the checkpoint strictly into a PyTorch CIFAR ResNet (the twin in
      scripts/bench/resnet_torch.py, torchvision-style names), evaluates it on the
      Fashion-MNIST test set from the IDX files, prints "accuracy <float>"
  interop_check.py torchvision MODEL.safetensors ARCH NUM_CLASSES
      torchvision.models.<ARCH>(num_classes=...).load_state_dict(..., strict=True),
      prints "ok <num tensors>"
"""
import gzip
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


def main():
    kind, path = sys.argv[1], sys.argv[2]
    state = load_file(path)
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
            pred = torch.cat([model(x[i:i + 500]).argmax(1) for i in range(0, len(x), 500)])
        print(f"accuracy {(pred.numpy() == y).mean():.6f}")
    elif kind == "torchvision":
        import torchvision
        arch, classes = sys.argv[3], int(sys.argv[4])
        model = getattr(torchvision.models, arch)(num_classes=classes)
        model.load_state_dict(state, strict=True)
        print(f"ok {len(state)}")
    else:
        raise SystemExit(f"unknown check {kind}")


if __name__ == "__main__":
    main()
