"""Fused lm-head + cross-entropy: megacompile vs torch eager (the shared reference: full logits) vs
torch.compile, fwd+bwd TFLOPS (6*N*H*V) and peak memory of the step.

    python benchmarks/kernels/bench_fused_linear_cross_entropy.py [--smoke]
"""
import sys

import torch
from _common import Point, compiled, kernel_module, lm_head_inputs, main

kernel, ref = kernel_module("fused_linear_cross_entropy"), kernel_module("reference")


def points(smoke: bool) -> list[Point]:
    # (tokens, hidden, vocab): Llama-3-8B and Qwen2-7B heads
    shapes = [(67, 33, 257)] if smoke else [(8192, 4096, 128256), (4096, 3584, 152064)]
    out = []
    for n, hidden, vocab in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            def make(n=n, hidden=hidden, vocab=vocab, dtype=dtype):
                return lm_head_inputs(n, hidden, vocab, dtype, ignore_every=10)
            impls = {"megacompile": kernel.fused_linear_cross_entropy, "eager": ref.fused_linear_cross_entropy_ref,
                     "compile": compiled(ref.fused_linear_cross_entropy_ref)}
            out.append(Point("fused_linear_ce", f"{n}x{hidden}x{vocab}", dtype, make, impls,
                             flops_fwd_bwd=6.0 * n * hidden * vocab))
    return out


if __name__ == "__main__":
    sys.exit(main("fused_linear_cross_entropy", points))
