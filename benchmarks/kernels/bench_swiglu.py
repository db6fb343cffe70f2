"""SwiGLU silu(a) * b: megacompile vs torch eager (the shared reference) vs torch.compile, GB/s.

    python benchmarks/kernels/bench_swiglu.py [--smoke]
"""
import sys

import torch
from _common import Point, compiled, device, kernel_module, main

kernel, ref = kernel_module("swiglu"), kernel_module("reference")


def points(smoke: bool) -> list[Point]:
    shapes = [(37, 129)] if smoke else [(4096, 11008), (16384, 14336), (4096, 28672)]
    out = []
    for m, n in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            def make(m=m, n=n, dtype=dtype):
                return tuple(torch.randn(m, n, device=device(), dtype=dtype, requires_grad=True) for _ in range(2))
            b = dtype.itemsize * m * n
            impls = {"megacompile": kernel.swiglu, "eager": ref.swiglu_ref, "compile": compiled(ref.swiglu_ref)}
            # fwd: read a, b, write c; bwd: read dc, a, b, write da, db
            out.append(Point("swiglu", f"{m}x{n}", dtype, make, impls, bytes_fwd=3 * b, bytes_fwd_bwd=8 * b))
    return out


if __name__ == "__main__":
    sys.exit(main("swiglu", points))
