#!/usr/bin/env bash
# Data-parallel throughput on this CPU, 2 ranks (Gloo, 1 thread each): ZeRO-0 against ZeRO-3
# (parameters, gradients and optimizer state sharded per block), and ZeRO-3 with activation
# recomputation (block, selective), on GPT 4 layers x 128 wide (block 128, bytes, batch 8 per
# rank, fp32, AdamW, synthetic tokens), alternating, best of ROUNDS. Each run trains STEPS
# steps; its rate is the median tokens/s of the logged steps after the first 5. Prints each
# variant and its ratio to ZeRO-0.
#   scripts/bench/zero_cpu.sh [BIN]        (default ./build/dtrain)
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${1:-./build/dtrain}
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-30}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cat > "$WORK/gpt.toml" <<TOML
[run]
name = "zero_bench"
out_dir = "$WORK/runs"
device = "cpu"
threads = 1
[model]
kind = "gpt"
n_layer = 4
n_head = 4
n_embd = 128
block_size = 128
vocab_size = 256
[data]
kind = "synthetic"
[train]
batch_size = 8
max_steps = $STEPS
[optim]
name = "adamw"
lr = 1e-3
[checkpoint]
every_steps = 0
[log]
every_steps = 1
tensorboard = false
TOML
rate() {  # median tokens/s after the first 5 steps
  python3 - "$1" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
v = [r["tokens_per_s"] for r in rows if r.get("kind") == "train" and r["step"] > 5]
print(f"{statistics.median(v):.1f}")
PY
}
VARIANTS=(0:none 3:none 3:block 3:selective)
declare -A best
for v in "${VARIANTS[@]}"; do best[$v]=0; done
for r in $(seq "$ROUNDS"); do
  i=0
  for v in "${VARIANTS[@]}"; do
    z=${v%%:*}; rc=${v#*:}; i=$((i + 1))
    rm -rf "$WORK/runs"
    "$BIN" train "$WORK/gpt.toml" --nproc-per-node 2 --master-port $((29700 + r * 8 + i)) \
      --set parallel.zero="$z" --set train.recompute="$rc" > "$WORK/run.log" 2>&1 || { cat "$WORK/run.log"; exit 1; }
    t=$(rate "$WORK/runs/zero_bench/metrics.jsonl")
    echo "round $r: zero $z, recompute $rc: $t tokens/s"
    best[$v]=$(python3 -c "print(max(${best[$v]}, $t))")
  done
done
for v in "${VARIANTS[@]}"; do
  echo "best: zero ${v%%:*}, recompute ${v#*:}: ${best[$v]} tokens/s ($(python3 -c "print(round(${best[$v]} / ${best[0:none]}, 3))") of ZeRO-0)"
done
