#pragma once
// GPU_OR_SKIP(): at the top of a `gpu` test case, prints a visible skip and returns when no
// CUDA device exists (a skip is reported as such, never as a pass of the checks).
#include <doctest/doctest.h>

#include "backend/backend.h"

#define GPU_OR_SKIP()                   \
  if (cuda_device_count() == 0) {       \
    MESSAGE("skipped: no CUDA device"); \
    return;                             \
  }
