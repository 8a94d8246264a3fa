#!/usr/bin/env python3
"""Turns src/backend/cuda/flash_attn.cu into host C++ for emu.cpp: drops the includes (the PTX
wrappers of flash_ptx.cuh among them) and puts the emulated wrappers of wrappers.inc (the same
names in namespace flash_ptx) first, points the dynamic shared memory at the emulated block's
buffer and cuts the launchers (from the "launch helpers" banner on)."""
import sys

src, dst = sys.argv[1], sys.argv[2]
s = open(src).read()
s = "\n".join(l for l in s.split("\n") if not l.startswith("#include"))
s = '#include "wrappers.inc"\n' + s
decl = "extern __shared__ __align__(16) unsigned char smem[];"
assert s.count(decl) == 3, "expected 3 kernels with dynamic shared memory"
s = s.replace(decl, "unsigned char* smem = t_smem;")
c = s.index("// ---------------------------------------------------------------- launch helpers")
s = s[:c] + "}  // namespace\n}  // namespace dtrain::cuda_kernels\n"
open(dst, "w").write(s)
