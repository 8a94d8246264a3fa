#!/usr/bin/env bash
# The test suite: installs dependencies, builds, and runs every test with ctest, then the
# sanitizer build's tests (scripts/sanitize.sh, build-asan/).
# GPU tests (label gpu) print a visible skip on a machine without a CUDA device.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --tests
bash scripts/build.sh
(cd build && ctest --output-on-failure -j"$(nproc)" "$@")
# The decoders of untrusted images (and the data paths around them) under ASan + UBSan.
bash scripts/sanitize.sh
