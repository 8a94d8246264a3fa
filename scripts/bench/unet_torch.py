#!/usr/bin/env python3
"""PyTorch twin of `dtrain bench configs/bench/unet_bf16.toml`: the same U-Net as
src/models/unet.h (DoubleConv = [3x3 conv without bias, BatchNorm2d, ReLU] x 2 at every level,
2x2 max-pool down, ConvTranspose2d(2, 2) or bilinear x2 + 3x3 conv up, concatenation
[skip, up] along channels, 1x1 head with bias; parameter names as dtrain's checkpoints), the
same synthetic data (one random batch of images in [-1, 1) and per-pixel labels kept on the
device), loss = mean pixel cross-entropy + dice_weight * soft Dice (smooth 1, per class over
the whole batch, as Backend::softmax_dice), AdamW (weight decay on conv weights only, as
dtrain's default), batch size, precision (bf16/fp16 through torch.autocast), channels-last.
Prints the parameter count and steady-state images/s (MFU with --peak-tflops, FLOPs per image
= 3 x forward conv FLOPs, counted as dtrain counts them):
    params: <N> ...
    torch: <images/s> images/s [| mfu ...]
Defaults are the recipe's (depth 4, base 64, 3 -> 2 classes, 256x256, batch 16, AdamW 1e-3
wd 1e-4, dice weight 1). Usage:
    unet_torch.py --device cuda --batch 16 --precision bf16 [--compile] [--peak-tflops 989]
    unet_torch.py --depth 2 --base 8 --size 32 --batch 2 --steps 2 --warmup 1     (CPU smoke)
"""
import argparse
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import twin_common as tc  # noqa: E402


class DoubleConv(nn.Module):
    """`<prefix>.conv.{0,1,3,4}`: conv, BN, ReLU, conv, BN, ReLU."""

    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(cin, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

    def forward(self, x):
        return self.conv(x)


class Up(nn.Module):
    """`up.{j}.up` (transpose) or `up.{j}.up.1` (bilinear), then `up.{j}.conv` on [skip, up]."""

    def __init__(self, cin, cout, mode):
        super().__init__()
        if mode == "transpose":
            self.up = nn.ConvTranspose2d(cin, cout, 2, 2)
        else:
            self.up = nn.Sequential(nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False),
                                    nn.Conv2d(cin, cout, 3, 1, 1))
        self.conv = DoubleConv(2 * cout, cout)

    def forward(self, x, skip):
        return self.conv(torch.cat([skip, self.up(x)], dim=1))


class UNet(nn.Module):
    def __init__(self, depth, base, in_ch, classes, mode):
        super().__init__()
        c = [base << i for i in range(depth + 1)]
        self.down = nn.ModuleList([DoubleConv(in_ch if i == 0 else c[i - 1], c[i]) for i in range(depth)])
        self.bottleneck = DoubleConv(c[depth - 1], c[depth])
        self.up = nn.ModuleList([Up(c[i + 1], c[i], mode) for i in reversed(range(depth))])
        self.head = nn.Conv2d(c[0], classes, 1)
        for m in self.modules():  # as dtrain: Kaiming normal (fan out) for every conv weight
            if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        skips = []
        for d in self.down:
            x = d(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = self.bottleneck(x)
        for u, s in zip(self.up, reversed(skips)):
            x = u(x, s)
        return self.head(x)


def soft_dice_loss(logits, labels, smooth=1.0):
    """1 - mean_k (2 sum p_k t_k + smooth) / (sum p_k + sum t_k + smooth), sums over the batch."""
    p = logits.float().softmax(dim=1)
    t = F.one_hot(labels, logits.shape[1]).permute(0, 3, 1, 2).to(p.dtype)
    dims = (0, 2, 3)
    dice = (2 * (p * t).sum(dims) + smooth) / (p.sum(dims) + t.sum(dims) + smooth)
    return 1 - dice.mean()


class UNetLoss(nn.Module):
    """The model and its loss in one module, so that --compile covers both."""

    def __init__(self, net, dice_weight):
        super().__init__()
        self.net, self.dice_weight = net, dice_weight

    def forward(self, x, y):
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        if self.dice_weight > 0:
            loss = loss + self.dice_weight * soft_dice_loss(logits, y)
        return loss


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--base", type=int, default=64, help="channels of the first level (model.base_channels)")
    p.add_argument("--upsample", default="transpose", choices=["transpose", "bilinear"])
    p.add_argument("--channels", type=int, default=3)
    p.add_argument("--classes", type=int, default=2)
    p.add_argument("--size", type=int, default=256, help="image height and width")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--dice-weight", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    tc.add_common_args(p)
    a = p.parse_args()
    if a.size % (1 << a.depth):
        tc.fail(f"--size {a.size} must be divisible by 2^depth = {1 << a.depth}")
    dev, amp, scaler = tc.setup(a)

    net = UNet(a.depth, a.base, a.channels, a.classes, a.upsample)
    n = tc.num_params(net)
    fwd_flops = tc.conv_linear_forward_flops(net, torch.zeros(1, a.channels, a.size, a.size))
    net = net.to(dev).to(memory_format=torch.channels_last)
    params = [q for q in net.parameters() if q.requires_grad]
    # dtrain decays conv weights only (biases and BatchNorm parameters: optim.decay_bias_and_norm)
    groups = [{"params": [q for q in params if q.dim() >= 2], "weight_decay": a.weight_decay},
              {"params": [q for q in params if q.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=a.lr)
    step_fn = tc.maybe_compile(a, UNetLoss(net, a.dice_weight))
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(a.batch, a.channels, a.size, a.size, generator=g) * 2 - 1).to(dev)
    x = x.to(memory_format=torch.channels_last)
    y = torch.randint(0, a.classes, (a.batch, a.size, a.size), generator=g).to(dev)

    def step():
        opt.zero_grad(set_to_none=True)
        with tc.autocast(a, amp):
            loss = step_fn(x, y)
        tc.backward_and_step(loss, opt, scaler)

    print(f"params: {n} | model FLOPs {3 * fwd_flops:.4g} per image (training) | unet depth {a.depth}, base {a.base}, {a.upsample}, {a.channels} -> {a.classes} classes, "
          f"{a.size}x{a.size} | batch {a.batch} | {a.precision}{' compiled' if a.compile else ''} | "
          f"PyTorch {torch.__version__}", flush=True)
    dt = tc.timed(a, step)
    tc.report(a, a.batch * a.steps / dt, "images", 3 * fwd_flops)


if __name__ == "__main__":
    main()
