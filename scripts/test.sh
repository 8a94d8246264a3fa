#!/usr/bin/env bash
# The test suite: installs dependencies, builds, and runs every test with ctest.
# A test that cannot run here (no CUDA device, a tool or data set not installed) is reported
# as skipped: ctest lists it under "The following tests did not run", and the last line
# counts passed, skipped and failed tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --tests
bash scripts/build.sh
cd build
log=$(mktemp)
rc=0
ctest --output-on-failure -j"$(nproc)" "$@" | tee "$log" || rc=$?
total=$(sed -nE 's/.* tests? failed out of ([0-9]+).*/\1/p' "$log" | tail -1)
failed=$(sed -nE 's/.* ([0-9]+) tests? failed out of .*/\1/p' "$log" | tail -1)
skipped=$(grep -cE '^[[:space:]]+[0-9]+ - .* \(Skipped\)$' "$log" || true)
total=${total:-0} failed=${failed:-0}
echo "tests: $((total - failed - skipped)) passed, $skipped skipped, $failed failed (of $total)"
rm -f "$log"
exit "$rc"
