"""GELU (erf and tanh) plain and gated: megacompile vs torch eager (the shared reference) vs
torch.compile, GB/s.

    python benchmarks/kernels/bench_gelu.py [--smoke]
"""
import sys

import torch
from _common import Point, compiled, device, kernel_module, main

kernel, ref = kernel_module("gelu"), kernel_module("reference")


def points(smoke: bool) -> list[Point]:
    shapes = [(37, 129)] if smoke else [(4096, 12288), (16384, 16384)]
    out = []
    for m, n in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            for approximate in ("none", "tanh"):
                b = dtype.itemsize * m * n

                def make_plain(m=m, n=n, dtype=dtype):
                    return (torch.randn(m, n, device=device(), dtype=dtype, requires_grad=True),)

                def make_gated(m=m, n=n, dtype=dtype):
                    return tuple(torch.randn(m, n, device=device(), dtype=dtype, requires_grad=True) for _ in range(2))

                plain_ref = lambda a, ap=approximate: ref.gelu_ref(a, None, ap)  # noqa: E731
                gated_ref = lambda a, g, ap=approximate: ref.gelu_ref(a, g, ap)  # noqa: E731
                out.append(Point(f"gelu_{approximate}", f"{m}x{n}", dtype, make_plain, {
                    "megacompile": lambda a, ap=approximate: kernel.gelu(a, ap),
                    "eager": plain_ref, "compile": compiled(plain_ref),
                }, bytes_fwd=2 * b, bytes_fwd_bwd=5 * b))
                out.append(Point(f"geglu_{approximate}", f"{m}x{n}", dtype, make_gated, {
                    "megacompile": lambda a, g, ap=approximate: kernel.geglu(a, g, ap),
                    "eager": gated_ref, "compile": compiled(gated_ref),
                }, bytes_fwd=3 * b, bytes_fwd_bwd=8 * b))
    return out


if __name__ == "__main__":
    sys.exit(main("gelu", points))
