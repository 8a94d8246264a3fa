#!/usr/bin/env bash
# The build a C++ user tries first: `cmake -S . -B DIR` with CMake's default CUDA
# architectures (a list, "80;90") must configure and compile the one source that embeds the
# architectures in a string (dtrain info prints them), and a plain core source (the first object
# of the build). Needs nvcc: prints SKIPPED without it.
set -euo pipefail
src=${1:?usage: default_archs.sh SOURCE_DIR WORK_DIR}
work=${2:?usage: default_archs.sh SOURCE_DIR WORK_DIR}
if ! command -v nvcc >/dev/null 2>&1 && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "SKIPPED: no CUDA compiler (nvcc): the default-architectures build needs one"
  exit 0
fi
rm -rf "$work"
cmake -S "$src" -B "$work" -DDTRAIN_CUDA=ON >"$work.log" 2>&1 || { cat "$work.log"; exit 1; }
grep -q "archs: 80;90" "$work.log" || { echo "expected CMake's default architectures 80;90:"; cat "$work.log"; exit 1; }
make -C "$work" src/core/dtype.cpp.o
make -C "$work" src/backend/cuda/describe.cpp.o
echo "built with CMake's default CUDA architectures 80;90"
