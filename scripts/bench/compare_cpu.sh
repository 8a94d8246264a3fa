#!/usr/bin/env bash
# dtrain vs PyTorch on this CPU, same model, batch, input, optimizer and threads, run
# side by side (alternating, best of ROUNDS). Prints both throughputs and the ratio.
#   scripts/bench/compare_cpu.sh [RECIPE] [THREADS]
set -euo pipefail
cd "$(dirname "$0")/../.."
RECIPE=${1:-configs/bench/resnet20_fmnist_cpu.toml}
THREADS=${2:-$(nproc)}
ROUNDS=${ROUNDS:-3}
PY=${PYTHON:-.venv/bin/python}
best_d=0; best_t=0
for r in $(seq "$ROUNDS"); do
  d=$(./build/dtrain bench "$RECIPE" --set run.threads="$THREADS" --warmup 5 --steps 30 | sed -n 's/^throughput: \([0-9.]*\) images.*/\1/p')
  t=$($PY scripts/bench/resnet_torch.py --depth 20 --stem cifar --batch 128 --size 28 --channels 1 \
        --threads "$THREADS" --warmup 5 --steps 30 | sed -n 's/^torch: \([0-9.]*\) images.*/\1/p')
  echo "round $r: dtrain $d images/s | torch $t images/s"
  best_d=$(python3 -c "print(max($best_d, $d))"); best_t=$(python3 -c "print(max($best_t, $t))")
done
python3 -c "print(f'best: dtrain {$best_d:.1f} images/s | PyTorch {$best_t:.1f} images/s | ratio {$best_d/$best_t:.2f}x')"
