"""The post-training losses' head, each token's log-probability: megacompile (chunked, the logits made
again in the backward) vs torch eager (full logits, their fp32 copy) vs torch.compile, fwd+bwd
TFLOPS counted as eager's work (6*N*H*V; the kernel's recomputation is not counted) and peak memory.

    python benchmarks/kernels/bench_linear_logprobs.py [--smoke]
"""
import sys

import torch
from _common import Point, compiled, kernel_module, lm_head_inputs, main

kernel, ref = kernel_module("linear_logprobs"), kernel_module("reference")


def points(smoke: bool) -> list[Point]:
    # (tokens, hidden, vocab): a DPO batch of Qwen2-7B (2 pairs x 2048) and of Llama-3-8B (4 pairs x 2048)
    shapes = [(67, 33, 257)] if smoke else [(8192, 3584, 152064), (16384, 4096, 128256)]
    out = []
    for n, hidden, vocab in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            def make(n=n, hidden=hidden, vocab=vocab, dtype=dtype):
                return lm_head_inputs(n, hidden, vocab, dtype)
            impls = {"megacompile": kernel.linear_logprobs, "eager": ref.linear_logprobs_ref,
                     "compile": compiled(ref.linear_logprobs_ref)}
            out.append(Point("linear_logprobs", f"{n}x{hidden}x{vocab}", dtype, make, impls,
                             flops_fwd_bwd=6.0 * n * hidden * vocab))
    return out


if __name__ == "__main__":
    sys.exit(main("linear_logprobs", points))
