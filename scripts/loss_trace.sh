#!/usr/bin/env bash
# Per-step CPU losses of the three demo recipes (ResNet-20 on Fashion-MNIST, the byte-level
# GPT on fortunes, the U-Net on shapes) over their first N steps, one file per recipe, so two
# builds can be compared bit for bit. Each recipe runs as it is (its schedule over all its
# steps) and is stopped after step N by the train.stop_at_step failpoint (a preemption; builds
# older than the failpoints read DTRAIN_TEST_STOP_AT_STEP, also set):
#   scripts/loss_trace.sh OUT_DIR [DTRAIN_BIN] [STEPS]        (defaults: build/dtrain, 200)
#   diff -r OLD_DIR NEW_DIR && echo identical
# Prepares the datasets under data/ when they are missing. Each file holds "step loss" rows
# with the losses as metrics.jsonl wrote them (shortest round-trip decimal of the double).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/loss_trace.sh OUT_DIR [DTRAIN_BIN] [STEPS]}
bin=${2:-build/dtrain}
steps=${3:-200}
mkdir -p "$out"
out=$(cd "$out" && pwd)
[ -f data/fashion-mnist/manifest.json ] || "$bin" data fashion-mnist --out data/fashion-mnist
[ -f data/fortunes/manifest.json ] || [ -n "$(ls data/fortunes/*train*.bin 2>/dev/null)" ] ||
  "$bin" data tokenize /usr/share/games/fortunes --out data/fortunes --tokenizer byte
[ -f data/shapes/manifest.json ] || "$bin" data shapes --out data/shapes --count 2000 --size 64 --classes 4
runs=$(mktemp -d)
trap 'rm -rf "$runs"' EXIT
for recipe in resnet20_fmnist gpt_fortunes unet_shapes; do
  DTRAIN_FAILPOINTS="train.stop_at_step=$steps" DTRAIN_TEST_STOP_AT_STEP=$steps \
    "$bin" train "configs/$recipe.toml" --device cpu --set run.out_dir="\"$runs\"" \
    --set log.every_steps=1 --set log.tensorboard=false >/dev/null
  python3 -c '
import json, sys
for line in open(sys.argv[1]):
    if "\"kind\":\"train\"" in line.replace(" ", ""):
        row = json.loads(line)
        print(row["step"], repr(row["loss"]))' "$runs/$recipe/metrics.jsonl" > "$out/$recipe.losses"
  echo "$recipe: $(wc -l < "$out/$recipe.losses") steps, last: $(tail -1 "$out/$recipe.losses")"
done
