#!/usr/bin/env bash
# The test suite: installs dependencies, builds, and runs every test with ctest.
# GPU tests (label gpu) print a visible skip on a machine without a CUDA device.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --tests
bash scripts/build.sh
cd build
ctest --output-on-failure -j"$(nproc)" "$@"
