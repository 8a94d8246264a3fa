#!/usr/bin/env bash
# GPU check: one command on the GPU machine, run from the repo root.
#   scripts/gpu_check.sh                 detect GPU + libraries, build build-gpu, run
#                                        `dtrain info`, the gpu test suite, benchmarks
#   scripts/gpu_check.sh --pack FILE     (on a build machine) pack build-gpu's dtrain and
#                                        dtrain_tests with their non-system shared libraries
#                                        into FILE (.tar.xz), for a GPU machine that cannot build
#   DTRAIN_GPU_PACK=FILE scripts/gpu_check.sh
#                                        use that pack when configuring/building here fails
#   GPU_CHECK_BENCH="gpt2 unet" scripts/gpu_check.sh
#                                        benchmark these recipes only ("none": no benchmarks;
#                                        default gpt2 llama resnet50 unet, see scripts/bench/compare_gpu.sh;
#                                        llama: the Llama-3.2-1B-like configs/bench/llama3_1b.toml
#                                        against scripts/bench/llama_torch.py)
#   GPU_CHECK_PROFILE="gpt2 unet"        also trace every kernel of a few steps of dtrain and of
#                                        PyTorch eager (scripts/prof/ktrace.cpp) into per-kernel tables
#   DTRAIN_FMNIST_SRC=DIR                the Fashion-MNIST *-ubyte.gz files (default Debian's
#                                        /usr/share/datasets/fashion-mnist), for the gpu tests
#                                        and the default recipe
#   GPU_CHECK_FMNIST_PRECISIONS="bf16"   train the default recipe in these precisions only
#                                        (default "fp32 bf16"; needs the Fashion-MNIST files)
#   GPU_CHECK_FMNIST_GRAPH="bf16"        of those, train these again with train.cuda_graph = true
#                                        (default "bf16"; " " skips): evals between steps make
#                                        the graphs capture again, accuracy must match
# Every step logs and the script continues; the exit code is non-zero if any step failed.
# With $OUT set, a summary is written to $OUT/summary.txt and logs to $OUT/gpu_check/.
set -u
ROOT=$(pwd)
BUILD=${DTRAIN_GPU_BUILD:-build-gpu}
LOGDIR=${OUT:+$OUT/gpu_check}
LOGDIR=${LOGDIR:-$BUILD/gpu_check_logs}
mkdir -p "$LOGDIR"
SUMMARY=()
FAILED=0

note() { echo "[gpu_check] $*"; }
record() {  # record NAME STATUS DETAIL
  SUMMARY+=("$(printf '%-28s %-5s %s' "$1" "$2" "$3")")
  [ "$2" = FAIL ] && FAILED=1
  note "$1: $2 $3"
}
run_step() {  # run_step NAME CMD... (output tee'd to $LOGDIR/NAME.log)
  local name=$1; shift
  note "== $name: $*"
  local t0=$SECONDS
  "$@" 2>&1 | tee "$LOGDIR/$name.log"
  local rc=${PIPESTATUS[0]}
  local bad=FAIL
  [ "${SOFT:-0}" = 1 ] && bad=WARN  # a failure with a fallback still to try
  if [ $rc -eq 0 ]; then record "$name" OK "($((SECONDS - t0)) s)"; else record "$name" $bad "rc=$rc, log $LOGDIR/$name.log"; fi
  return $rc
}

# ---------- pack mode ----------
if [ "${1:-}" = "--pack" ]; then
  out=${2:?usage: scripts/gpu_check.sh --pack FILE.tar.xz}
  src=${DTRAIN_PACK_FROM:-$BUILD}
  tmp=$(mktemp -d)
  mkdir -p "$tmp/lib"
  for bin in dtrain dtrain_tests; do
    [ -x "$src/$bin" ] || { echo "missing $src/$bin (build first)"; exit 1; }
    cp "$src/$bin" "$tmp/"
    # every resolved library except glibc/libstdc++/libgcc and the CUDA libraries, which the
    # GPU machine provides (toolkit or the Python wheels)
    ldd "$src/$bin" | awk '$3 ~ /^\// {print $3}' | while read -r lib; do
      case $(basename "$lib") in
        libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|libstdc++*|libgcc_s*|ld-linux*) ;;
        libcud*|libcublas*|libnccl*|libnvrtc*|libnvJitLink*) ;;
        *) cp -Ln "$lib" "$tmp/lib/" ;;
      esac
    done
  done
  # the commit it was built from (the GPU machine's copy of the tree may not say)
  c=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] && c="$c+local changes"
  echo "$c" >"$tmp/COMMIT"
  # the kernel tracer (scripts/prof/ktrace.cpp) and the CUPTI it was linked with
  if [ -f "$src/libdtrain_ktrace.so" ]; then
    cp "$src/libdtrain_ktrace.so" "$tmp/lib/"
    ldd "$src/libdtrain_ktrace.so" | awk '$1 ~ /^libcupti/ && $3 ~ /^\// {print $3}' | xargs -r -I{} cp -Ln {} "$tmp/lib/"
  fi
  tar -C "$tmp" -cJf "$out" . && rm -rf "$tmp" && ls -la "$out"
  exit $?
fi

# ---------- 1. the GPU ----------
if command -v nvidia-smi >/dev/null 2>&1; then
  run_step nvidia-smi nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv
else
  record nvidia-smi FAIL "nvidia-smi not found (no NVIDIA driver?)"
fi

# ---------- 2. libraries: toolkit, then Python wheels (nvidia/*/lib) ----------
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
LIBPATH="$CUDA_HOME/lib64"
INCPATH="$CUDA_HOME/include"
PY=$(command -v python3 || true)
NVDIR=""
if [ -n "$PY" ]; then
  NVDIR=$("$PY" -c 'import nvidia, os; print(list(nvidia.__path__)[0])' 2>/dev/null || true)
fi
if [ -n "$NVDIR" ] && [ -d "$NVDIR" ]; then
  for d in "$NVDIR"/*/lib "$NVDIR"/*/*/lib; do [ -d "$d" ] && LIBPATH="$LIBPATH:$d"; done
  for d in "$NVDIR"/*/include "$NVDIR"/*/*/include; do [ -d "$d" ] && INCPATH="$INCPATH:$d"; done
  note "python nvidia packages: $NVDIR"
fi
export LD_LIBRARY_PATH="$LIBPATH${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export CPATH="$INCPATH${CPATH:+:$CPATH}"
find_lib() {  # find_lib NAME -> first path of libNAME.so or libNAME.so.* on LIBPATH
  local IFS=:
  for d in $LIBPATH; do
    for f in "$d/lib$1.so" "$d"/lib"$1".so.[0-9]*; do [ -e "$f" ] && { echo "$f"; return 0; }; done
  done
  return 1
}
CMAKE_LIB_ARGS=()
for lib in cudnn nccl cublasLt; do
  if p=$(find_lib $lib); then
    record "lib$lib" OK "$p"
    [ $lib = cudnn ] && CMAKE_LIB_ARGS+=("-DCUDNN_LIB=$p")
    [ $lib = nccl ] && CMAKE_LIB_ARGS+=("-DNCCL_LIB=$p")
  else
    record "lib$lib" FAIL "not found on $LIBPATH"
  fi
done

# ---------- 3. build ----------
BIN_DIR=""
if command -v cmake >/dev/null 2>&1; then
  note "cmake: $(cmake --version | head -1) at $(command -v cmake)"
  NVCC="$CUDA_HOME/bin/nvcc"
  soft=0
  [ -n "${DTRAIN_GPU_PACK:-}" ] && soft=1
  if SOFT=$soft run_step configure cmake -S "$ROOT" -B "$BUILD" -DDTRAIN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
       -DCMAKE_CUDA_COMPILER="$NVCC" "${CMAKE_LIB_ARGS[@]}"; then
    if SOFT=$soft run_step build cmake --build "$BUILD" -j "$(nproc)"; then BIN_DIR="$BUILD"; fi
  fi
else
  record configure FAIL "cmake not found on PATH"
fi
if [ -z "$BIN_DIR" ] && [ -n "${DTRAIN_GPU_PACK:-}" ]; then
  mkdir -p "$BUILD/prebuilt"
  if run_step unpack tar -C "$BUILD/prebuilt" -xJf "$DTRAIN_GPU_PACK"; then
    BIN_DIR="$BUILD/prebuilt"
    export LD_LIBRARY_PATH="$ROOT/$BUILD/prebuilt/lib:$LD_LIBRARY_PATH"
    [ -f "$BIN_DIR/COMMIT" ] && export DTRAIN_COMMIT=$(cat "$BIN_DIR/COMMIT") && note "pack built from commit $DTRAIN_COMMIT"
  fi
fi

# ---------- 4. run ----------
if [ -n "$BIN_DIR" ]; then
  ldd "$BIN_DIR/dtrain_tests" | grep "not found" && record ldd FAIL "unresolved libraries (see above)"
  run_step dtrain-info "$BIN_DIR/dtrain" info
  export DTRAIN_TEST_BIN="$ROOT/$BIN_DIR/dtrain"
  [ -n "${DTRAIN_FMNIST_SRC:-}" ] && export DTRAIN_FMNIST_SRC=$(realpath "$DTRAIN_FMNIST_SRC")  # the tests run this dtrain, not the path they were built with
  if ! run_step gpu-tests "$BIN_DIR/dtrain_tests" -ts=gpu; then
    # tell a wrong fusion from a wrong op: the same tests with every fused path of
    # backend/unfused.h switched back to its separate passes; when that passes, the
    # benchmarks and trainings below run unfused too (and say so), so their numbers are valid
    SOFT=1 run_step gpu-tests-unfused env DTRAIN_CUDA_UNFUSED=all "$BIN_DIR/dtrain_tests" -ts=gpu &&
      export DTRAIN_CUDA_UNFUSED=all && record unfused-from-here WARN "DTRAIN_CUDA_UNFUSED=all for what follows"
  fi
  grep -E "test cases:|assertions:" "$LOGDIR/gpu-tests.log" | sed 's/^/    /'
  # the ordering contract on hardware (also in the gpu tests above; its own line in the
  # summary): a one-rank NCCL all-gather must see a fill queued behind a long chain of GEMMs
  run_step nccl-order "$BIN_DIR/dtrain_tests" -tc="gpu: a one-rank NCCL all-gather holds the fill queued behind a long kernel"
  # benchmarks: each bench recipe with dtrain, its PyTorch twin eager and under torch.compile,
  # side by side, one table (scripts/bench/compare_gpu.sh; GPU_CHECK_BENCH picks the recipes:
  # names as compare_gpu.sh takes them, "none" skips)
  BENCH_SET=${GPU_CHECK_BENCH:-gpt2 llama resnet50 unet}
  # GPU_CHECK_PROFILE="gpt2 unet": per-kernel tables (ktrace) of dtrain and PyTorch eager, a few
  # steps each, in $LOGDIR/profile/*.ktrace (a separate run: tracing perturbs the rates a little)
  KT=""
  for k in "$BIN_DIR/lib/libdtrain_ktrace.so" "$BIN_DIR/libdtrain_ktrace.so"; do [ -f "$k" ] && { KT=$(realpath "$k"); break; }; done
  if [ -n "${GPU_CHECK_PROFILE:-}" ] && [ -n "$KT" ] && [ -n "$PY" ]; then
    # shellcheck disable=SC2086
    SOFT=1 run_step profile env DTRAIN="$BIN_DIR/dtrain" PYTHON="$PY" LOGDIR="$LOGDIR/profile" KTRACE="$KT" \
      NO_COMPILE=1 WARMUP=${PROFILE_WARMUP:-5} STEPS=${PROFILE_STEPS:-3} scripts/bench/compare_gpu.sh $GPU_CHECK_PROFILE
  fi
  if [ "$BENCH_SET" != none ] && [ -n "$PY" ]; then
    # shellcheck disable=SC2086
    run_step bench-compare env DTRAIN="$BIN_DIR/dtrain" PYTHON="$PY" LOGDIR="$LOGDIR/compare_gpu" \
      scripts/bench/compare_gpu.sh $BENCH_SET
  fi
  # the default recipe trained on the GPU, when the Fashion-MNIST IDX files are at hand
  FM_SRC=${DTRAIN_FMNIST_SRC:-/usr/share/datasets/fashion-mnist}
  if [ -f "$FM_SRC/train-images-idx3-ubyte.gz" ]; then
    run_step fmnist-data "$BIN_DIR/dtrain" data fashion-mnist --src "$FM_SRC" --out "$BUILD/fmnist"
    # once per precision (GPU_CHECK_FMNIST_PRECISIONS, default "fp32 bf16"): accuracy and speed
    for prec in ${GPU_CHECK_FMNIST_PRECISIONS:-fp32 bf16}; do
      rm -rf "$BUILD/runs/gpu_fmnist_$prec"
      run_step "fmnist-train-$prec" timeout 400 "$BIN_DIR/dtrain" train configs/resnet20_fmnist.toml --device cuda \
        --set data.path=\""$BUILD/fmnist"\" --set run.out_dir=\""$BUILD/runs"\" --set run.name="gpu_fmnist_$prec" \
        --set log.every_steps=500 --set data.workers=8 --set precision.dtype="$prec"
      grep -E "^(done|eval)" "$LOGDIR/fmnist-train-$prec.log" | sed 's/^/    /'
      case " ${GPU_CHECK_FMNIST_GRAPH-bf16} " in
        *" $prec "*)
          rm -rf "$BUILD/runs/gpu_fmnist_${prec}_graph"
          run_step "fmnist-train-$prec-graph" timeout 400 "$BIN_DIR/dtrain" train configs/resnet20_fmnist.toml \
            --device cuda --set data.path=\""$BUILD/fmnist"\" --set run.out_dir=\""$BUILD/runs"\" \
            --set run.name="gpu_fmnist_${prec}_graph" --set log.every_steps=500 --set data.workers=8 \
            --set precision.dtype="$prec" --set train.cuda_graph=true
          grep -E "^(done|eval)" "$LOGDIR/fmnist-train-$prec-graph.log" | sed 's/^/    /'
          ;;
      esac
    done
  fi
else
  record run FAIL "no binaries (build failed and no DTRAIN_GPU_PACK)"
fi

# ---------- summary ----------
{
  echo "dtrain gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
  nvidia-smi -L 2>/dev/null || true
  printf '%s\n' "${SUMMARY[@]}"
  [ -f "$LOGDIR/gpu-tests.log" ] && grep -E "test cases:|assertions:|SKIPPED:" "$LOGDIR/gpu-tests.log" | sort -u
  echo "result: $([ $FAILED = 0 ] && echo PASS || echo FAIL)"
} > "$LOGDIR/summary.txt"
[ -n "${OUT:-}" ] && cp "$LOGDIR/summary.txt" "$OUT/summary.txt"
cat "$LOGDIR/summary.txt"
exit $FAILED
