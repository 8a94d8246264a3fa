#!/usr/bin/env python3
"""Turns src/backend/cuda/flash_attn.cu into host C++ for emu.cpp: drops the includes,
replaces the PTX wrappers (from "// ---- PTX wrappers" up to "// Two floats rounded") with
the emulated ones of wrappers.inc, points the dynamic shared memory at the emulated block's
buffer and cuts the launchers (from the "launch helpers" banner on)."""
import sys

src, dst = sys.argv[1], sys.argv[2]
s = open(src).read()
s = "\n".join(l for l in s.split("\n") if not l.startswith("#include"))
a, b = s.index("// ---- PTX wrappers (sm_80+) ----"), s.index("// Two floats rounded")
s = s[:a] + '#include "wrappers.inc"\n' + s[b:]
decl = "extern __shared__ __align__(16) unsigned char smem[];"
assert s.count(decl) == 3, "expected 3 kernels with dynamic shared memory"
s = s.replace(decl, "unsigned char* smem = t_smem;")
c = s.index("// ---------------------------------------------------------------- launch helpers")
s = s[:c] + "}  // namespace\n}  // namespace dtrain::cuda_kernels\n"
open(dst, "w").write(s)
