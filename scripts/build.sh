#!/usr/bin/env bash
# Configures and builds dtrain into build/ (Release). CUDA is compiled when nvcc exists
# (DTRAIN_CUDA=AUTO); set CUDA_ARCHS to override the architectures (default here: 90,
# the H100/H200; the CMake default when configuring by hand is "80;90"). BUILD_TARGET=dtrain
# builds the binary alone (the quick start), without the test program.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
# ccache shares objects between clones of the repository (CI builds a fresh clone)
export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=true
ARCHS=${CUDA_ARCHS:-90}
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DDTRAIN_CUDA="${DTRAIN_CUDA:-AUTO}" \
  -DCMAKE_CUDA_ARCHITECTURES="$ARCHS" -DDTRAIN_WERROR="${DTRAIN_WERROR:-ON}" >"$BUILD_DIR.cmake.log" 2>&1 || { cat "$BUILD_DIR.cmake.log"; exit 1; }
grep -E "dtrain: CUDA" "$BUILD_DIR.cmake.log" || true
cmake --build "$BUILD_DIR" -j"$(nproc)" ${BUILD_TARGET:+--target "$BUILD_TARGET"}
