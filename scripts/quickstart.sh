#!/usr/bin/env bash
# The default recipe end to end: dependencies, build, dataset preparation, training,
# and the final test accuracy. Pass extra `dtrain train` arguments after the script name,
# e.g. `--set run.name=again`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BUILD_TARGET=dtrain bash scripts/build.sh  # the binary only: the tests are scripts/test.sh's
[ -f data/fashion-mnist/manifest.json ] || ./build/dtrain data fashion-mnist --out data/fashion-mnist
./build/dtrain train configs/resnet20_fmnist.toml "$@"
