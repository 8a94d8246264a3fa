#!/usr/bin/env bash
# The largest GPT-2 batch (sequences of 1024 tokens, bf16, AdamW) that trains on one GPU,
# without and with activation recomputation + optimizer offload (ZeRO-3 shards nothing on
# one rank; offload and recompute are what move the limit there), and dtrain plan's
# prediction beside each. Per model and variant: the batch doubles from START until a step
# runs out of device memory (or CAP), then BISECT halvings narrow the gap; each try is
# `dtrain bench` with 1 warm-up and 1 timed step. A failure other than out-of-memory stops
# the variant and is reported (exit 1 at the end).
#   scripts/bench/max_batch_gpu.sh [BIN]          (default ./build-gpu/dtrain)
#   MODELS="gpt2 gpt2-medium gpt2-large" VARIANTS="plain recompute+offload" START=8 CAP=512
#   BISECT=2 RECIPE=configs/bench/gpt2_124m.toml DEVICE=cuda
#   (a dry run of the logic on the CPU, where nothing runs out of memory:
#    MODELS=recipe RECIPE=configs/tiny_gpt.toml DEVICE=cpu CAP=4; "recipe": the recipe's own model)
# Prints one line per model and variant: largest batch that fit, first that did not, the
# tries' wall time, and the plan's predicted peak bytes per rank at the largest batch.
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=${1:-./build-gpu/dtrain}
MODELS=${MODELS:-gpt2 gpt2-medium gpt2-large}
VARIANTS=${VARIANTS:-plain recompute+offload}
START=${START:-8}
CAP=${CAP:-512}
BISECT=${BISECT:-2}
RECIPE=${RECIPE:-configs/bench/gpt2_124m.toml}
DEVICE=${DEVICE:-cuda}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
status=0

sets() {  # sets MODEL VARIANT BATCH -> the --set arguments of one try
  local v=()
  v+=(--set "run.device=\"$DEVICE\"" --set "train.batch_size=$3")
  [ "$1" = recipe ] || v+=(--set "model.preset=\"$1\"")
  case $2 in
    plain) ;;
    recompute+offload) v+=(--set 'train.recompute="block"' --set 'parallel.offload="optimizer"') ;;
    *) echo "unknown variant $2" >&2; return 1 ;;
  esac
  printf '%s\n' "${v[@]}"
}

try() {  # try MODEL VARIANT BATCH -> 0 fits, 1 out of memory, 2 another failure (logged)
  mapfile -t args < <(sets "$1" "$2" "$3") || return 2
  local log="$WORK/$1.$2.$3.log"
  "$BIN" bench "$RECIPE" "${args[@]}" --warmup 1 --steps 1 >"$log" 2>&1
  local rc=$?
  [ $rc -eq 0 ] && return 0
  grep -qiE "out of memory|ALLOC_FAILED" "$log" && return 1
  echo "  $1 $2 batch $3: exit $rc: $(tail -1 "$log")" >&2
  return 2
}

for m in $MODELS; do
  for v in $VARIANTS; do
    t0=$SECONDS
    fit=0 nofit=0 b=$START failed=0
    while [ "$b" -le "$CAP" ]; do
      try "$m" "$v" "$b"; r=$?
      if [ $r -eq 0 ]; then fit=$b; b=$((b * 2));
      elif [ $r -eq 1 ]; then nofit=$b; break;
      else failed=1; break; fi
    done
    if [ $failed -eq 0 ] && [ $nofit -gt 0 ]; then
      lo=$fit hi=$nofit
      for ((i = 0; i < BISECT && hi - lo > 1; ++i)); do
        mid=$(((lo + hi) / 2))
        try "$m" "$v" "$mid"; r=$?
        if [ $r -eq 0 ]; then lo=$mid; elif [ $r -eq 1 ]; then hi=$mid; else failed=1; break; fi
      done
      fit=$lo nofit=$hi
    fi
    if [ $failed -ne 0 ]; then
      echo "$m $v: FAILED (not out of memory; see above)"
      status=1
      continue
    fi
    predicted="-"
    if [ "$fit" -gt 0 ]; then  # the plan's total for one process at that batch (its row of this recompute)
      mapfile -t args < <(sets "$m" "$v" "$fit")
      rc=$([ "$v" = plain ] && echo none || echo block)
      "$BIN" plan "$RECIPE" --nproc 1 "${args[@]}" --json "$WORK/plan.json" >"$WORK/plan.log" 2>&1 &&
        predicted=$(python3 - "$WORK/plan.json" "$rc" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
rows = [r for r in j["rows"] if r["layout"] == "single" and r.get("recompute", "none") == sys.argv[2]]
print(f"{rows[0]['total'] / 2**30:.2f} GiB predicted at that batch" if rows else "no row")
PY
)
    fi
    echo "$m $v: largest batch that fit $fit, first that did not ${nofit/#0/- (cap $CAP)} ($((SECONDS - t0)) s); plan: $predicted"
  done
done
exit $status
