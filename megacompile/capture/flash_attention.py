"""The attention op a capture for a fused plan records: torch's FlashAttention op, not cuDNN's.

torch's scaled_dot_product_attention chooses its op when it is traced (fake CUDA tensors ask the
device), and the step runs the op the capture recorded. torch 2.10 and later put cuDNN's op first
on sm90 and sm100 where the cuDNN it loads is past 9.15 (torch 2.11's CUDA 13 wheels): an H100 or
H200 records `_scaled_dot_product_cudnn_attention`. The fusion rewrites only the FlashAttention ops
onto megacompile's attention kernel (fusion/attention.py: cuDNN's saves other values), so a fused
plan traced on such a GPU kept torch's attention, and with it the op scratch of its backward (a
float32 dq and the three gradients copied into the arena: 642 MiB at the Llama-2-7B shape, 4 x 4096
tokens), while the same plan made without a GPU (the CPU's flash op, fused) kept none: at 4.27 GiB
the GPU's plan had no room to prefetch (2.99 s a step predicted against 2.63 s). With cuDNN's op
left out while tracing, the GPU records the op the fusion takes, as the plan made before it did;
a fused plan is made from both captures and keeps the faster (planner/attention_choice.py). An
unfused plan keeps torch's choice: the calibration times torch's attention as torch picks it.
"""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def flash_attention(wanted: bool = True):
    """While tracing: torch's SDPA without its cuDNN op when `wanted` (a CPU trace is unaffected)."""
    if not wanted:
        yield
        return
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
