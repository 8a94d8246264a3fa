#!/usr/bin/env python3
"""PyTorch twin of `dtrain bench` for the ResNet recipes: same model (torchvision ResNet or
the CIFAR ResNet-6n+2 with option-B shortcuts), batch size, input size, optimizer (SGD with
Nesterov momentum), threads; channels_last. Prints the parameter count and steady-state
images/s (MFU with --peak-tflops; FLOPs per image = 3 x forward conv/linear FLOPs, counted as
dtrain counts them):
    params: <N> | model FLOPs ...
    torch: <images/s> images/s [| mfu ...]
Usage: resnet_torch.py --depth 20 --stem cifar --batch 128 --size 28 --channels 1
       [--device cpu|cuda] [--threads 2] [--warmup 5] [--steps 20]
       [--precision fp32|tf32|bf16|fp16] [--compile] [--peak-tflops T]
"""
import argparse
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import twin_common as tc  # noqa: E402


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        sc = x if self.downsample is None else self.downsample(x)
        return F.relu(out + sc)


class CifarResNet(nn.Module):
    def __init__(self, depth, width, in_ch, classes):
        super().__init__()
        n = (depth - 2) // 6
        self.conv1 = nn.Conv2d(in_ch, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        layers, cin = [], width
        for i, w in enumerate([width, 2 * width, 4 * width]):
            blocks = []
            for b in range(n):
                blocks.append(BasicBlock(cin, w, 2 if (b == 0 and i > 0) else 1))
                cin = w
            layers.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3 = layers
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--depth", type=int, default=20)
    p.add_argument("--width", type=int, default=0)
    p.add_argument("--stem", default="cifar")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--size", type=int, default=28)
    p.add_argument("--channels", type=int, default=1)
    p.add_argument("--classes", type=int, default=10)
    tc.add_common_args(p)
    a = p.parse_args()
    dev, amp, scaler = tc.setup(a)
    if a.stem == "cifar":
        model = CifarResNet(a.depth, a.width or 16, a.channels, a.classes)
    else:
        import torchvision
        model = getattr(torchvision.models, f"resnet{a.depth}")(num_classes=a.classes)
        if a.channels != 3:
            model.conv1 = nn.Conv2d(a.channels, 64, 7, 2, 3, bias=False)
    n = tc.num_params(model)
    fwd_flops = tc.conv_linear_forward_flops(model, torch.zeros(1, a.channels, a.size, a.size))
    model = model.to(dev).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)
    step_fn = tc.maybe_compile(a, model)
    x = torch.randn(a.batch, a.channels, a.size, a.size, device=dev).to(memory_format=torch.channels_last)
    y = torch.randint(0, a.classes, (a.batch,), device=dev)

    def step():
        opt.zero_grad(set_to_none=True)
        with tc.autocast(a, amp):
            loss = F.cross_entropy(step_fn(x), y)
        tc.backward_and_step(loss, opt, scaler)

    print(f"params: {n} | model FLOPs {3 * fwd_flops:.4g} per image (training) | resnet{a.depth} {a.stem} stem, "
          f"{a.channels}x{a.size}x{a.size} -> {a.classes} | batch {a.batch} | {a.precision}"
          f"{' compiled' if a.compile else ''} | PyTorch {torch.__version__}", flush=True)
    dt = tc.timed(a, step)
    tc.report(a, a.batch * a.steps / dt, "images", 3 * fwd_flops)


if __name__ == "__main__":
    main()
