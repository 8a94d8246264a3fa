#!/usr/bin/env bash
# dtrain vs its PyTorch twins on one NVIDIA GPU, side by side in one run: for each benchmark
# recipe, `dtrain bench`, the twin in eager mode and the twin under torch.compile (same model,
# batch, precision, synthetic data), then one table with dtrain's ratio to each, parameter
# counts of both (they must be equal) and MFU (the twins use the peak dtrain reports).
#
#   scripts/bench/compare_gpu.sh                 the GPT-2 124M, Llama 1B, ResNet-50 and U-Net bf16 recipes
#   scripts/bench/compare_gpu.sh gpt2 unet       a subset (names: gpt2 llama resnet50 unet resnet50_tf32;
#                                                llama: configs/bench/llama3_1b.toml, a Llama-3.2-1B-like
#                                                shape, and scripts/bench/llama_torch.py)
#   scripts/bench/compare_gpu.sh --smoke-cpu     no GPU: tiny sizes, fp32, 1 step on the CPU, to
#                                                check that everything runs and the parameter
#                                                counts agree; prints no throughput
# Environment: DTRAIN (binary; default build-gpu/dtrain, else build/dtrain), PYTHON (with
# PyTorch; default python3), WARMUP (10), STEPS (30), BATCH (override the recipes' batch; the
# twins always run the batch dtrain ran), TIMEOUT (seconds per command, 300), PEAK_TFLOPS
# (the twins' MFU peak when dtrain reports none, e.g. when its run failed),
# NO_COMPILE=1 (skip torch.compile), GRAPH=0 (skip the second dtrain run with
# --set train.cuda_graph=true, whose rate is the "dtrain graph" column), LOGDIR (default $OUT/compare_gpu or build/compare_gpu),
# KTRACE=path/libdtrain_ktrace.so (every command also writes LOG.ktrace: the per-kernel times of
# its timed steps, scripts/prof/ktrace.cpp; tracing costs a little, so take the rates from a run
# without it).
# Without a CUDA device (and without --smoke-cpu) it says so and exits 1: it never prints a
# number it did not measure. Any failed command shows as FAIL in the table and the exit code
# is 1.
set -u
cd "$(dirname "$0")/../.." || exit 1
SMOKE=0
NAMES=()
for arg in "$@"; do
  case $arg in
    --smoke-cpu) SMOKE=1 ;;
    -h|--help) awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    gpt2|llama|resnet50|unet|resnet50_tf32) NAMES+=("$arg") ;;
    *) echo "compare_gpu.sh: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
  esac
done
[ ${#NAMES[@]} -eq 0 ] && NAMES=(gpt2 llama resnet50 unet)
PY=${PYTHON:-python3}
DTRAIN=${DTRAIN:-}
if [ -z "$DTRAIN" ]; then
  for b in build-gpu/dtrain build/dtrain; do [ -x "$b" ] && { DTRAIN=$b; break; }; done
fi
[ -n "$DTRAIN" ] && [ -x "$DTRAIN" ] || { echo "compare_gpu.sh: no dtrain binary (build it, or set DTRAIN)" >&2; exit 1; }
WARMUP=${WARMUP:-10}
STEPS=${STEPS:-30}
TIMEOUT=${TIMEOUT:-300}
LOGDIR=${LOGDIR:-${OUT:+$OUT/compare_gpu}}
LOGDIR=${LOGDIR:-build/compare_gpu}
mkdir -p "$LOGDIR"

# ---------- is there a GPU? ----------
if [ $SMOKE = 0 ]; then
  why=""
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    why="nvidia-smi not found (no NVIDIA driver)"
  elif ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    why="nvidia-smi lists no GPU"
  elif ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    why="$PY has no PyTorch with CUDA"
  fi
  if [ -n "$why" ]; then
    echo "compare_gpu.sh: no CUDA device to benchmark on: $why. Nothing was measured." >&2
    echo "(scripts/bench/compare_gpu.sh --smoke-cpu checks that the recipes and twins run, without numbers)" >&2
    exit 1
  fi
fi

# ---------- the benchmarks: recipe | twin | twin arguments (the recipe's model and batch) ----------
recipe_of() {
  case $1 in
    gpt2) echo configs/bench/gpt2_124m.toml ;;
    llama) echo configs/bench/llama3_1b.toml ;;
    resnet50) echo configs/bench/resnet50_bf16.toml ;;
    resnet50_tf32) echo configs/bench/resnet50_synthetic.toml ;;
    unet) echo configs/bench/unet_bf16.toml ;;
  esac
}
twin_of() {
  case $1 in
    gpt2) echo "scripts/bench/gpt_torch.py --n-layer 12 --n-head 12 --n-embd 768 --block 1024 --vocab 50257 --batch 16 --lr 6e-4 --beta1 0.9 --beta2 0.95 --weight-decay 0.1 --clip 1.0 --precision bf16" ;;
    llama) echo "scripts/bench/llama_torch.py --n-layer 16 --n-head 32 --n-kv-head 8 --n-embd 2048 --intermediate 8192 --block 2048 --vocab 128256 --tied --rms-eps 1e-5 --rope-theta 500000 --rope-scaling llama3 --rope-factor 32 --rope-low-freq-factor 1 --rope-high-freq-factor 4 --rope-original-max-positions 8192 --batch 2 --lr 3e-4 --beta1 0.9 --beta2 0.95 --weight-decay 0.1 --clip 1.0 --precision bf16" ;;
    resnet50) echo "scripts/bench/resnet_torch.py --depth 50 --stem imagenet --size 224 --channels 3 --classes 1000 --batch 128 --precision bf16" ;;
    resnet50_tf32) echo "scripts/bench/resnet_torch.py --depth 50 --stem imagenet --size 224 --channels 3 --classes 1000 --batch 128 --precision tf32" ;;
    unet) echo "scripts/bench/unet_torch.py --depth 4 --base 64 --upsample transpose --channels 3 --classes 2 --size 256 --batch 16 --dice-weight 1.0 --lr 1e-3 --weight-decay 1e-4 --precision bf16" ;;
  esac
}
# --smoke-cpu: the same recipes and twins shrunk to a CPU step (fp32; the later arguments win)
smoke_dtrain() {
  local o="--device cpu --set precision.dtype=fp32 --set run.threads=2"
  case $1 in
    gpt2) echo "$o --set model.n_layer=2 --set model.block_size=64 --set train.batch_size=2" ;;
    # vocabulary 1000: padded to 1024 rows inside, as the real 128256 is not
    llama) echo "$o --set model.n_layer=2 --set model.n_embd=64 --set model.n_head=4 --set model.n_kv_head=2 --set model.intermediate_size=160 --set model.block_size=64 --set model.vocab_size=1000 --set train.batch_size=2" ;;
    resnet50*) echo "$o --set data.synthetic_height=32 --set data.synthetic_width=32 --set train.batch_size=2" ;;
    unet) echo "$o --set model.depth=2 --set model.base_channels=8 --set data.synthetic_height=32 --set data.synthetic_width=32 --set train.batch_size=2" ;;
  esac
}
smoke_twin() {
  local o="--device cpu --precision fp32 --threads 2"
  case $1 in
    gpt2) echo "$o --n-layer 2 --block 64 --batch 2" ;;
    llama) echo "$o --n-layer 2 --n-embd 64 --n-head 4 --n-kv-head 2 --intermediate 160 --block 64 --vocab 1000 --batch 2" ;;
    resnet50*) echo "$o --size 32 --batch 2" ;;
    unet) echo "$o --depth 2 --base 8 --size 32 --batch 2" ;;
  esac
}

FAILED=0
# run LOG CMD...: runs under the timeout, output to LOG; returns its exit code
run() {
  local log=$1; shift
  echo "+ $*" >"$log"
  if [ -n "${KTRACE:-}" ]; then  # per-kernel times of the timed steps -> LOG.ktrace
    rm -f "$log.ktrace"
    CUDA_INJECTION64_PATH=$KTRACE DTRAIN_KTRACE_OUT=$log.ktrace timeout "$TIMEOUT" "$@" >>"$log" 2>&1
  else
    timeout "$TIMEOUT" "$@" >>"$log" 2>&1
  fi
}
# pieces of the logs (empty when absent)
field() { sed -n "$2" "$1" 2>/dev/null | head -1; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a > 0 && b > 0) printf "%.2fx", a / b; else printf "-" }'; }

if [ $SMOKE = 1 ]; then
  WARMUP=0
  STEPS=1
fi
ROWS=()
CMDS=()
for name in "${NAMES[@]}"; do
  recipe=$(recipe_of "$name")
  twin=$(twin_of "$name")
  dargs="--warmup $WARMUP --steps $STEPS${BATCH:+ --set train.batch_size=$BATCH}"
  targs="--device cuda --warmup $WARMUP --steps $STEPS"
  if [ $SMOKE = 1 ]; then
    dargs="$dargs $(smoke_dtrain "$name")"
    targs="--warmup $WARMUP --steps $STEPS $(smoke_twin "$name")"
  fi
  echo "== $name: dtrain bench $recipe"
  dlog=$LOGDIR/$name-dtrain.log
  # shellcheck disable=SC2086
  run "$dlog" "$DTRAIN" bench "$recipe" $dargs
  drc=$?
  d_params=$(field "$dlog" 's/^bench .*| \([0-9][0-9]*\) params |.*/\1/p')
  d_rate=$(field "$dlog" 's/^throughput: \([0-9.][0-9.]*\) .*/\1/p')
  d_unit=$(field "$dlog" 's/^throughput: [0-9.]* \([a-z]*\)\/s.*/\1/p')
  d_mfu=$(field "$dlog" 's/^throughput: .*| mfu \([0-9.]*%\) of .*/\1/p')
  peak=$(field "$dlog" 's/^throughput: .*| mfu [0-9.]*% of \([0-9.]*\) TFLOP\/s.*/\1/p')
  d_split=$(field "$dlog" 's/^breakdown: //p' | sed 's/ | /, /g')
  d_batch=$(field "$dlog" 's/^bench .*| batch \([0-9][0-9]*\) x accum .*/\1/p')
  [ $drc -ne 0 ] && { FAILED=1; echo "   dtrain FAILED (rc=$drc): $(tail -1 "$dlog")"; }
  # the same recipe with the micro-batch's forward/loss/backward replayed as a CUDA graph
  g_rate=""
  grc=-1
  if [ $SMOKE = 0 ] && [ "${GRAPH:-1}" != 0 ]; then
    echo "== $name: dtrain bench $recipe --set train.cuda_graph=true"
    glog=$LOGDIR/$name-dtrain-graph.log
    # shellcheck disable=SC2086
    run "$glog" "$DTRAIN" bench "$recipe" $dargs --set train.cuda_graph=true
    grc=$?
    g_rate=$(field "$glog" 's/^throughput: \([0-9.][0-9.]*\) .*/\1/p')
    [ $grc -ne 0 ] && { FAILED=1; echo "   dtrain graph FAILED (rc=$grc): $(tail -1 "$glog")"; }
    CMDS+=("$name: $DTRAIN bench $recipe $dargs --set train.cuda_graph=true")
  fi
  # the twin runs the batch dtrain ran (and the peak dtrain's MFU used)
  [ -n "$d_batch" ] && targs="$targs --batch $d_batch"
  peak=${peak:-${PEAK_TFLOPS:-}}
  [ -n "$peak" ] && targs="$targs --peak-tflops $peak"
  CMDS+=("$name: $DTRAIN bench $recipe $dargs")

  declare -A t_rate=() t_mfu=() t_params=() t_rc=()
  modes=(eager)
  [ "${NO_COMPILE:-0}" = 1 ] || modes+=(compile)
  [ $SMOKE = 1 ] && modes=(eager)
  for mode in "${modes[@]}"; do
    extra=""
    [ "$mode" = compile ] && extra="--compile"
    echo "== $name: PyTorch $mode"
    tlog=$LOGDIR/$name-torch-$mode.log
    # shellcheck disable=SC2086
    run "$tlog" "$PY" $twin $targs $extra
    t_rc[$mode]=$?
    [ "${t_rc[$mode]}" -ne 0 ] && { FAILED=1; echo "   PyTorch $mode FAILED (rc=${t_rc[$mode]}): $(tail -1 "$tlog")"; }
    t_params[$mode]=$(field "$tlog" 's/^params: \([0-9][0-9]*\).*/\1/p')
    t_rate[$mode]=$(field "$tlog" 's/^torch: \([0-9.][0-9.]*\) .*/\1/p')
    t_mfu[$mode]=$(field "$tlog" 's/^torch: .*| mfu \([0-9.]*%\) of .*/\1/p')
    CMDS+=("$name: $PY $twin $targs${extra:+ $extra}")
  done
  tp=${t_params[eager]:-}
  if [ -z "$d_params" ] || [ -z "$tp" ]; then
    pcheck="not compared (dtrain ${d_params:-?} / torch ${tp:-?})"
  elif [ "$d_params" = "$tp" ]; then
    pcheck="$d_params (equal)"
  else
    pcheck="MISMATCH dtrain $d_params / torch $tp"
    FAILED=1
  fi
  [ -z "$d_unit" ] && d_unit=$(field "$LOGDIR/$name-torch-eager.log" 's/^torch: [0-9.]* \([a-z]*\)\/s.*/\1/p')
  if [ $SMOKE = 1 ]; then
    st="ran"
    [ $drc -ne 0 ] && st="dtrain FAIL"
    [ "${t_rc[eager]}" -ne 0 ] && st="$st, torch FAIL"
    ROWS+=("| $name | $pcheck | $st |")
    continue
  fi
  cell() {  # cell RC VALUE
    if [ "$1" -ne 0 ]; then echo "FAIL"; elif [ -n "$2" ]; then echo "$2"; else echo "-"; fi
  }
  dcell=$(cell $drc "$d_rate")
  gcell="skipped"
  [ $grc -ge 0 ] && gcell=$(cell $grc "$g_rate")
  # the ratios use dtrain's faster run (eager or graph)
  best=$(awk -v a="${d_rate:-0}" -v b="${g_rate:-0}" 'BEGIN { print (b > a ? b : a) }')
  ecell=$(cell "${t_rc[eager]}" "${t_rate[eager]:-}")
  ccell="skipped"
  cmfu="-"
  cratio="-"
  if [ -n "${t_rc[compile]+x}" ]; then
    ccell=$(cell "${t_rc[compile]}" "${t_rate[compile]:-}")
    cmfu=${t_mfu[compile]:--}
    cratio=$(ratio "$best" "${t_rate[compile]:-0}")
  fi
  ROWS+=("| $name | $(recipe_of "$name") | ${d_unit:-?}/s | $pcheck | $dcell | $gcell | $ecell | $(ratio "$best" "${t_rate[eager]:-0}") | $ccell | $cratio | ${d_mfu:--} / ${t_mfu[eager]:--} / $cmfu | ${d_split:--} |")
done

# ---------- the table ----------
{
  # DTRAIN_COMMIT: the commit the binary was built from (a prebuilt pack records it; this
  # checkout's git may be elsewhere)
  if [ -n "${DTRAIN_COMMIT:-}" ]; then
    commit="$DTRAIN_COMMIT (built from)"
  else
    commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
    [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] && commit="$commit+local changes"
  fi
  echo
  if [ $SMOKE = 1 ]; then
    echo "CPU smoke run (tiny sizes, fp32, one step): NOT a benchmark, no throughput shown."
    echo "$(date -u +%Y-%m-%d) | commit $commit | $("$PY" -c 'import torch; print("PyTorch", torch.__version__)' 2>/dev/null)"
    echo
    echo "| bench | parameters dtrain = PyTorch | result |"
    echo "|---|---|---|"
  else
    echo "$(date -u +%Y-%m-%d) | $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1) | commit $commit | $("$PY" -c 'import torch; print("PyTorch", torch.__version__, "CUDA", torch.version.cuda)' 2>/dev/null) | warm-up $WARMUP, timed steps $STEPS"
    echo
    echo "(ratios: dtrain's faster run, eager or CUDA graph, to PyTorch; MFU and step split: dtrain's eager run)"
    echo
    echo "| bench | recipe | unit | parameters dtrain = PyTorch | dtrain | dtrain graph | PyTorch eager | ratio | torch.compile | ratio | MFU dtrain / eager / compile | dtrain step split |"
    echo "|---|---|---|---|---|---|---|---|---|---|---|---|"
  fi
  printf '%s\n' "${ROWS[@]}"
  echo
  echo "commands:"
  printf '  %s\n' "${CMDS[@]}"
  echo "logs: $LOGDIR"
} | tee "$LOGDIR/table.md"
exit $FAILED
