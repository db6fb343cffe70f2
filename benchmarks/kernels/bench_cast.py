"""fp32 -> bf16 rounding cast and bf16 -> fp32 gradient accumulation: megacompile vs torch, GB/s.

    python benchmarks/kernels/bench_cast.py [--smoke]
"""
import sys

import torch
from _common import Point, compiled, device, kernel_module, main

cast = kernel_module("cast")


def points(smoke: bool) -> list[Point]:
    sizes = [37 * 129] if smoke else [2**24, 2**28]
    out = []
    for n in sizes:
        def make_cast(n=n):
            return (torch.randn(n, device=device()),)

        def torch_cast(x):
            return x.to(torch.bfloat16)
        out.append(Point("cast_fp32_to_bf16", f"{n}", torch.float32, make_cast,
                         {"megacompile": cast.cast, "eager": torch_cast, "compile": compiled(torch_cast)},
                         bytes_fwd=6 * n, backward=False))

        def make_acc(n=n):
            return torch.randn(n, device=device()), torch.randn(n, device=device()).to(torch.bfloat16)

        def torch_acc(acc, g):
            return acc.add_(g.float())
        out.append(Point("accumulate_grad", f"{n}", torch.bfloat16, make_acc,
                         {"megacompile": cast.accumulate_, "eager": torch_acc, "compile": compiled(torch_acc)},
                         bytes_fwd=10 * n, backward=False))
    return out


if __name__ == "__main__":
    sys.exit(main("cast", points))
