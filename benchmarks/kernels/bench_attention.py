"""Causal attention, forward and backward: megacompile's kernel vs torch's scaled_dot_product_attention
(its flash kernel on a GPU) vs eager attention (the shared reference: scores, softmax, values in fp32)
vs torch.compile of that reference, TFLOPS of fwd+bwd as torch counts the flash ops (causal: half) and
the backward's peak memory beside its inputs.

    python benchmarks/kernels/bench_attention.py [--smoke]

Llama-2-7B's heads (32 x 128) and Llama-3-8B's grouped ones (32 query heads over 8) at 4 x 4096 tokens;
a Mistral-7B sliding-window layer (window 4096) at 1 x 16384, where torch's SDPA takes transformers'
[B, 1, S, S] boolean mask (its memory-efficient kernel) and the kernel the window as a number; and
16 documents of 1024 tokens packed in a row of 16384, the mask block-diagonal and the kernel given
each token's document start. Their TFLOPS count the (query, key) pairs the window or documents keep.
Then the layers torch's flash kernels do not take: a GPT-OSS-120B sliding-window layer (64 query
heads over 8, head dim 64, window 128, attention sinks) at 1 x 8192, against transformers' eager
attention (scores, mask, sinks, softmax) and torch.compile of it; and a DeepSeek-V3 latent-attention
layer (128 heads, q and k 192, v 128) at 1 x 4096, against SDPA (its math or memory-efficient path).
"""
import sys

import torch
import torch.nn.functional as F
from _common import Point, compiled, device, kernel_module, main

kernel, ref = kernel_module("attention"), kernel_module("reference")


def _maker(batch: int, seq: int, shapes, dtype: torch.dtype):
    """A make() of q, k, v as HF lays them out ([B, S, H, D] projections viewed [B, H, S, D]), of
    `shapes` (heads, head dim) each."""
    def make():
        return tuple(torch.randn(batch, seq, h, d, device=device(), dtype=dtype).transpose(1, 2).requires_grad_()
                     for h, d in shapes)
    return make


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def points(smoke: bool) -> list[Point]:
    shapes = [(1, 4, 2, 37, 16)] if smoke else [(4, 32, 32, 4096, 128), (4, 32, 8, 4096, 128)]
    out = []
    for batch, hq, hkv, seq, dim in shapes:
        for dtype in (torch.bfloat16,) if not smoke else (torch.float32, torch.bfloat16):
            make = _maker(batch, seq, ((hq, dim), (hkv, dim), (hkv, dim)), dtype)
            reference = lambda q, k, v: ref.attention_ref(q, k, v, True)  # noqa: E731
            impls = {"megacompile": lambda q, k, v: kernel.attention(q, k, v, True), "sdpa": _sdpa,
                     "eager": reference, "compile": compiled(reference)}
            out.append(Point("attention_causal", f"{batch}x{hq}/{hkv}x{seq}x{dim}", dtype, make, impls,
                             flops_fwd_bwd=14.0 * batch * hq * seq * seq * dim * 0.5))
    out += _window_points(smoke)
    return out


def _window_points(smoke: bool) -> list[Point]:
    batch, hq, hkv, seq, dim, window = (1, 4, 2, 37, 16, 5) if smoke else (1, 32, 8, 16384, 128, 4096)
    mask = None

    def masked(q, k, v):
        nonlocal mask
        if mask is None or mask.device != q.device:      # transformers builds it once per step
            mask = ref.window_mask(seq, window, q.device).expand(batch, 1, seq, seq)
        groups = hq // hkv
        return F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                              attn_mask=mask)

    reference = lambda q, k, v: ref.attention_ref(q, k, v, True, window=window)  # noqa: E731
    pairs = seq * window - window * (window - 1) / 2
    out = []
    for dtype in (torch.bfloat16,) if not smoke else (torch.float32, torch.bfloat16):
        make = _maker(batch, seq, ((hq, dim), (hkv, dim), (hkv, dim)), dtype)
        impls = {"megacompile": lambda q, k, v: kernel.attention(q, k, v, True, window=window),
                 "sdpa (mask)": masked, "eager": reference, "compile": compiled(reference)}
        out.append(Point("attention_window", f"{batch}x{hq}/{hkv}x{seq}x{dim} w{window}", dtype, make, impls,
                         flops_fwd_bwd=14.0 * batch * hq * pairs * dim))
    return out + _document_points(smoke) + _sink_points(smoke) + _latent_points(smoke)


def _document_points(smoke: bool) -> list[Point]:
    """Documents packed in a row (TRL's and `packing: isolated`'s rows): 16 of 1024 tokens in 16384,
    against SDPA with the block-diagonal mask transformers builds from the position ids."""
    batch, hq, hkv, dim, lengths = (1, 4, 2, 16, [5, 1, 31]) if smoke else (1, 32, 8, 128, [1024] * 16)
    seq = sum(lengths)
    starts = ref.document_starts([lengths])

    def masked(q, k, v):
        keys = torch.arange(seq, device=q.device)
        mask = (keys[None, :] <= keys[:, None]) & (keys[None, :] >= starts.to(q.device)[0, :, None])
        groups = hq // hkv
        return F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                              attn_mask=mask)

    reference = lambda q, k, v: ref.attention_ref(q, k, v, True, starts=starts.to(q.device))  # noqa: E731
    pairs = sum(n * (n + 1) / 2 for n in lengths)
    out = []
    for dtype in (torch.bfloat16,) if not smoke else (torch.float32, torch.bfloat16):
        make = _maker(batch, seq, ((hq, dim), (hkv, dim), (hkv, dim)), dtype)
        impls = {"megacompile": lambda q, k, v: kernel.attention(q, k, v, True, starts=starts.to(q.device)),
                 "sdpa (mask)": masked, "eager": reference, "compile": compiled(reference)}
        out.append(Point("attention_documents", f"{batch}x{hq}/{hkv}x{seq}x{dim} {len(lengths)} docs", dtype, make,
                         impls, flops_fwd_bwd=14.0 * batch * hq * pairs * dim))
    return out


def _sink_points(smoke: bool) -> list[Point]:
    batch, hq, hkv, seq, dim, window = (1, 4, 2, 37, 16, 5) if smoke else (1, 64, 8, 8192, 64, 128)
    sinks = torch.randn(hq, device=device())
    reference = lambda q, k, v: ref.attention_ref(q, k, v, True, window=window, sinks=sinks)  # noqa: E731
    pairs = seq * window - window * (window - 1) / 2
    out = []
    for dtype in (torch.bfloat16,) if not smoke else (torch.float32, torch.bfloat16):
        make = _maker(batch, seq, ((hq, dim), (hkv, dim), (hkv, dim)), dtype)
        impls = {"megacompile": lambda q, k, v: kernel.attention(q, k, v, True, window=window, sinks=sinks),
                 "eager": reference, "compile": compiled(reference)}
        out.append(Point("attention_sinks", f"{batch}x{hq}/{hkv}x{seq}x{dim} w{window}", dtype, make, impls,
                         flops_fwd_bwd=14.0 * batch * hq * pairs * dim))
    return out


def _latent_points(smoke: bool) -> list[Point]:
    batch, heads, seq, dim, dim_v = (1, 4, 37, 24, 16) if smoke else (1, 128, 4096, 192, 128)
    reference = lambda q, k, v: ref.attention_ref(q, k, v, True)  # noqa: E731
    out = []
    for dtype in (torch.bfloat16,) if not smoke else (torch.float32, torch.bfloat16):
        make = _maker(batch, seq, ((heads, dim), (heads, dim), (heads, dim_v)), dtype)
        impls = {"megacompile": lambda q, k, v: kernel.attention(q, k, v, True), "sdpa": _sdpa,
                 "eager": reference, "compile": compiled(reference)}
        # the forward's two matmuls and the backward's five, each over its own head dim
        out.append(Point("attention_latent", f"{batch}x{heads}x{seq}x{dim}/{dim_v}", dtype, make, impls,
                         flops_fwd_bwd=2.0 * batch * heads * seq * seq * 0.5 * (4 * dim + 3 * dim_v)))
    return out


if __name__ == "__main__":
    sys.exit(main("attention", points))
