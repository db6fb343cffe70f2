"""The embedding's backward: the [V, H] weight gradient summed from the [N, H] rows of the output
gradient, written where the caller put its result.

ATen's CUDA op allocates its [V, H] result itself (its `out=` form only copies that in) and, beside
it, a float32 partial sum per token row: 752 MiB and 96 MiB for a 128k vocabulary 3072 wide at
8192 tokens, 8 GiB of partials at 512k tokens, all scratch beside the arena. Here the result is
the caller's (kernels/outputs.py) and nothing of [N, H] is allocated: the token ids are sorted
(stably, so each id's rows keep their order), and the first position of each run of equal ids
sums its run's rows in float32, in token order, and stores the row once, rounded as the result's
dtype. On the host (float32) that is the very sum ATen's CPU op makes, row by row in token order;
on a GPU it differs from ATen's (sums of ten rows, then of those) only in float32 rounding. Rows of
ids no token has, and of `padding_idx`, stay zero. Deterministic: no atomics.

Reads N x H gradient elements once and writes V x H results; the sort and the zero fill are ATen's.
An id's run of r rows is summed by one program per column tile, r steps in sequence (ATen splits
runs into pieces of ten): a token repeated tens of thousands of times in a step is the slow case.
"""
import torch
import triton
import triton.language as tl

from . import outputs
from .cast import round_to

BLOCK_H = 128


@triton.jit
def embedding_backward_kernel(
    out_ptr,  # [V, H] result, zeroed
    grad_ptr,  # [N, H] output gradient rows
    ids_ptr,  # [N] int64 token ids, sorted
    order_ptr,  # [N] int64: the gradient row of each sorted position
    n,  # N
    h,  # H
    padding_idx,  # an id whose row stays zero (-1: none)
    stride_grad,
    stride_out,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < h
    row = tl.load(ids_ptr + i)
    before = tl.load(ids_ptr + i - 1, mask=i > 0, other=-1)
    if (before != row) & (row != padding_idx):          # the first position of its id's run
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        j = i
        current = row
        while current == row:
            source = tl.load(order_ptr + j)
            acc += tl.load(grad_ptr + source * stride_grad + cols, mask=mask, other=0.0).to(tl.float32)
            j += 1
            current = tl.load(ids_ptr + j, mask=j < n, other=-1)
        tl.store(out_ptr + row * stride_out + cols, round_to(acc, out_ptr.dtype.element_ty), mask=mask)


def embedding_backward(grad: torch.Tensor, indices: torch.Tensor, num_weights: int,
                       padding_idx: int = -1) -> torch.Tensor:
    """aten.embedding_dense_backward(grad, indices, num_weights, padding_idx, False): [V, H] in
    grad's dtype, V = num_weights, H = grad.shape[-1]; indices of any shape, grad [*indices.shape, H]."""
    h = grad.shape[-1]
    assert tuple(grad.shape[:-1]) == tuple(indices.shape) and not indices.is_floating_point(), \
        (grad.shape, indices.shape)
    assert indices.device == grad.device, f"the ids are on {indices.device}, the gradient on {grad.device}"
    out = outputs.zeros((num_weights, h), dtype=grad.dtype, device=grad.device)
    rows = grad.reshape(-1, h)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    ids, order = torch.sort(indices.reshape(-1).to(torch.int64), stable=True)
    n = ids.numel()
    if n and h:
        embedding_backward_kernel[(n, triton.cdiv(h, BLOCK_H))](
            out, rows, ids, order, n, h, padding_idx if padding_idx >= 0 else -1, rows.stride(0), out.stride(0),
            BLOCK=BLOCK_H)
    return out


def scratch_bytes(tokens: int) -> int:
    """What embedding_backward holds beside its result: the sorted ids and their order (int64 each),
    and the sort's own buffers (as much again)."""
    return 4 * tokens * 8
