"""Cross-entropy fused with the lm-head projection: loss = mean over non-ignored tokens of
-log softmax(h @ W.T + b)[label], together with d loss / d h, d loss / d W and d loss / d b.

The full [N, V] logits never exist. Tokens go through in chunks of `chunk_size`: per chunk, cuBLAS
makes the [chunk, V] logits, one Triton kernel turns them in place into the per-token loss and
d loss / d logits (an online softmax over V, then a second sweep writing (softmax - onehot) / n_valid),
and two more matmuls turn that into the chunk's rows of dh and its contribution to dW. The loss ends
the graph, so the forward computes the gradients eagerly and the backward only scales them by the
incoming gradient (the Liger-Kernel approach).

Peak extra device memory: chunk_size * V * b for the logits chunk (b = element size of h; 4 B in
fp32, so chunk_size x V x 4 B), reused in place for its gradient, plus the fp32 dW accumulator
(V * H * 4 B; for bf16 weights also one chunk's V * H * 2 B product before it is added in fp32).
Eager PyTorch holds N * V logits, their fp32 copy and the fp32 softmax at once.
The kernel reads the chunk's logits twice and writes them once: 3 * chunk * V * b bytes.
FLOPs: 2*N*H*V (logits) + 4*N*H*V (dh, dW) = 6*N*H*V.

Labels are already aligned with h (shift them before calling, as HF's loss does); a label outside
[0, V) other than ignore_index is undefined behaviour, as it is for a CUDA gather.
"""
import torch
import triton
import triton.language as tl

from .cast import round_to
from .softcap import tanh
from .tiling import row_tile

IGNORE_INDEX = -100
BLOCK_V_MAX = 4096  # vocabulary columns per sweep step of one program


@triton.jit
def cross_entropy_grad_kernel(
    logits_ptr,  # *T [C, V] logits of the chunk; overwritten in place with d loss / d logits
    labels_ptr,  # *i64 [C] target token per row, ignore_index to skip the row
    loss_ptr,  # *fp32 [C] out: per-row loss, logsumexp - logit[label] (0 for ignored rows)
    n_valid_ptr,  # *fp32 [1] count of non-ignored labels in the whole batch (the mean's divisor)
    logits_row_stride,
    n_rows,
    n_cols,  # V
    ignore_index,
    softcap,  # logits capped to softcap * tanh(x / softcap) before the softmax (Gemma 2), if SOFTCAP
    SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_V: tl.constexpr,  # columns per sweep step
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    row_base = logits_ptr + rows.to(tl.int64)[:, None] * logits_row_stride
    labels = tl.load(labels_ptr + rows, mask=row_mask, other=ignore_index)
    valid = row_mask & (labels != ignore_index)

    # sweep 1: online max and sum of exponentials over the vocabulary
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    d = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        x = tl.load(row_base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if SOFTCAP:
            x = softcap * tanh(x / softcap)
        x = tl.where((cols < n_cols)[None, :], x, float("-inf"))
        m_new = tl.maximum(m, tl.max(x, axis=1))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new[:, None]), axis=1)
        m = m_new

    target_ptr = logits_ptr + rows.to(tl.int64) * logits_row_stride + tl.where(valid, labels, 0)
    target = tl.load(target_ptr, mask=valid, other=0.0).to(tl.float32)
    if SOFTCAP:
        target = softcap * tanh(target / softcap)
    loss = tl.where(valid, m + tl.log(d) - target, 0.0)
    tl.store(loss_ptr + rows, loss, mask=row_mask)

    # sweep 2: d loss / d logits = (softmax - onehot(label)) / n_valid, 0 for ignored rows
    scale = tl.where(valid, 1.0 / tl.load(n_valid_ptr), 0.0)
    inv_d = 1.0 / d
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        x = tl.load(row_base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if SOFTCAP:
            capped = tanh(x / softcap)
            x = softcap * capped
        p = tl.exp(x - m[:, None]) * inv_d[:, None]
        grad = (p - tl.where(cols[None, :] == labels[:, None], 1.0, 0.0)) * scale[:, None]
        if SOFTCAP:
            grad = grad * (1.0 - capped * capped)                    # back through the cap
        tl.store(row_base + cols[None, :], round_to(grad, logits_ptr.dtype.element_ty), mask=mask)


def default_chunk_size(n_tokens: int, hidden: int, vocab: int) -> int:
    """Tokens per chunk so that the [chunk, V] logits are about as large as the [N, H] hidden states."""
    return triton.next_power_of_2(triton.cdiv(n_tokens, triton.cdiv(vocab, hidden)))


def fused_linear_cross_entropy_forward(
    h: torch.Tensor,
    w: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunk_size: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    grads: tuple[bool, bool, bool] = (True, True, True),
    softcap: float = 0.0,
):
    """(loss [] fp32, dh [N, H] in h.dtype, dw [V, H] fp32, db [V] fp32) for h [N, H], w [V, H];
    with `softcap`, the logits capped to softcap * tanh(x / softcap) first (Gemma 2's final one).

    The gradients are those of the loss itself (upstream gradient 1); dw and db stay in fp32 so that
    scaling them by an upstream gradient and casting to w.dtype rounds once. grads says which of
    (dh, dw, db) to compute; the others come back as None (a frozen head or evaluation skips the matmuls).
    """
    n_tokens, hidden = h.shape
    vocab = w.shape[0]
    assert w.shape[1] == hidden and labels.shape == (n_tokens,), "h [N, H], w [V, H], labels [N]"
    assert h.dtype == w.dtype, f"h is {h.dtype}, w is {w.dtype}"
    want_dh, want_dw, want_db = grads[0], grads[1], grads[2] and bias is not None
    chunk_size = chunk_size or default_chunk_size(n_tokens, hidden, vocab)
    h, labels = h.contiguous(), labels.contiguous()
    n_valid = (labels != ignore_index).sum().to(torch.float32).reshape(1)  # stays on the device: no sync
    loss_rows = torch.empty(n_tokens, dtype=torch.float32, device=h.device)
    dh = torch.empty((n_tokens, hidden), dtype=h.dtype, device=h.device) if want_dh else None
    dw = torch.zeros((vocab, hidden), dtype=torch.float32, device=w.device) if want_dw else None
    db = torch.zeros(vocab, dtype=torch.float32, device=w.device) if want_db else None

    # one specialization for every chunk, the shorter last one included
    block_m, block_v, num_warps = row_tile(chunk_size, min(vocab, BLOCK_V_MAX), tile=4 * BLOCK_V_MAX)
    for start in range(0, n_tokens, chunk_size):
        end = min(start + chunk_size, n_tokens)
        h_chunk = h[start:end]  # [c, H]
        logits = h_chunk @ w.T if bias is None else torch.addmm(bias, h_chunk, w.T)  # [c, V] in h.dtype
        cross_entropy_grad_kernel[(triton.cdiv(end - start, block_m),)](
            logits, labels[start:end], loss_rows[start:end], n_valid,
            logits.stride(0), end - start, vocab, ignore_index, float(softcap or 1.0),
            SOFTCAP=bool(softcap), BLOCK_M=block_m, BLOCK_V=block_v, num_warps=num_warps,
        )
        dlogits = logits  # overwritten in place
        if dh is not None:
            torch.mm(dlogits, w, out=dh[start:end])  # [c, H]
        if dw is not None and dw.dtype == dlogits.dtype:
            dw.addmm_(dlogits.T, h_chunk)
        elif dw is not None:
            dw += dlogits.T @ h_chunk  # product in w.dtype, sum in fp32
        if db is not None:
            db += dlogits.sum(0, dtype=torch.float32)

    loss = loss_rows.sum() / n_valid[0]
    return loss, dh, dw, db


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, labels, bias, chunk_size, ignore_index, softcap):
        shape = h.shape
        loss, dh, dw, db = fused_linear_cross_entropy_forward(
            h.reshape(-1, shape[-1]), w, labels.reshape(-1), bias, chunk_size, ignore_index,
            grads=(ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[3]), softcap=softcap,
        )
        ctx.save_for_backward(dh.view(shape) if dh is not None else None, dw, db)
        ctx.dtypes = (w.dtype, bias.dtype if bias is not None else None)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        dh, dw, db = ctx.saved_tensors
        w_dtype, b_dtype = ctx.dtypes
        if not torch.equal(grad_loss, torch.ones_like(grad_loss)):  # the loss was scaled downstream
            # one more rounding for a bf16 dh (as in Liger-Kernel); dw and db are still fp32 here
            dh = dh * grad_loss.to(dh.dtype) if dh is not None else None
            dw = dw * grad_loss if dw is not None else None
            db = db * grad_loss if db is not None else None
        dw = dw.to(w_dtype) if dw is not None else None
        db = db.to(b_dtype) if db is not None else None
        return dh, dw, None, db, None, None, None


def fused_linear_cross_entropy(
    h: torch.Tensor,
    w: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunk_size: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    softcap: float = 0.0,
) -> torch.Tensor:
    """cross_entropy(h @ w.T + bias, labels, ignore_index) with mean reduction, never holding all logits;
    with `softcap`, of the logits capped to softcap * tanh(logits / softcap) (Gemma 2).

    h [..., H], labels [...] (already shifted), w [V, H]; differentiable in h, w and bias.
    """
    return FusedLinearCrossEntropyFunction.apply(h, w, labels, bias, chunk_size, ignore_index, softcap)
