#!/usr/bin/env python3
"""Writes tests/fixtures/: reference forward/backward results of small PyTorch models with
fixed random weights, for tests/checkpoint/test_fixtures.cpp (no Python needed when the tests run).

  gpt2.*.safetensors  2-layer GPT-2 (n_embd 64, 2 heads, vocab 100, block 16), Hugging Face
                      names and Conv1D layout; one forward + backward of the mean next-token
                      cross-entropy on fixed ids/targets, computed in float64.
  resnet.*            CIFAR-style ResNet of BasicBlocks (torchvision's block; width 4, one
                      block per stage, projection shortcuts), train-mode batch norm,
                      label-smoothed (0.1) cross-entropy; input NHWC [4,8,8,3].
  unet.*              a one-level U-Net (down.0, bottleneck, up.0 with ConvTranspose2d,
                      1x1 head; base 4 channels), train-mode batch norm, loss sum(y * r)
                      for a fixed r; input NHWC [2,8,8,3].

Each model's tensors are packed into shards under 200 KB: <model>.weights.<k>,
<model>.io.<k> (inputs, outputs, loss) and <model>.grads.<k> (gradient of every weight,
named like the weight). Stored as f32. Run: .venv/bin/python scripts/make_fixtures.py
"""
import math
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures")
LIMIT = 190 * 1024


def save_sharded(prefix, tensors):
    shards, cur, size = [], {}, 0
    for name, t in tensors.items():
        t = t.detach().contiguous()
        t = t.float() if t.is_floating_point() else t  # int64 counters stay I64
        n = t.numel() * t.element_size()
        if cur and size + n > LIMIT:
            shards.append(cur)
            cur, size = {}, 0
        if n > LIMIT:
            sys.exit(f"{prefix}: tensor {name} alone is {n} bytes")
        cur[name] = t
        size += n
    if cur:
        shards.append(cur)
    for k, s in enumerate(shards):
        save_file(s, os.path.join(OUT, f"{prefix}.{k}.safetensors"))


def gpt2():
    torch.manual_seed(1)
    L, H, C, V, P, B, T = 2, 2, 64, 100, 16, 2, 8
    W = {}

    def p(name, *shape, std, mean=0.0):
        W[name] = (torch.randn(*shape, dtype=torch.float64) * std + mean).float().double()

    p("transformer.wte.weight", V, C, std=0.1)
    p("transformer.wpe.weight", P, C, std=0.1)
    for i in range(L):
        h = f"transformer.h.{i}."
        p(h + "ln_1.weight", C, std=0.1, mean=1.0); p(h + "ln_1.bias", C, std=0.1)
        p(h + "attn.c_attn.weight", C, 3 * C, std=0.1); p(h + "attn.c_attn.bias", 3 * C, std=0.05)
        p(h + "attn.c_proj.weight", C, C, std=0.05); p(h + "attn.c_proj.bias", C, std=0.05)
        p(h + "ln_2.weight", C, std=0.1, mean=1.0); p(h + "ln_2.bias", C, std=0.1)
        p(h + "mlp.c_fc.weight", C, 4 * C, std=0.1); p(h + "mlp.c_fc.bias", 4 * C, std=0.05)
        p(h + "mlp.c_proj.weight", 4 * C, C, std=0.05); p(h + "mlp.c_proj.bias", C, std=0.05)
    p("transformer.ln_f.weight", C, std=0.1, mean=1.0); p("transformer.ln_f.bias", C, std=0.1)
    for t in W.values():
        t.requires_grad_(True)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V, (B, T), generator=g)
    tgt = torch.randint(0, V, (B, T), generator=g)

    def ln(x, pre):
        return F.layer_norm(x, (C,), W[pre + ".weight"], W[pre + ".bias"], 1e-5)

    x = W["transformer.wte.weight"][ids] + W["transformer.wpe.weight"][:T]
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
    for i in range(L):
        h = f"transformer.h.{i}."
        qkv = ln(x, h + "ln_1") @ W[h + "attn.c_attn.weight"] + W[h + "attn.c_attn.bias"]
        q, k, v = [t.view(B, T, H, C // H).transpose(1, 2) for t in qkv.split(C, -1)]
        att = ((q @ k.transpose(-1, -2)) / math.sqrt(C // H)).masked_fill(mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + y @ W[h + "attn.c_proj.weight"] + W[h + "attn.c_proj.bias"]
        m = F.gelu(ln(x, h + "ln_2") @ W[h + "mlp.c_fc.weight"] + W[h + "mlp.c_fc.bias"], approximate="tanh")
        x = x + m @ W[h + "mlp.c_proj.weight"] + W[h + "mlp.c_proj.bias"]
    logits = ln(x, "transformer.ln_f") @ W["transformer.wte.weight"].t()
    loss = F.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1))
    loss.backward()
    save_sharded("gpt2.weights", W)
    save_sharded("gpt2.io", {"ids": ids.float(), "targets": tgt.float(), "logits": logits,
                             "loss": loss.reshape(1)})
    save_sharded("gpt2.grads", {n: t.grad for n, t in W.items()})


def randomise_bn(net):
    for m in net.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            torch.nn.init.uniform_(m.weight, 0.5, 1.5)
            torch.nn.init.uniform_(m.bias, -0.3, 0.3)


def save_image_model(prefix, net, x_nchw, loss_fn, extra_io):
    """net in float64 train mode; x NCHW; loss_fn(y) -> scalar. Input/output stored NHWC."""
    state = {k: v.clone() for k, v in net.state_dict().items()}
    y = net(x_nchw)
    loss = loss_fn(y)
    loss.backward()
    nhwc = (lambda t: t.permute(0, 2, 3, 1)) if y.dim() == 4 else (lambda t: t)
    save_sharded(prefix + ".weights", state)
    io = {"input": x_nchw.permute(0, 2, 3, 1), "output": nhwc(y), "loss": loss.reshape(1)}
    io.update(extra_io)
    save_sharded(prefix + ".io", io)
    save_sharded(prefix + ".grads", {k: p.grad for k, p in net.named_parameters()})


def resnet():
    import torch.nn as nn
    from torchvision.models.resnet import BasicBlock

    class Net(nn.Module):
        def __init__(s, w=4, classes=5, inch=3):
            super().__init__()
            s.conv1 = nn.Conv2d(inch, w, 3, 1, 1, bias=False)
            s.bn1 = nn.BatchNorm2d(w)
            s.relu = nn.ReLU()
            cin = w
            for i in range(3):
                planes, stride = w << i, 1 if i == 0 else 2
                ds = None
                if stride != 1 or cin != planes:
                    ds = nn.Sequential(nn.Conv2d(cin, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))
                setattr(s, f"layer{i + 1}", nn.Sequential(BasicBlock(cin, planes, stride, ds)))
                cin = planes
            s.fc = nn.Linear(cin, classes)

        def forward(s, x):
            x = s.relu(s.bn1(s.conv1(x)))
            x = s.layer3(s.layer2(s.layer1(x)))
            return s.fc(x.mean((2, 3)))

    torch.manual_seed(4)
    net = Net()
    randomise_bn(net)
    net = net.double().train()
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    labels = torch.tensor([0, 3, 1, 4])
    save_image_model("resnet", net, x, lambda y: F.cross_entropy(y, labels, label_smoothing=0.1),
                     {"labels": labels.float()})


def unet():
    import torch.nn as nn

    def dc(i, o):
        return nn.Sequential(nn.Conv2d(i, o, 3, 1, 1, bias=False), nn.BatchNorm2d(o), nn.ReLU(),
                             nn.Conv2d(o, o, 3, 1, 1, bias=False), nn.BatchNorm2d(o), nn.ReLU())

    class DC(nn.Module):
        def __init__(s, i, o):
            super().__init__()
            s.conv = dc(i, o)

        def forward(s, x):
            return s.conv(x)

    class Up(nn.Module):
        def __init__(s, i, o):
            super().__init__()
            s.up = nn.ConvTranspose2d(i, o, 2, 2)
            s.conv = DC(2 * o, o)

        def forward(s, x, skip):
            return s.conv(torch.cat([skip, s.up(x)], 1))

    class UNet1(nn.Module):
        def __init__(s, base=4, inch=3, K=3):
            super().__init__()
            s.down = nn.ModuleList([DC(inch, base)])
            s.bottleneck = DC(base, 2 * base)
            s.up = nn.ModuleList([Up(2 * base, base)])
            s.head = nn.Conv2d(base, K, 1)

        def forward(s, x):
            skip = s.down[0](x)
            x = s.bottleneck(F.max_pool2d(skip, 2))
            return s.head(s.up[0](x, skip))

    torch.manual_seed(5)
    net = UNet1()
    randomise_bn(net)
    net = net.double().train()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    r = torch.randn(2, 8, 8, 3, dtype=torch.float64)  # NHWC, like the output
    save_image_model("unet", net, x, lambda y: (y.permute(0, 2, 3, 1) * r).sum(), {"r": r})


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    gpt2()
    resnet()
    unet()
