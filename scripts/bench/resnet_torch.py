#!/usr/bin/env python3
"""PyTorch twin of `dtrain bench` for the ResNet recipes: same model (torchvision ResNet or
the CIFAR ResNet-6n+2 with option-B shortcuts), batch size, input size, optimizer (SGD with
Nesterov momentum), threads; channels_last. Prints steady-state images/s as one line:
    torch: <images/s> images/s
Usage: resnet_torch.py --depth 20 --stem cifar --batch 128 --size 28 --channels 1
       [--device cpu|cuda] [--threads 2] [--warmup 5] [--steps 20] [--precision fp32|bf16|fp16]
       [--compile]
"""
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


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
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--compile", action="store_true")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    if a.stem == "cifar":
        model = CifarResNet(a.depth, a.width or 16, a.channels, a.classes)
    else:
        import torchvision
        model = getattr(torchvision.models, f"resnet{a.depth}")(num_classes=a.classes)
        if a.channels != 3:
            model.conv1 = nn.Conv2d(a.channels, 64, 7, 2, 3, bias=False)
    dev = torch.device(a.device)
    model = model.to(dev).to(memory_format=torch.channels_last)
    if a.device == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = a.precision == "tf32"
        torch.backends.cudnn.allow_tf32 = a.precision == "tf32"
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)
    step_fn = model
    if a.compile:
        step_fn = torch.compile(model)
    x = torch.randn(a.batch, a.channels, a.size, a.size, device=dev).to(memory_format=torch.channels_last)
    y = torch.randint(0, a.classes, (a.batch,), device=dev)
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(a.precision)
    scaler = torch.cuda.amp.GradScaler() if a.precision == "fp16" else None

    def step():
        opt.zero_grad(set_to_none=True)
        if amp is not None:
            with torch.autocast(device_type=a.device, dtype=amp):
                loss = F.cross_entropy(step_fn(x), y)
        else:
            loss = F.cross_entropy(step_fn(x), y)
        if scaler:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()

    def sync():
        if a.device == "cuda":
            torch.cuda.synchronize()

    for _ in range(a.warmup):
        step()
    sync()
    t = time.perf_counter()
    for _ in range(a.steps):
        step()
    sync()
    dt = time.perf_counter() - t
    print(f"torch: {a.batch * a.steps / dt:.1f} images/s")


if __name__ == "__main__":
    main()
