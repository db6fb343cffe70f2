"""Causal attention, forward and backward: megacompile's kernel vs torch's scaled_dot_product_attention
(its flash kernel on a GPU) vs eager attention (the shared reference: scores, softmax, values in fp32)
vs torch.compile of that reference, TFLOPS of fwd+bwd as torch counts the flash ops (causal: half) and
the backward's peak memory beside its inputs.

    python benchmarks/kernels/bench_attention.py [--smoke]

Llama-2-7B's heads (32 x 128) and Llama-3-8B's grouped ones (32 query heads over 8) at 4 x 4096 tokens.
"""
import sys

import torch
import torch.nn.functional as F
from _common import Point, compiled, device, kernel_module, main

kernel, ref = kernel_module("attention"), kernel_module("reference")


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def points(smoke: bool) -> list[Point]:
    shapes = [(1, 4, 2, 37, 16)] if smoke else [(4, 32, 32, 4096, 128), (4, 32, 8, 4096, 128)]
    out = []
    for batch, hq, hkv, seq, dim in shapes:
        for dtype in (torch.bfloat16,) if not smoke else (torch.float32, torch.bfloat16):
            def make(batch=batch, hq=hq, hkv=hkv, seq=seq, dim=dim, dtype=dtype):
                return tuple(torch.randn(batch, seq, h, dim, device=device(), dtype=dtype).transpose(1, 2)
                             .requires_grad_() for h in (hq, hkv, hkv))
            reference = lambda q, k, v: ref.attention_ref(q, k, v, True)  # noqa: E731
            impls = {"megacompile": lambda q, k, v: kernel.attention(q, k, v, True), "sdpa": _sdpa,
                     "eager": reference, "compile": compiled(reference)}
            out.append(Point("attention_causal", f"{batch}x{hq}/{hkv}x{seq}x{dim}", dtype, make, impls,
                             flops_fwd_bwd=14.0 * batch * hq * seq * seq * dim * 0.5))
    return out


if __name__ == "__main__":
    sys.exit(main("attention", points))
