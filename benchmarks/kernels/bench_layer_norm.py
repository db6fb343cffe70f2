"""LayerNorm: megacompile vs torch eager (the shared reference) vs torch.compile, fwd and fwd+bwd, GB/s.

    python benchmarks/kernels/bench_layer_norm.py [--smoke]
"""
import sys

import torch
from _common import Point, compiled, device, kernel_module, main

kernel, ref = kernel_module("layer_norm"), kernel_module("reference")


def points(smoke: bool) -> list[Point]:
    shapes = [(37, 129)] if smoke else [(4096, 4096), (16384, 4096), (8192, 8192), (4096, 16384)]
    out = []
    for m, n in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            def make(m=m, n=n, dtype=dtype):
                x = torch.randn(m, n, device=device(), dtype=dtype, requires_grad=True)
                w = (1 + 0.1 * torch.randn(n, device=device())).to(dtype).requires_grad_()
                b = (0.1 * torch.randn(n, device=device())).to(dtype).requires_grad_()
                return x, w, b
            b = dtype.itemsize
            impls = {"megacompile": kernel.layer_norm, "eager": ref.layer_norm_ref,
                     "compile": compiled(ref.layer_norm_ref)}
            out.append(Point("layer_norm", f"{m}x{n}", dtype, make, impls,
                             bytes_fwd=2 * m * n * b, bytes_fwd_bwd=5 * m * n * b))
    return out


if __name__ == "__main__":
    sys.exit(main("layer_norm", points))
