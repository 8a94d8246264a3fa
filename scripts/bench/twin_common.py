"""What the PyTorch twins of `dtrain bench` share: the common command-line options, device and
precision setup, torch.compile, the timed loop, FLOPs of convolution/linear layers for MFU,
reading a dtrain recipe (values, learning-rate schedule, threads) for the speedrun twins,
and the output lines:
    params: <trainable parameters> ...
    torch: <value> <unit>/s [| mfu <percent>% of <peak> TFLOP/s]
"""
import contextlib
import inspect
import math
import os
import sys
import time

import torch
import torch.nn as nn


def add_common_args(p):
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: PyTorch's default)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--precision", default="fp32", choices=["fp32", "tf32", "bf16", "fp16"],
                   help="fp32 (no TF32), tf32 (fp32 storage, TF32 math), bf16/fp16 (autocast)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (PyTorch >= 2.0)")
    p.add_argument("--peak-tflops", type=float, default=0.0,
                   help="device peak TFLOP/s of this precision: also print MFU")


def fail(msg, code=2):
    print(f"{sys.argv[0]}: {msg}", file=sys.stderr)
    sys.exit(code)


def setup(a):
    """Threads, seed and math flags; returns (device, autocast dtype or None, GradScaler or None)."""
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    if a.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda but this PyTorch sees no CUDA device")
    if a.precision == "fp16" and a.device != "cuda":
        fail("--precision fp16 needs --device cuda (CPU autocast has no fp16 here)")
    if a.compile and not hasattr(torch, "compile"):
        fail(f"--compile needs torch.compile (PyTorch >= 2.0); this is PyTorch {torch.__version__}")
    if a.device == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = a.precision == "tf32"
        torch.backends.cudnn.allow_tf32 = a.precision == "tf32"
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(a.precision)
    scaler = torch.cuda.amp.GradScaler() if a.precision == "fp16" else None
    return torch.device(a.device), amp, scaler


def autocast(a, amp):
    """The autocast context of the precision (none for fp32/tf32)."""
    if amp is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=a.device, dtype=amp)


def maybe_compile(a, module):
    return torch.compile(module) if a.compile else module


def backward_and_step(loss, opt, scaler, params=None, clip=0.0):
    """loss.backward() (scaled for fp16), optional global-norm clipping, optimizer step."""
    if scaler is not None:
        scaler.scale(loss).backward()
        if clip > 0:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, clip)
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()


def timed(a, step):
    """Runs a.warmup untimed steps, then a.steps timed ones; returns the seconds they took."""
    def sync():
        if a.device == "cuda":
            torch.cuda.synchronize()

    for _ in range(a.warmup):
        step()
    sync()
    if a.device == "cuda":  # the timed steps are the profiler's range (scripts/prof/ktrace.cpp)
        torch.cuda.profiler.start()
    t = time.perf_counter()
    for _ in range(a.steps):
        step()
    sync()
    dt = time.perf_counter() - t
    if a.device == "cuda":
        torch.cuda.profiler.stop()
    return dt


def num_params(model):
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def conv_linear_forward_flops(model, example):
    """Forward FLOPs of one sample counted as dtrain counts them (Model::forward_flops, the
    rules in src/session/flops.h): 2 x weight elements x positions the weight is applied at,
    for every Conv2d (output positions),
    ConvTranspose2d (input positions) and Linear; norms, activations and pooling are not
    counted. `example` is a batch of one."""
    total = [0]

    def hook(m, inp, out):
        w = m.weight.numel()
        if isinstance(m, nn.Conv2d):
            total[0] += 2 * w * out.shape[-2] * out.shape[-1]
        elif isinstance(m, nn.ConvTranspose2d):
            total[0] += 2 * w * inp[0].shape[-2] * inp[0].shape[-1]
        else:
            total[0] += 2 * w
    hs = [m.register_forward_hook(hook) for m in model.modules()
          if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d, nn.Linear))]
    was_training = model.training
    model.eval()
    with torch.no_grad():
        model(example)
    model.train(was_training)
    for h in hs:
        h.remove()
    return total[0]


def report(a, rate, unit, train_flops_per_unit):
    """The throughput line, with MFU when --peak-tflops was given."""
    line = f"torch: {rate:.1f} {unit}/s"
    if a.peak_tflops > 0 and train_flops_per_unit > 0:
        mfu = train_flops_per_unit * rate / (a.peak_tflops * 1e12)
        line += f" | mfu {100 * mfu:.2f}% of {a.peak_tflops:.1f} TFLOP/s"
    print(line)


def recipe_get(cfg, key, default):
    """A dtrain recipe's value (cfg from tomllib): recipe_get(cfg, "optim.lr", 0.1)."""
    table, name = key.split(".")
    return cfg.get(table, {}).get(name, default)


def recipe_lr(cfg, step, total):
    """dtrain's learning rate at `step` of `total` (optim/schedule.cpp): linear warmup from
    schedule.warmup_start_factor, then constant, linear or cosine to schedule.min_lr."""
    base = recipe_get(cfg, "optim.lr", 1e-3)
    warm = recipe_get(cfg, "schedule.warmup_steps", 0)
    start = recipe_get(cfg, "schedule.warmup_start_factor", 0.0)
    if step < warm:
        return base * (start + (1 - start) * step / warm)
    kind, lo = recipe_get(cfg, "schedule.kind", "constant"), recipe_get(cfg, "schedule.min_lr", 0.0)
    t, tmax = step - warm, total - warm
    if kind == "linear":
        return base + (lo - base) * min(t, tmax) / tmax
    if kind == "cosine":
        return lo + (base - lo) * 0.5 * (1 + math.cos(math.pi * min(t, tmax) / tmax))
    if kind == "constant":
        return base
    fail(f"schedule.kind = {kind!r} is not implemented in the PyTorch twin")


def recipe_threads(cfg):
    """dtrain's thread count: run.threads, else OMP_NUM_THREADS, else the affinity mask's CPUs."""
    return recipe_get(cfg, "run.threads", 0) or int(os.environ.get("OMP_NUM_THREADS") or 0) or len(os.sched_getaffinity(0))


def lm_training_step(a, model, dev, amp, scaler):
    """The language-model twins' step (gpt_torch.py, llama_torch.py): AdamW over the parameters
    that require gradients (weight decay on the matrices only, fused on CUDA where PyTorch has it),
    torch.compile when asked, one fixed random batch of a.batch x a.block tokens (inputs and their
    next tokens), clipping at a.clip. Returns (step, fused)."""
    params = [q for q in model.parameters() if q.requires_grad]
    groups = [{"params": [q for q in params if q.dim() >= 2], "weight_decay": a.weight_decay},
              {"params": [q for q in params if q.dim() < 2], "weight_decay": 0.0}]
    kw = {}
    fused = a.device == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
    if fused:
        kw["fused"] = True
    opt = torch.optim.AdamW(groups, lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps, **kw)
    step_fn = maybe_compile(a, model)
    g = torch.Generator().manual_seed(0)
    win = torch.randint(0, a.vocab, (a.batch, a.block + 1), generator=g).to(dev)
    x, y = win[:, :-1].contiguous(), win[:, 1:].contiguous()

    def step():
        opt.zero_grad(set_to_none=True)
        with autocast(a, amp):
            loss = step_fn(x, y)
        backward_and_step(loss, opt, scaler, params, a.clip)

    return step, fused


def add_lm_args(p, batch, lr):
    """The language-model twins' batch and AdamW options (defaults: `batch` sequences, `lr`)."""
    p.add_argument("--batch", type=int, default=batch, help="sequences per step")
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="global grad-norm clip (0: off)")
    add_common_args(p)


def run_lm(a, n, unpadded, flops_per_token, model_text, attn, step, fused):
    """Prints the language-model twins' params line (`model_text`: the shape), times `step` and
    reports tokens/s."""
    print(f"params: {n} ({unpadded} without the vocabulary padding) | model FLOPs {flops_per_token:.4g} per token "
          f"(training) | {model_text} | batch {a.batch} | "
          f"{a.precision}{' compiled' if a.compile else ''} | attention {attn} | AdamW{' fused' if fused else ''} | "
          f"PyTorch {torch.__version__}", flush=True)
    dt = timed(a, step)
    report(a, a.batch * a.block * a.steps / dt, "tokens", flops_per_token)
