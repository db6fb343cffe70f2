"""The gradient of attention sinks: one logit per query head that joins every row's softmax.

A sink s_h is a key every query of head h sees, with no value behind it. Its probability in row i
is p_i = exp(s_h - lse_i), with lse_i the row's log-sum-exp over its keys and the sink, and since
its value is zero, dL/dp_i = 0: the softmax's backward gives the sink

    dL/ds_h = sum over rows (b, i) of p_i * (0 - delta_i) = -sum exp(s_h - lse_i) * delta_i

with delta_i = rowsum(do * o), the attention backward's own temporary. One program per head sums
its B * S rows in a fixed order (deterministic, no atomics) and writes the result in the sinks'
dtype; the attention backward needs nothing else, since lse already holds the sink's share.
"""
import torch
import triton
import triton.language as tl

from .cast import round_to
from . import outputs

BLOCK = 1024


@triton.jit
def attention_sinks_backward_kernel(
    dsinks_ptr, sinks_ptr, lse_ptr, delta_ptr, B, S, HQ,
    slb, slh, sls, sdb, sdh, sds,
    BLOCK: tl.constexpr,
):
    h = tl.program_id(0).to(tl.int64)
    sink = tl.load(sinks_ptr + h).to(tl.float32)
    total = tl.zeros((BLOCK,), tl.float32)
    for b in range(0, B):
        lse_base = h * slh + b * slb        # [B, Hq, S] fits int32 offsets; h's int64 carries the sum
        delta_base = h * sdh + b * sdb
        for r0 in range(0, S, BLOCK):
            rows = r0 + tl.arange(0, BLOCK)
            inside = rows < S
            lse = tl.load(lse_ptr + lse_base + rows.to(tl.int64) * sls, mask=inside, other=float("inf"))
            delta = tl.load(delta_ptr + delta_base + rows.to(tl.int64) * sds, mask=inside, other=0.0)
            total += tl.exp(sink - lse) * delta
    tl.store(dsinks_ptr + h, round_to(-tl.sum(total, axis=0), dsinks_ptr.dtype.element_ty))


def attention_sinks_backward(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """dL/dsinks [Hq] in the sinks' dtype, from lse and delta [B, Hq, S] (float32, any strides)."""
    batch, hq, seq = lse.shape
    assert sinks.shape == (hq,) and delta.shape == lse.shape, (sinks.shape, lse.shape, delta.shape)
    dsinks = outputs.empty((hq,), dtype=sinks.dtype, device=sinks.device)
    attention_sinks_backward_kernel[(hq,)](dsinks, sinks.contiguous(), lse, delta, batch, seq, hq,
                                           *lse.stride(), *delta.stride(), BLOCK=BLOCK)
    return dsinks
