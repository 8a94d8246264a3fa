#!/bin/sh
# Emulates the flash attention kernels on the CPU (see emu.cpp). Usage: scripts/flash_emu/run.sh
# [QUICK=1 for three shapes]. Needs g++ (C++20) and the CUDA headers (cuda_bf16.h, cuda_fp16.h).
set -eu
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${TMPDIR:-/tmp}/dtrain_flash_emu
mkdir -p "$out"
python3 "$root/scripts/flash_emu/gen.py" "$root/src/backend/cuda/flash_attn.cu" "$out/kernels.inc"
cp "$root/scripts/flash_emu/wrappers.inc" "$out/"
g++ -std=c++20 -O1 -pthread -I"$out" -I"$root/src" -isystem "${CUDA_HOME:-/usr/local/cuda}/include" \
  "$root/scripts/flash_emu/emu.cpp" "$root/src/core/dtype.cpp" -o "$out/emu"
exec "$out/emu"
