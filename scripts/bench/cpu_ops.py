#!/usr/bin/env python3
"""PyTorch CPU timings of the ResNet-20 / Fashion-MNIST conv shapes that
tests/backend/bench_ops_cpu.cpp measures for dtrain (batch 128, channels_last, fp32).

    .venv/bin/python scripts/bench/cpu_ops.py [--threads 2] [--reps 10]

Prints the best of --reps runs in ms for conv forward, backward-data and
backward-weights (aten.convolution_backward with the matching output mask),
batch norm and relu, plus the conv time of one ResNet-20 training step.
"""
import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = [  # name, H, C, O, K, stride, count in ResNet-20
    ("stem 28x28 1->16", 28, 1, 16, 3, 1, 1),
    ("28x28 16->16", 28, 16, 16, 3, 1, 6),
    ("28x28 16->32 s2", 28, 16, 32, 3, 2, 1),
    ("14x14 32->32", 14, 32, 32, 3, 1, 5),
    ("14x14 32->64 s2", 14, 32, 64, 3, 2, 1),
    ("7x7 64->64", 7, 64, 64, 3, 1, 5),
    ("1x1 s2 16->32 (shortcut B)", 28, 16, 32, 1, 2, 0),
]


def best_ms(f, reps):
    f()
    best = 1e30
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=128)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    n = a.batch
    cl = torch.channels_last
    print(f"torch {torch.__version__}, threads {a.threads}, best of {a.reps}, ms; N={n}")
    print(f"{'conv':<28} {'fwd':>9} {'bwd_data':>9} {'bwd_filt':>9}")
    step = 0.0
    with torch.no_grad():
        for name, h, c, o, k, s, count in SHAPES:
            p = k // 2
            x = torch.randn(n, c, h, h).to(memory_format=cl)
            w = torch.randn(o, c, k, k).to(memory_format=cl)
            y = F.conv2d(x, w, None, s, p)
            dy = torch.randn_like(y).to(memory_format=cl)
            bwd = torch.ops.aten.convolution_backward
            tf = best_ms(lambda: F.conv2d(x, w, None, s, p), a.reps)
            td = best_ms(lambda: bwd(dy, x, w, None, [s, s], [p, p], [1, 1], False, [0, 0], 1,
                                     [True, False, False]), a.reps)
            tw = best_ms(lambda: bwd(dy, x, w, None, [s, s], [p, p], [1, 1], False, [0, 0], 1,
                                     [False, True, False]), a.reps)
            step += count * (tf + (0 if c == 1 else td) + tw)
            print(f"{name:<28} {tf:9.2f} {td:9.2f} {tw:9.2f}")
    print(f"ResNet-20 conv time per training step: {step:.1f} ms")
    m, c = n * 28 * 28, 16
    x = torch.randn(n, c, 28, 28).to(memory_format=cl).requires_grad_()
    bn = torch.nn.BatchNorm2d(c)
    y = bn(x)
    g = torch.randn_like(y)
    t_bf = best_ms(lambda: bn(x), a.reps)
    t_bb = best_ms(lambda: torch.autograd.grad(bn(x), x, g), a.reps) - t_bf
    with torch.no_grad():
        t_rf = best_ms(lambda: torch.relu(x), a.reps)
    print(f"[{m}x{c}] batchnorm fwd {t_bf:.2f} bwd {t_bb:.2f}; relu fwd {t_rf:.2f} ms")


if __name__ == "__main__":
    main()
