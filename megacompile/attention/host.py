"""Sliding-window attention on the cpu: what eager PyTorch runs for the layer transformers would run.

Without sinks or softcapping, transformers' masked SDPA: _scaled_dot_product_flash_attention_for_cpu
and its backward, with the key/value heads repeated as transformers' repeat_kv does and the
additive [S, S] mask made inside; where v's head dim differs from q's (latent attention), which
that op does not take, SDPA's math path, as eager runs it (eager.py). Where the model ran its eager
attention (`eager`; sinks and softcapping exist only there), that sequence (eager.py), over the
additive mask eager's mask function makes (0, or the dtype's lowest). Either way a captured model
trains as the eager one does, sum for sum.
"""
from __future__ import annotations

import torch

from .eager import eager_backward, eager_forward, repeated as _repeated
from .seen import heads_layout, seen


def _additive_mask(seq: int, window: int, starts: torch.Tensor | None, kept: torch.Tensor | None,
                   dtype: torch.dtype, device, lowest: float = float("-inf")) -> torch.Tensor:
    """[1 or B, 1, S, S]: 0 where a query sees a key, `lowest` elsewhere (-inf: what SDPA makes of a
    boolean mask; the dtype's lowest: eager's)."""
    mask = seen(range(0, seq), 0, seq, window, starts, kept, device)
    mask = mask.expand(1, 1, seq, seq) if mask.dim() == 2 else mask
    return torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, lowest)


def _latent(q, v) -> bool:
    """v's head dim differs from q's (latent attention): torch's cpu flash op does not take it."""
    return q.shape[-1] != v.shape[-1]


def _sequence(q, v, sinks, softcap: float, eager: bool) -> str:
    """What eager PyTorch ran: a model's eager attention ("eager": sinks and softcapping exist only
    there), SDPA's math path ("math": latent attention, which the cpu flash op does not take), or
    the cpu flash op ("flash")."""
    if eager or sinks is not None or softcap:
        return "eager"
    return "math" if _latent(q, v) else "flash"


def _mask_of(q, window, starts, kept, sequence: str) -> torch.Tensor:
    """The additive mask the sequence adds: SDPA's -inf, or eager's the dtype's lowest."""
    lowest = float("-inf") if sequence == "math" else torch.finfo(q.dtype).min
    return _additive_mask(q.shape[2], window, starts, kept, q.dtype, q.device, lowest)


def forward_host(q, k, v, scale: float, window: int, starts=None, kept=None, sinks=None, softcap: float = 0.0,
                 eager: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    from ..kernels import outputs
    sequence = _sequence(q, v, sinks, softcap, eager)
    if sequence != "flash":
        o_made, lse_made = eager_forward(q, k, v, scale, _mask_of(q, window, starts, kept, sequence),
                                         sinks, softcap, math=sequence == "math")
        o = outputs.empty_strided(o_made.shape, heads_layout(o_made), dtype=q.dtype, device=q.device)
        lse = outputs.empty(lse_made.shape, dtype=torch.float32, device=q.device)
        return o.copy_(o_made), lse.copy_(lse_made)
    groups = q.shape[1] // k.shape[1]
    made, lse_made = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, _repeated(k, groups), _repeated(v, groups), 0.0, False,
        attn_mask=_additive_mask(q.shape[2], window, starts, kept, q.dtype, q.device), scale=scale)
    o = outputs.empty_strided(q.shape, heads_layout(q), dtype=q.dtype, device=q.device)
    lse = outputs.empty(lse_made.shape, dtype=torch.float32, device=q.device)
    return o.copy_(made), lse.copy_(lse_made)


def backward_host(do, q, k, v, o, lse, scale: float, window: int, starts=None, kept=None, sinks=None,
                  softcap: float = 0.0, eager: bool = False):
    """(dq, dk, dv, delta), and dsinks after them where there are sinks."""
    from ..kernels import outputs
    sequence = _sequence(q, v, sinks, softcap, eager)
    if sequence != "flash":
        grads = eager_backward(do, q, k, v, scale, _mask_of(q, window, starts, kept, sequence), sinks,
                               softcap, math=sequence == "math")
        delta = outputs.empty(lse.shape, dtype=torch.float32, device=q.device)
        torch.sum(do.float() * o.float(), dim=-1, out=delta)
        results = [outputs.empty_strided(t.shape, heads_layout(t), dtype=t.dtype, device=t.device) for t in (q, k, v)]
        made = [r.copy_(g) for r, g in zip(results, grads)] + [delta]
        if sinks is not None:
            made.append(outputs.empty(sinks.shape, dtype=sinks.dtype, device=sinks.device).copy_(grads[3]))
        return tuple(made)
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
