"""Scaled, causally masked softmax of attention scores: megacompile vs torch eager (the shared
reference) vs torch.compile, GB/s (nominal bytes: the full square, though a causal kernel reads half).

    python benchmarks/kernels/bench_softmax.py [--smoke]
"""
import sys

import torch
from _common import Point, compiled, device, kernel_module, main

kernel, ref = kernel_module("softmax"), kernel_module("reference")


def points(smoke: bool) -> list[Point]:
    shapes = [(1, 2, 37, 37)] if smoke else [(4, 32, 1024, 1024), (1, 32, 4096, 4096)]
    out = []
    for shape in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            for causal in (False, True):
                def make(shape=shape, dtype=dtype):
                    return (torch.randn(shape, device=device(), dtype=dtype, requires_grad=True),)
                scale = 0.125
                reference = lambda x, c=causal: ref.softmax_ref(x, scale, c)  # noqa: E731
                impls = {"megacompile": lambda x, c=causal: kernel.softmax(x, scale, c), "eager": reference,
                         "compile": compiled(reference)}
                b = dtype.itemsize * torch.Size(shape).numel()
                out.append(Point("softmax_causal" if causal else "softmax", "x".join(map(str, shape)), dtype, make,
                                 impls, bytes_fwd=2 * b, bytes_fwd_bwd=5 * b))
    return out


if __name__ == "__main__":
    sys.exit(main("softmax", points))
