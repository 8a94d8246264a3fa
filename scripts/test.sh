#!/usr/bin/env bash
# The test suite: installs dependencies, builds, and runs every test with ctest, then the
# sanitizer build's tests (scripts/sanitize.sh, build-asan/).
# A test that cannot run here (no CUDA device, a tool or data set not installed) is reported
# as skipped: ctest lists it under "The following tests did not run", and a line after
# ctest's summary counts passed, skipped and failed tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --tests
bash scripts/build.sh
log=$(mktemp)
rc=0
(cd build && ctest --output-on-failure -j"$(nproc)" "$@") | tee "$log" || rc=$?
total=$(sed -nE 's/.* tests? failed out of ([0-9]+).*/\1/p' "$log" | tail -1)
failed=$(sed -nE 's/.* ([0-9]+) tests? failed out of .*/\1/p' "$log" | tail -1)
skipped=$(grep -cE '^[[:space:]]+[0-9]+ - .* \(Skipped\)$' "$log" || true)
total=${total:-0} failed=${failed:-0}
echo "tests: $((total - failed - skipped)) passed, $skipped skipped, $failed failed (of $total)"
rm -f "$log"
[ "$rc" = 0 ] || exit "$rc"
# The decoders of untrusted images (and the data paths around them) under ASan + UBSan.
bash scripts/sanitize.sh
