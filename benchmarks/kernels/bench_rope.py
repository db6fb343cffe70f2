"""Rotary embedding of q and k: megacompile vs torch eager (the shared reference, HF's
apply_rotary_pos_emb) vs torch.compile, GB/s.

    python benchmarks/kernels/bench_rope.py [--smoke]
"""
import sys

import torch
from _common import Point, compiled, device, kernel_module, main

kernel, ref = kernel_module("rope"), kernel_module("reference")


def points(smoke: bool) -> list[Point]:
    # (batch, q heads, kv heads, seq, head_dim): Llama-3-8B and -70B attention shapes
    shapes = [(2, 3, 2, 19, 24)] if smoke else [(4, 32, 8, 4096, 128), (1, 64, 8, 8192, 128)]
    out = []
    for batch, hq, hkv, seq, dim in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            def make(batch=batch, hq=hq, hkv=hkv, seq=seq, dim=dim, dtype=dtype):
                # [B, S, H, D] projections viewed as [B, H, S, D], as HF attention makes them
                q = torch.randn(batch, seq, hq, dim, device=device(), dtype=dtype).transpose(1, 2).requires_grad_()
                k = torch.randn(batch, seq, hkv, dim, device=device(), dtype=dtype).transpose(1, 2).requires_grad_()
                angles = torch.randn(batch, seq, dim // 2, device=device())
                emb = torch.cat((angles, angles), dim=-1)
                return q, k, emb.cos().to(dtype), emb.sin().to(dtype)
            b = dtype.itemsize * batch * seq * dim * (hq + hkv)
            impls = {"megacompile": kernel.rope, "eager": ref.rope_ref, "compile": compiled(ref.rope_ref)}
            out.append(Point("rope", f"{batch}x({hq}+{hkv})x{seq}x{dim}", dtype, make, impls,
                             bytes_fwd=2 * b, bytes_fwd_bwd=4 * b))
    return out


if __name__ == "__main__":
    sys.exit(main("rope", points))
