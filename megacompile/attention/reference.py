"""Sliding-window attention in float32 over chunks of query rows: where the kernels do not run on a GPU.

float32 inputs, or head dims past the kernels' 256. Each chunk of CHUNK query rows meets only the
keys its rows can see, so the scratch is a chunk's scores, never [S, S]; the plan reserves it
(`reference_scratch_bytes`, cost/reserve.py). A sink joins each row's log-sum-exp as one more logit;
softcapping caps each scaled score to softcap * tanh(s / softcap) first.
"""
from __future__ import annotations

import torch

from .seen import heads_layout, seen

# Query rows per step: its scores are [B, Hq, CHUNK, CHUNK + window - 1] in fp32.
CHUNK = 256
KERNEL_DTYPES = (torch.bfloat16, torch.float16)
KERNEL_HEAD_DIM = 256


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


def _chunks(seq: int, window: int):
    """(query rows, first key they see) per chunk."""
    for start in range(0, seq, CHUNK):
        rows = range(start, min(seq, start + CHUNK))
        yield rows, max(0, start - window + 1)


def _grouped(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t.float().repeat_interleave(groups, dim=1)


def _scores(q, kf, scale: float, softcap: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The scaled scores of a chunk's rows, capped to softcap * tanh(s / softcap) where it is not 0,
    and the tanh (for the backward) or None."""
    scores = (q.float() @ kf.transpose(-1, -2)) * scale
    if not softcap:
        return scores, None
    capped = torch.tanh(scores / softcap)
    return capped * softcap, capped


def forward_reference(q, k, v, scale: float, window: int, starts=None, kept=None, sinks=None, softcap: float = 0.0
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    from ..kernels import outputs
    batch, hq, seq, dim = q.shape
    shape = (batch, hq, seq, v.shape[-1])
    o = outputs.empty_strided(shape, heads_layout(shape), dtype=q.dtype, device=q.device)
    lse = outputs.empty((batch, hq, seq), dtype=torch.float32, device=q.device)
    kf, vf = _grouped(k, hq // k.shape[1]), _grouped(v, hq // k.shape[1])
    for rows, first in _chunks(seq, window):
        end = rows.stop
        s, _ = _scores(q[:, :, rows.start:end], kf[:, :, first:end], scale, softcap)
        s.masked_fill_(~seen(rows, first, end, window, starts, kept, q.device), float("-inf"))
        m = torch.logsumexp(s, dim=-1)
        if sinks is not None:
            m = torch.logaddexp(m, sinks.float()[None, :, None])
        shift = m.masked_fill(m == float("-inf"), 0.0)       # a row that sees no key: o = 0, lse -inf
        o[:, :, rows.start:end] = (torch.exp(s - shift[..., None]) @ vf[:, :, first:end]).to(q.dtype)
        lse[:, :, rows.start:end] = m
    return o, lse


def backward_reference(do, q, k, v, o, lse, scale: float, window: int, starts=None, kept=None, softcap: float = 0.0):
    from ..kernels import outputs
    batch, hq, seq, dim = q.shape
    hkv = k.shape[1]
    groups = hq // hkv
    delta = outputs.empty((batch, hq, seq), dtype=torch.float32, device=q.device)
    dq = outputs.empty_strided(q.shape, heads_layout(q), dtype=q.dtype, device=q.device)
    dk = outputs.empty_strided(k.shape, heads_layout(k), dtype=k.dtype, device=k.device)
    dv = outputs.empty_strided(v.shape, heads_layout(v), dtype=v.dtype, device=v.device)
    torch.sum(do.float() * o.float(), dim=-1, out=delta)
    kf, vf = _grouped(k, groups), _grouped(v, groups)
    dk_heads = torch.zeros(batch, hq, seq, dim, dtype=torch.float32, device=q.device)   # per query head
    dv_heads = torch.zeros(batch, hq, seq, v.shape[-1], dtype=torch.float32, device=q.device)
    for rows, first in _chunks(seq, window):
        end = rows.stop
        qc, doc = q[:, :, rows.start:end].float(), do[:, :, rows.start:end].float()
        s, capped = _scores(qc, kf[:, :, first:end], scale, softcap)
        p = torch.exp(s - lse[:, :, rows.start:end, None])
        p.masked_fill_(~seen(rows, first, end, window, starts, kept, q.device), 0.0)
        dv_heads[:, :, first:end] += p.transpose(-1, -2) @ doc
        ds = p * (doc @ vf[:, :, first:end].transpose(-1, -2) - delta[:, :, rows.start:end, None])
        if capped is not None:
            ds = ds * (1 - capped * capped)
        dq[:, :, rows.start:end] = (ds @ kf[:, :, first:end] * scale).to(q.dtype)
        dk_heads[:, :, first:end] += ds.transpose(-1, -2) @ qc * scale
    dk.copy_(dk_heads.view(batch, hkv, groups, seq, dim).sum(2))
    dv.copy_(dv_heads.view(batch, hkv, groups, seq, v.shape[-1]).sum(2))
    return dq, dk, dv, delta

