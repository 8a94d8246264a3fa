#!/bin/bash
# Gradient compression on 2 CPU ranks (docs/benchmarks.md, "gradient compression"): ResNet-20
# on Fashion-MNIST (configs/resnet20_fmnist.toml) with none, bf16 and PowerSGD rank 4, the
# three side by side, shortened to EPOCHS epochs. Run from a directory holding data/ (the
# recipe's data/fashion-mnist); results under OUT/runs, logs under OUT/logs. WARMUP is the LR
# warm-up (50 for shortened runs; the recipe's 200 for its full 8 epochs), PSGD_START the step
# at which PowerSGD takes over from the uncompressed all-reduce (PyTorch's start_powerSGD_iter).
#   [WARMUP=50] [PSGD_START=20] scripts/bench/grad_compression_cpu.sh [EPOCHS=2] [OUT=gc_bench] [DTRAIN=build/dtrain]
set -eu
WARMUP=${WARMUP:-50}
PSGD_START=${PSGD_START:-20}
EPOCHS=${1:-2}
OUT=${2:-gc_bench}
BIN=$(realpath "${3:-build/dtrain}")
RECIPE=$(realpath "$(dirname "$0")/../../configs/resnet20_fmnist.toml")
mkdir -p "$OUT/logs"
run() {  # name port overrides...
  local name=$1 port=$2
  shift 2
  /usr/bin/time -f "$name wall %e s" nice -n 10 "$BIN" train "$RECIPE" --nproc-per-node 2 --master-port "$port" \
    --set run.name="$name" --set run.out_dir="$OUT/runs" --set train.epochs="$EPOCHS" \
    --set schedule.warmup_steps="$WARMUP" --set eval.every_steps=0 --set log.every_steps=20 \
    --set checkpoint.every_steps=0 "$@" > "$OUT/logs/$name.log" 2>&1
}
run gc_none 29821 &
run gc_bf16 29822 --set 'parallel.grad_compression="bf16"' &
run gc_psgd4 29823 --set 'parallel.grad_compression="powersgd"' --set parallel.powersgd_rank=4 \
  --set parallel.powersgd_start_step="$PSGD_START" &
wait
grep -h "done:\|wall" "$OUT"/logs/gc_*.log
