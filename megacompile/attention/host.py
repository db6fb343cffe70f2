"""Sliding-window attention on the cpu: what eager PyTorch runs for the layer transformers would run.

Without sinks, transformers' masked SDPA: _scaled_dot_product_flash_attention_for_cpu and its
backward, with the key/value heads repeated as transformers' repeat_kv does and the additive [S, S]
mask made inside. With sinks, GPT-OSS's eager attention: scores, the additive mask eager's mask
function makes (0 or the dtype's lowest), the sinks concatenated as one more column, the row's
maximum subtracted, softmax, the sink column dropped, times v; its backward is autograd's of the
same ops, run again. Either way a captured model trains as the eager one does, sum for sum.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .seen import heads_layout, seen


def _additive_mask(seq: int, window: int, starts: torch.Tensor | None, kept: torch.Tensor | None,
                   dtype: torch.dtype, device, lowest: float = float("-inf")) -> torch.Tensor:
    """[1 or B, 1, S, S]: 0 where a query sees a key, `lowest` elsewhere (-inf: what SDPA makes of a
    boolean mask; the dtype's lowest: eager's)."""
    mask = seen(range(0, seq), 0, seq, window, starts, kept, device)
    mask = mask.expand(1, 1, seq, seq) if mask.dim() == 2 else mask
    return torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, lowest)


def _repeated(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Key/value heads repeated for each query head, as transformers' repeat_kv does."""
    if groups == 1:
        return t
    batch, heads, seq, dim = t.shape
    return t[:, :, None].expand(batch, heads, groups, seq, dim).reshape(batch, heads * groups, seq, dim)


def forward_host(q, k, v, scale: float, window: int, starts=None, kept=None, sinks=None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    from ..kernels import outputs
    if sinks is not None:
        o_made, lse_made = _eager_with_sinks(q, k, v, sinks, scale, window, starts, kept)
        o = outputs.empty_strided(q.shape, heads_layout(q), dtype=q.dtype, device=q.device)
        lse = outputs.empty(lse_made.shape, dtype=torch.float32, device=q.device)
        return o.copy_(o_made), lse.copy_(lse_made)
    groups = q.shape[1] // k.shape[1]
    made, lse_made = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, _repeated(k, groups), _repeated(v, groups), 0.0, False,
        attn_mask=_additive_mask(q.shape[2], window, starts, kept, q.dtype, q.device), scale=scale)
    o = outputs.empty_strided(q.shape, heads_layout(q), dtype=q.dtype, device=q.device)
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
    dq = outputs.empty_strided(q.shape, heads_layout(q), dtype=q.dtype, device=q.device)
    dk = outputs.empty_strided(k.shape, heads_layout(k), dtype=k.dtype, device=k.device)
    dv = outputs.empty_strided(v.shape, heads_layout(v), dtype=v.dtype, device=v.device)
    torch.sum(do.float() * o.float(), dim=-1, out=delta)     # the kernels' temporary, a result on every path
    dq.copy_(dq_made)
    # repeat_kv's backward: each key/value head's gradient summed over its query heads
    dk.copy_(dk_made.view(batch, hkv, groups, seq, dim).sum(2))
    dv.copy_(dv_made.view(batch, hkv, groups, seq, dim).sum(2))
    return dq, dk, dv, delta


def _eager_with_sinks(q, k, v, sinks, scale: float, window: int, starts, kept, keep: dict | None = None):
    """(o [B, Hq, S, D], lse float32 [B, Hq, S]) as transformers' GPT-OSS eager attention computes o;
    into `keep`, what its backward reads."""
    batch, hq, seq, _ = q.shape
    groups = hq // k.shape[1]
    kr, vr = _repeated(k, groups), _repeated(v, groups)
    scores = torch.matmul(q, kr.transpose(2, 3)) * scale
    scores = scores + _additive_mask(seq, window, starts, kept, scores.dtype, q.device, torch.finfo(scores.dtype).min)
    logits = torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(batch, -1, seq, -1)], dim=-1)
    top, at = logits.max(dim=-1, keepdim=True)
    logits = logits - top
    probs = F.softmax(logits, dim=-1, dtype=logits.dtype)
    o = torch.matmul(probs[..., :-1].to(v.dtype), vr)
    if keep is not None:
        keep.update(kr=kr, vr=vr, at=at, probs=probs)
    return o, (top[..., 0].float() + torch.logsumexp(logits.float(), dim=-1))


def backward_host_sinks(do, q, k, v, o, lse, scale: float, window: int, starts, kept, sinks):
    """(dq, dk, dv, delta, dsinks): the forward run again, then autograd's formulas for each of its
    ops in reverse, one for one (the custom operator runs below autograd, so autograd cannot)."""
    from ..kernels import outputs
    batch, hq, seq, dim = q.shape
    hkv = k.shape[1]
    groups = hq // hkv
    saved: dict = {}
    _eager_with_sinks(q, k, v, sinks, scale, window, starts, kept, saved)
    probs = saved["probs"]
    kept_probs = probs[..., :-1].to(v.dtype)
    d_vr = torch.matmul(kept_probs.transpose(-1, -2), do)
    d_probs = torch.zeros_like(probs)
    d_probs[..., :-1] = torch.matmul(do, saved["vr"].transpose(-1, -2))
    d_logits = torch._softmax_backward_data(d_probs, probs, -1, probs.dtype)
    # logits - max: the max's gradient, -rowsum, lands on the column it picked
    d_logits = d_logits + torch.zeros_like(d_logits).scatter_(-1, saved["at"], -d_logits.sum(-1, keepdim=True))
    d_scores = d_logits[..., :-1] * scale
    d_q = torch.matmul(d_scores, saved["kr"])
    d_kr = torch.matmul(d_scores.transpose(-1, -2), q)
    delta = outputs.empty((batch, hq, seq), dtype=torch.float32, device=q.device)
    torch.sum(do.float() * o.float(), dim=-1, out=delta)
    dq, dk, dv = (outputs.empty_strided(t.shape, heads_layout(t), dtype=t.dtype, device=t.device) for t in (q, k, v))
    dsinks = outputs.empty(sinks.shape, dtype=sinks.dtype, device=sinks.device)
    dq.copy_(d_q)
    dk.copy_(d_kr.view(batch, hkv, groups, seq, dim).sum(2))
    dv.copy_(d_vr.view(batch, hkv, groups, seq, dim).sum(2))
    dsinks.copy_(d_logits[..., -1:].sum((0, 2), keepdim=True).view(sinks.shape))
    return dq, dk, dv, delta, dsinks
