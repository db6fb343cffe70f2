"""Causal attention over a sliding window and packed documents, as two operators with no mask tensor.

    window_attention(q [B, Hq, S, D], k, v [B, Hkv, S, D], scale, window, starts [B, S] or None,
                     kept [B, S] or None) -> (o [B, Hq, S, D], lse [B, Hq, S])
    window_attention_backward(do, q, k, v, o, lse, scale, window, starts, kept) -> (dq, dk, dv, delta [B, Hq, S])

Query i sees key j when i - window < j <= i (transformers' sliding_window_overlay over its causal
mask; a window of S or more is plain causal) and, given `starts`, the first key of each query's
document, when j >= starts[i] (transformers' packed-sequence mask: documents laid end to end in a
row, none seeing another) and, given `kept` (a 2D attention_mask, bool), when key j of the row is
kept: a query that then sees no key (left padding) gets o = 0 and no gradient, as torch's SDPA
gives it. Hq is a multiple of Hkv (grouped-query heads). Transformers expresses
such a layer as SDPA with a [B, 1, S, S] boolean mask, which the model builds once and every layer
turns into an additive one: 2 B S^2 bytes in bf16 per layer, 512 MiB at 16 x 4096, and past 100k
tokens more than any GPU holds. These operators carry a number and B S integers instead.

Results keep the layouts of the flash ops (o, dq, dk, dv as [B, S, H, D] memory viewed
[B, H, S, D]; lse float32 [B, Hq, S] in natural log), and delta = rowsum(do * o), the backward's one
temporary, is a result of its own, so the device arena places all of them: every path makes its
results through kernels/outputs.py. The paths, chosen when the graph runs:
  - bf16 or fp16 on a GPU, head dims up to 256: the Triton kernels of kernels/attention.py, which
    skip the key tiles outside the window (work grows with S * window, not S^2);
  - on the cpu: the op eager PyTorch runs for transformers' masked SDPA
    (_scaled_dot_product_flash_attention_for_cpu and its backward, key/value heads repeated, the
    additive [S, S] mask made inside), so a captured model trains as the eager one does, sum for sum;
  - otherwise (float32 or wider heads on a GPU): a reference in float32 over chunks of query rows,
    each against the keys its rows see, so its scratch is a chunk's scores, never [S, S].
"""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import CaptureError

# Query rows per step of the reference: its scores are [B, Hq, CHUNK, CHUNK + window - 1] in fp32.
CHUNK = 256
KERNEL_DTYPES = (torch.bfloat16, torch.float16)
KERNEL_HEAD_DIM = 256


def _per_row(t: torch.Tensor | None, q: torch.Tensor, dtype_ok) -> bool:
    return t is None or (tuple(t.shape) == (q.shape[0], q.shape[2]) and dtype_ok(t.dtype))


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, starts: torch.Tensor | None,
           kept: torch.Tensor | None) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[0] != k.shape[0] \
            or q.shape[2:] != k.shape[2:] or q.shape[1] % k.shape[1] or window < 1 \
            or not _per_row(starts, q, lambda d: not d.is_floating_point and d != torch.bool) \
            or not _per_row(kept, q, lambda d: d == torch.bool):
        def described(t):
            return None if t is None else (list(t.shape), t.dtype)
        raise CaptureError(f"window_attention takes q [B, Hq, S, D], k and v [B, Hkv, S, D] with Hq a multiple of "
                           f"Hkv, a window of at least 1, integer document starts [B, S] or none and a bool [B, S] "
                           f"of kept keys or none; got q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}, "
                           f"window {window}, starts {described(starts)}, kept {described(kept)}")


def _heads_layout(t: torch.Tensor) -> tuple[int, int, int, int]:
    """The flash ops' result layout, as the kernels make it."""
    from ..kernels.attention import heads_layout
    return heads_layout(*t.shape)


def _on_gpu(x: torch.Tensor) -> bool:
    return x.is_cuda


def uses_kernel(q: torch.Tensor) -> bool:
    """The Triton kernels run this call: half precision on a GPU, head dims they tile."""
    return _on_gpu(q) and q.dtype in KERNEL_DTYPES and q.shape[-1] <= KERNEL_HEAD_DIM


def reference_scratch_bytes(q: torch.Tensor, k: torch.Tensor, window: int, backward: bool) -> int:
    """What the GPU reference (float32, or heads past the kernels') holds beside its results: the
    key/value heads in float32 repeated per query head, a chunk's scores and probabilities, and in
    the backward per-query-head dk and dv in float32. The kernels hold nothing (0)."""
    batch, hq, seq, dim = q.shape
    if q.dtype in KERNEL_DTYPES and dim <= KERNEL_HEAD_DIM:
        return 0
    rows = min(seq, CHUNK)
    chunk = batch * hq * rows * min(seq, rows + window - 1) * 4
    heads = batch * hq * seq * dim * 4
    return 2 * heads + 3 * chunk + (2 * heads if backward else 0)


def _seen(rows: range, first_key: int, end: int, window: int, starts: torch.Tensor | None,
          kept: torch.Tensor | None, device) -> torch.Tensor:
    """[rows, keys first_key..end), or [B, 1, rows, keys] with documents or padding: which keys
    each row sees."""
    keys = torch.arange(first_key, end, device=device)
    lag = torch.arange(rows.start, rows.stop, device=device)[:, None] - keys[None, :]
    seen = (lag >= 0) & (lag < window)
    if starts is not None:
        seen = seen & (keys[None, None, None, :] >= starts[:, None, rows.start:rows.stop, None])
    if kept is not None:
        seen = seen & kept[:, None, None, first_key:end]
    return seen


def _chunks(seq: int, window: int):
    """(query rows, first key they see) per chunk of the reference."""
    for start in range(0, seq, CHUNK):
        rows = range(start, min(seq, start + CHUNK))
        yield rows, max(0, start - window + 1)


def _grouped(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t.float().repeat_interleave(groups, dim=1)


def _additive_mask(seq: int, window: int, starts: torch.Tensor | None, kept: torch.Tensor | None,
                   dtype: torch.dtype, device) -> torch.Tensor:
    """[1 or B, 1, S, S]: 0 where a query sees a key, -inf elsewhere (what SDPA makes of a boolean mask)."""
    seen = _seen(range(0, seq), 0, seq, window, starts, kept, device)
    seen = seen.expand(1, 1, seq, seq) if seen.dim() == 2 else seen
    return torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill_(~seen, float("-inf"))


def _repeated(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Key/value heads repeated for each query head, as transformers' repeat_kv does."""
    if groups == 1:
        return t
    batch, heads, seq, dim = t.shape
    return t[:, :, None].expand(batch, heads, groups, seq, dim).reshape(batch, heads * groups, seq, dim)


def forward_host(q, k, v, scale: float, window: int, starts=None, kept=None) -> tuple[torch.Tensor, torch.Tensor]:
    from ..kernels import outputs
    groups = q.shape[1] // k.shape[1]
    made, lse_made = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, _repeated(k, groups), _repeated(v, groups), 0.0, False,
        attn_mask=_additive_mask(q.shape[2], window, starts, kept, q.dtype, q.device), scale=scale)
    o = outputs.empty_strided(q.shape, _heads_layout(q), dtype=q.dtype, device=q.device)
    lse = outputs.empty(lse_made.shape, dtype=torch.float32, device=q.device)
    return o.copy_(made), lse.copy_(lse_made)


def backward_host(do, q, k, v, o, lse, scale: float, window: int, starts=None, kept=None):
    from ..kernels import outputs
    batch, hq, seq, dim = q.shape
    hkv = k.shape[1]
    groups = hq // hkv
    dq_made, dk_made, dv_made = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do, q, _repeated(k, groups), _repeated(v, groups), o, lse, 0.0, False,
        attn_mask=_additive_mask(seq, window, starts, kept, q.dtype, q.device), scale=scale)
    delta = outputs.empty((batch, hq, seq), dtype=torch.float32, device=q.device)
    dq = outputs.empty_strided(q.shape, _heads_layout(q), dtype=q.dtype, device=q.device)
    dk = outputs.empty_strided(k.shape, _heads_layout(k), dtype=k.dtype, device=k.device)
    dv = outputs.empty_strided(v.shape, _heads_layout(v), dtype=v.dtype, device=v.device)
    torch.sum(do.float() * o.float(), dim=-1, out=delta)     # the kernels' temporary, a result on every path
    dq.copy_(dq_made)
    # repeat_kv's backward: each key/value head's gradient summed over its query heads
    dk.copy_(dk_made.view(batch, hkv, groups, seq, dim).sum(2))
    dv.copy_(dv_made.view(batch, hkv, groups, seq, dim).sum(2))
    return dq, dk, dv, delta


def forward_reference(q, k, v, scale: float, window: int, starts=None, kept=None) -> tuple[torch.Tensor, torch.Tensor]:
    from ..kernels import outputs
    batch, hq, seq, dim = q.shape
    o = outputs.empty_strided(q.shape, _heads_layout(q), dtype=q.dtype, device=q.device)
    lse = outputs.empty((batch, hq, seq), dtype=torch.float32, device=q.device)
    kf, vf = _grouped(k, hq // k.shape[1]), _grouped(v, hq // k.shape[1])
    for rows, first in _chunks(seq, window):
        end = rows.stop
        s = (q[:, :, rows.start:end].float() @ kf[:, :, first:end].transpose(-1, -2)) * scale
        s.masked_fill_(~_seen(rows, first, end, window, starts, kept, q.device), float("-inf"))
        m = torch.logsumexp(s, dim=-1)
        shift = m.masked_fill(m == float("-inf"), 0.0)       # a row that sees no key: o = 0, lse -inf
        o[:, :, rows.start:end] = (torch.exp(s - shift[..., None]) @ vf[:, :, first:end]).to(q.dtype)
        lse[:, :, rows.start:end] = m
    return o, lse


def backward_reference(do, q, k, v, o, lse, scale: float, window: int, starts=None, kept=None):
    from ..kernels import outputs
    batch, hq, seq, dim = q.shape
    hkv = k.shape[1]
    groups = hq // hkv
    delta = outputs.empty((batch, hq, seq), dtype=torch.float32, device=q.device)
    dq = outputs.empty_strided(q.shape, _heads_layout(q), dtype=q.dtype, device=q.device)
    dk = outputs.empty_strided(k.shape, _heads_layout(k), dtype=k.dtype, device=k.device)
    dv = outputs.empty_strided(v.shape, _heads_layout(v), dtype=v.dtype, device=v.device)
    torch.sum(do.float() * o.float(), dim=-1, out=delta)
    kf, vf = _grouped(k, groups), _grouped(v, groups)
    dk_heads = torch.zeros(batch, hq, seq, dim, dtype=torch.float32, device=q.device)   # per query head
    dv_heads = torch.zeros_like(dk_heads)
    for rows, first in _chunks(seq, window):
        end = rows.stop
        qc, doc = q[:, :, rows.start:end].float(), do[:, :, rows.start:end].float()
        s = (qc @ kf[:, :, first:end].transpose(-1, -2)) * scale
        p = torch.exp(s - lse[:, :, rows.start:end, None])
        p.masked_fill_(~_seen(rows, first, end, window, starts, kept, q.device), 0.0)
        dv_heads[:, :, first:end] += p.transpose(-1, -2) @ doc
        ds = p * (doc @ vf[:, :, first:end].transpose(-1, -2) - delta[:, :, rows.start:end, None])
        dq[:, :, rows.start:end] = (ds @ kf[:, :, first:end] * scale).to(q.dtype)
        dk_heads[:, :, first:end] += ds.transpose(-1, -2) @ qc * scale
    dk.copy_(dk_heads.view(batch, hkv, groups, seq, dim).sum(2))
    dv.copy_(dv_heads.view(batch, hkv, groups, seq, dim).sum(2))
    return dq, dk, dv, delta


@torch.library.custom_op("megacompile::window_attention", mutates_args=())
def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int,
                     starts: Optional[torch.Tensor] = None,
                     kept: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    _check(q, k, v, window, starts, kept)
    if uses_kernel(q):
        from ..kernels.attention import attention_forward
        return attention_forward(q, k, v, True, scale, window=window, starts=starts, kept=kept)
    if not _on_gpu(q):
        return forward_host(q, k, v, scale, window, starts, kept)
    return forward_reference(q, k, v, scale, window, starts, kept)


@window_attention.register_fake
def _window_attention_fake(q, k, v, scale, window, starts=None, kept=None):
    _check(q, k, v, window, starts, kept)
    batch, hq, seq, _ = q.shape
    return (torch.empty_strided(q.shape, _heads_layout(q), dtype=q.dtype, device=q.device),
            q.new_empty((batch, hq, seq), dtype=torch.float32))


@torch.library.custom_op("megacompile::window_attention_backward", mutates_args=())
def window_attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                              lse: torch.Tensor, scale: float, window: int, starts: Optional[torch.Tensor] = None,
                              kept: Optional[torch.Tensor] = None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if uses_kernel(q):
        from ..kernels.attention import attention_backward
        return attention_backward(do if do.stride(-1) == 1 else do.contiguous(), q, k, v, o, lse, True, scale,
                                  window=window, starts=starts, kept=kept)
    if not _on_gpu(q):
        return backward_host(do, q, k, v, o, lse, scale, window, starts, kept)
    return backward_reference(do, q, k, v, o, lse, scale, window, starts, kept)


@window_attention_backward.register_fake
def _window_attention_backward_fake(do, q, k, v, o, lse, scale, window, starts=None, kept=None):
    batch, hq, seq, _ = q.shape
    return (torch.empty_strided(q.shape, _heads_layout(q), dtype=q.dtype, device=q.device),
            torch.empty_strided(k.shape, _heads_layout(k), dtype=k.dtype, device=k.device),
            torch.empty_strided(v.shape, _heads_layout(v), dtype=v.dtype, device=v.device),
            q.new_empty((batch, hq, seq), dtype=torch.float32))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, scale, window, starts, kept = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, starts, kept)
    ctx.scale, ctx.window = scale, window


def _backward(ctx, do: torch.Tensor, _dlse):
    q, k, v, o, lse, starts, kept = ctx.saved_tensors
    dq, dk, dv, _ = window_attention_backward(do, q, k, v, o, lse, ctx.scale, ctx.window, starts, kept)
    return dq, dk, dv, None, None, None, None


window_attention.register_autograd(_backward, setup_context=_setup_context)
