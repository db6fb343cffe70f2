"""Each token's log-probability under the lm head, log softmax(h @ W.T)[label], without the [N, V] logits.

Post-training losses (DPO, KTO, GRPO, DFT) read each token's log-probability, not one mean loss, and
weigh it by an upstream gradient known only once the whole batch's loss is: unlike the fused
cross-entropy, the gradients cannot be taken in the forward. So the forward keeps, per token, the
picked logit and the logsumexp ([N] fp32 each), and the backward makes each chunk's [chunk, V]
logits again:

    forward    per chunk: logits = h_c @ W.T; one sweep: picked = logits[label], lse = logsumexp
    backward   per chunk: logits = h_c @ W.T again; in place: d = g_lse * exp(logits - lse) + g_pick * onehot;
               dh_c = d @ W; dW += d.T @ h_c

g_pick and g_lse are the gradients of the picked logit and of the logsumexp (for log p = picked - lse,
g_lse = -g_pick): the backward takes both, as autograd gives them. The logits are made in h.dtype,
as the head's matmul makes them, and read in fp32; GRPO's temperature divides them as they are
read (rounded to h.dtype where eager divides the bf16 logits), and its gradient as it is written.

Extra device memory: one [chunk, V] tile in h.dtype (forward and backward), and in the backward an
fp32 dW accumulator when W is not fp32. FLOPs: 2NHV forward, 6NHV backward (one more matmul than
eager, which keeps the logits instead).

Labels must lie in [0, V): mask ignored positions before (as the losses do, reading the mask apart);
a label outside it picks NaN, where eager's gather raises, so that it cannot train silently.
"""
import torch
import triton
import triton.language as tl

from .cast import round_to
from .fused_linear_cross_entropy import BLOCK_V_MAX, default_chunk_size
from .tiling import row_tile


@triton.jit
def _scaled(x, temperature, TEMPERATURE: tl.constexpr, ROUNDED: tl.constexpr, dtype: tl.constexpr):
    """x / temperature where the logits are divided, rounded to `dtype` where eager divides in it."""
    if TEMPERATURE:
        x = x / temperature
        if ROUNDED:
            x = round_to(x, dtype).to(tl.float32)
    return x


@triton.jit
def logprob_forward_kernel(
    logits_ptr,  # *T [C, V] logits of the chunk (read only)
    labels_ptr,  # *i64 [C] the token whose logit is picked, in [0, V)
    picked_ptr,  # *fp32 [C] out: logits[row, label]
    lse_ptr,  # *fp32 [C] out: logsumexp over the row
    logits_row_stride,
    n_rows,
    n_cols,  # V
    temperature,  # the logits are divided by it first, if TEMPERATURE
    TEMPERATURE: tl.constexpr,
    ROUNDED: tl.constexpr,  # the quotient rounded to the logits' dtype (eager divides the bf16 logits)
    BLOCK_M: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    row_base = logits_ptr + rows.to(tl.int64)[:, None] * logits_row_stride
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    d = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_V):                        # online max and sum of exponentials
        cols = start + tl.arange(0, BLOCK_V)
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        x = tl.load(row_base + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
        x = _scaled(x, temperature, TEMPERATURE, ROUNDED, logits_ptr.dtype.element_ty)
        m_new = tl.maximum(m, tl.max(x, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)      # a masked-out row stays finite
        d = d * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe[:, None]), axis=1)
        m = m_new
    labels = tl.load(labels_ptr + rows, mask=row_mask, other=0)
    inside = (labels >= 0) & (labels < n_cols)      # eager's gather raises on another index: here it reads NaN
    picked = tl.load(logits_ptr + rows.to(tl.int64) * logits_row_stride + labels, mask=row_mask & inside, other=0.0)
    picked = _scaled(picked.to(tl.float32), temperature, TEMPERATURE, ROUNDED, logits_ptr.dtype.element_ty)
    tl.store(picked_ptr + rows, tl.where(inside, picked, float("nan")), mask=row_mask)
    tl.store(lse_ptr + rows, m + tl.log(tl.where(row_mask, d, 1.0)), mask=row_mask)


@triton.jit
def logprob_grad_kernel(
    logits_ptr,  # *T [C, V] logits of the chunk; overwritten in place with d / d logits
    labels_ptr,  # *i64 [C]
    lse_ptr,  # *fp32 [C] the forward's logsumexp
    g_pick_ptr,  # *fp32 [C] gradient of the picked logit
    g_lse_ptr,  # *fp32 [C] gradient of the logsumexp
    logits_row_stride,
    n_rows,
    n_cols,
    temperature,
    TEMPERATURE: tl.constexpr,
    ROUNDED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    row_base = logits_ptr + rows.to(tl.int64)[:, None] * logits_row_stride
    labels = tl.load(labels_ptr + rows, mask=row_mask, other=0)
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    g_pick = tl.load(g_pick_ptr + rows, mask=row_mask, other=0.0)
    g_lse = tl.load(g_lse_ptr + rows, mask=row_mask, other=0.0)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        x = tl.load(row_base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = _scaled(x, temperature, TEMPERATURE, ROUNDED, logits_ptr.dtype.element_ty)
        grad = g_lse[:, None] * tl.exp(x - lse[:, None])           # autograd's order: product, then the sum
        grad = grad + tl.where(cols[None, :] == labels[:, None], g_pick[:, None], 0.0)
        if TEMPERATURE:                                            # back through the division, as eager rounds
            if ROUNDED:
                grad = round_to(grad, logits_ptr.dtype.element_ty).to(tl.float32)
            grad = grad / temperature
        tl.store(row_base + cols[None, :], round_to(grad, logits_ptr.dtype.element_ty), mask=mask)


def _tile(chunk_size: int, vocab: int) -> tuple[int, int, int]:
    return row_tile(chunk_size, min(vocab, BLOCK_V_MAX), tile=4 * BLOCK_V_MAX)


def _temperature(temperature: float, rounded: bool, dtype: torch.dtype) -> dict:
    return dict(temperature=float(temperature or 1.0), TEMPERATURE=bool(temperature),
                ROUNDED=bool(temperature) and rounded and dtype != torch.float32)


def picked_and_lse(logits: torch.Tensor, labels: torch.Tensor, picked: torch.Tensor, lse: torch.Tensor,
                   chunk_size: int, temperature: float = 0.0, rounded: bool = False) -> None:
    """picked[i] = x[i, labels[i]] and lse[i] = logsumexp(x[i]) in fp32, for one chunk, x the logits
    (divided by `temperature` when given; the quotient `rounded` to the logits' dtype, as eager's
    division of bf16 logits gives it)."""
    rows, vocab = logits.shape
    block_m, block_v, num_warps = _tile(chunk_size, vocab)
    logprob_forward_kernel[(triton.cdiv(rows, block_m),)](
        logits, labels, picked, lse, logits.stride(0), rows, vocab, **_temperature(temperature, rounded, logits.dtype),
        BLOCK_M=block_m, BLOCK_V=block_v, num_warps=num_warps)


def logits_grad_(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, g_pick: torch.Tensor,
                 g_lse: torch.Tensor, chunk_size: int, temperature: float = 0.0, rounded: bool = False) -> None:
    """Turn one chunk's logits, in place, into d/dlogits of g_lse * lse + g_pick * picked."""
    rows, vocab = logits.shape
    block_m, block_v, num_warps = _tile(chunk_size, vocab)
    logprob_grad_kernel[(triton.cdiv(rows, block_m),)](
        logits, labels, lse, g_pick, g_lse, logits.stride(0), rows, vocab,
        **_temperature(temperature, rounded, logits.dtype), BLOCK_M=block_m, BLOCK_V=block_v, num_warps=num_warps)


class LinearLogprobsFunction(torch.autograd.Function):
    """(picked, lse) of h [N, H] @ w.T [H, V] at labels [N]; the kernels' own differentiable form,
    which the kernel check runs against torch (the graph rewrite calls the same kernels)."""

    @staticmethod
    def forward(ctx, h, w, labels, chunk_size, temperature=0.0):
        n, vocab = h.shape[0], w.shape[0]
        chunk_size = chunk_size or default_chunk_size(n, h.shape[1], vocab)
        h, labels = h.contiguous(), labels.contiguous()
        picked = torch.empty(n, dtype=torch.float32, device=h.device)
        lse = torch.empty(n, dtype=torch.float32, device=h.device)
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            picked_and_lse(h[start:end] @ w.T, labels[start:end], picked[start:end], lse[start:end], chunk_size,
                           temperature, rounded=True)
        ctx.save_for_backward(h, w, labels, lse)
        ctx.chunk_size, ctx.temperature = chunk_size, temperature
        return picked, lse

    @staticmethod
    def backward(ctx, g_pick, g_lse):
        h, w, labels, lse = ctx.saved_tensors
        n = h.shape[0]
        g_pick = (torch.zeros(n, device=h.device) if g_pick is None else g_pick).float().contiguous()
        g_lse = (torch.zeros(n, device=h.device) if g_lse is None else g_lse).float().contiguous()
        dh = torch.empty_like(h)
        dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        for start in range(0, n, ctx.chunk_size):
            end = min(start + ctx.chunk_size, n)
            logits = h[start:end] @ w.T
            logits_grad_(logits, labels[start:end], lse[start:end], g_pick[start:end], g_lse[start:end],
                         ctx.chunk_size, ctx.temperature, rounded=True)
            torch.mm(logits, w, out=dh[start:end])
            dw += (logits.T @ h[start:end]).float()
        return dh, dw.to(w.dtype), None, None, None


def linear_logprobs(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, chunk_size: int | None = None,
                    temperature: float = 0.0) -> torch.Tensor:
    """log softmax(h @ w.T / temperature)[label] per row, in fp32 (the division in h.dtype, as a
    policy's logits divided by GRPO's temperature): h [N, H], w [V, H], labels [N] in [0, V)."""
    picked, lse = LinearLogprobsFunction.apply(h, w, labels, chunk_size, temperature)
    return picked - lse
