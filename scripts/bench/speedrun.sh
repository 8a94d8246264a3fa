#!/usr/bin/env bash
# A speedrun recipe against its PyTorch twin, side by side in one run on this machine:
# `dtrain reproduce RECIPE` (prepares the data, trains, evaluates, prints the verdict), then the
# twin (speedrun_resnet_torch.py for ResNet recipes, speedrun_gpt_torch.py for GPT ones) on the
# same data with the same recipe, then both training times, the time each took to reach the
# recipe's [expect] target, and their ratio. Nothing else should run on the machine meanwhile.
#   scripts/bench/speedrun.sh RECIPE [BIN]     (default BIN ./build/dtrain; PY=/usr/bin/python3)
set -euo pipefail
cd "$(dirname "$0")/../.."
RECIPE=${1:?usage: scripts/bench/speedrun.sh RECIPE [BIN]}
BIN=${2:-./build/dtrain}
PY=${PY:-/usr/bin/python3}
LOG=$(mktemp -d)
trap 'rm -rf "$LOG"' EXIT
kind=$("$PY" -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["model"]["kind"])' "$RECIPE")
case "$kind" in
  resnet) twin=scripts/bench/speedrun_resnet_torch.py ;;
  gpt) twin=scripts/bench/speedrun_gpt_torch.py ;;
  *) echo "speedrun.sh: $RECIPE: model.kind = $kind has no PyTorch twin" >&2; exit 2 ;;
esac
# The twin gets the OpenBLAS kernels dtrain runs with (dtrain picks them where OpenBLAS falls
# back to its generic Prescott ones; see `dtrain info`), unless OPENBLAS_CORETYPE is set already.
if [ -z "${OPENBLAS_CORETYPE:-}" ]; then
  k=$("$BIN" info | sed -nE 's/.*kernels ([A-Za-z0-9]+) \(chosen by dtrain.*/\1/p')
  [ -n "$k" ] && export OPENBLAS_CORETYPE=$k && echo "speedrun.sh: OPENBLAS_CORETYPE=$k for both (as dtrain chose)"
fi
set +e
"$BIN" reproduce "$RECIPE" 2>&1 | tee "$LOG/dtrain.txt"
rc=${PIPESTATUS[0]}
set -e
[ "$rc" -le 1 ] || exit "$rc"
"$PY" "$twin" "$RECIPE" | tee "$LOG/torch.txt"
# dtrain's verdict line: "<metric> >= <target> reached at step K after <s> s ..."
"$PY" - "$LOG/dtrain.txt" "$LOG/torch.txt" <<'PYEOF'
import re, sys
d, t = open(sys.argv[1]).read(), open(sys.argv[2]).read()
def num(pat, s):
    m = re.search(pat, s)
    return float(m.group(1)) if m else None
d_time = num(r"reached at step \d+ after ([0-9.]+) s", d)
t_time = num(r"reached at step \d+ \(([0-9.]+) s\)", t)
print(f"time to target: dtrain {d_time if d_time is not None else 'not reached'} s, "
      f"PyTorch {t_time if t_time is not None else 'not reached'} s", end="")
print(f" | PyTorch / dtrain = {t_time / d_time:.2f}x" if d_time and t_time else "")
PYEOF
