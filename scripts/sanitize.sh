#!/usr/bin/env bash
# AddressSanitizer + UndefinedBehaviorSanitizer build of dtrain (build-asan/: CPU only,
# RelWithDebInfo) running the tests of image decoding and of the data paths that decode
# untrusted bytes (libjpeg-turbo, libpng, stb_image's BMP, tar shards, manifests): the seeded
# fuzz corpus of tests/data/test_image_fuzz.cpp included. Any sanitizer report fails the run.
# System libraries (libjpeg, libpng, zlib, oneDNN, OpenBLAS, Gloo) are not instrumented; our
# code around them is. Extra arguments go to dtrain_tests (e.g. -s).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build-asan}
export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=true
SAN="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
# RelWithDebInfo at -O1 -g1 (line tables for the reports): quicker to build than -O2 -g.
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDTRAIN_CUDA=OFF \
  -DCMAKE_CXX_FLAGS="$SAN" -DCMAKE_C_FLAGS="$SAN" \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined" \
  >"$BUILD_DIR.cmake.log" 2>&1 || { cat "$BUILD_DIR.cmake.log"; exit 1; }
cmake --build "$BUILD_DIR" -j"$(nproc)" --target dtrain dtrain_tests
# Child processes (the tests run the dtrain binary) inherit these.
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:exitcode=1:strict_string_checks=1:detect_stack_use_after_return=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
cd "$BUILD_DIR"
TESTS="image decode*,image fuzz*,images converter*,loader errors*,loader eval order*,tar *"
TESTS+=",data index: bad shards*,data segmentation*,image_size*,SegLoader*"
./dtrain_tests -tc="$TESTS" "$@"
