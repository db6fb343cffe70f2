"""Transformers' eager attention where the operator stands for it: forward, and autograd's backward.

What eager PyTorch runs where the operator stands for it:
  - GPT-OSS (attention sinks): scores, plus the mask, the sinks concatenated as one more column,
    each row's maximum subtracted, softmax, the sink column dropped, times v;
  - Gemma 2 (logit softcapping): scores divided by the cap, tanh, times the cap, plus the mask,
    softmax in float32 cast back, times v;
  - any other model loaded with attn_implementation="eager" (Llama's eager function, which most
    copy): Gemma 2's sequence without the cap;
  - latent attention (DeepSeek, v's head dim not q's), which torch's cpu flash op does not take:
    SDPA's math path, q and k each scaled by the root of the scale, their product, plus the mask
    (-inf), `_safe_softmax` (0 for a row that sees nothing), times v.
On the cpu the operator runs these same ops (host.py), so a captured model trains as the eager one,
sum for sum; a model whose eager function differs from Llama's in other ways trains there within
rounding of it instead (the GPU paths compute the same math either way). A custom operator runs
below autograd, so the backward cannot call it: it runs the forward again and applies autograd's
formula for each op in reverse (matmul's two bmm's, softmax's `_softmax_backward_data`,
`tanh_backward`, the max's gradient landing on the column it picked).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def repeated(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Key/value heads repeated for each query head, as transformers' repeat_kv does."""
    if groups == 1:
        return t
    batch, heads, seq, dim = t.shape
    return t[:, :, None].expand(batch, heads, groups, seq, dim).reshape(batch, heads * groups, seq, dim)


def _probabilities(q, kr, scale: float, mask, sinks, softcap: float, math: bool, keep: dict):
    """The eager sequence up to the probabilities of the keys ([B, Hq, S, S]), and lse."""
    if math:
        root = _math_scale(scale)
        keep["q_scaled"], keep["k_scaled"] = q * root, kr * root
        scores = torch.matmul(keep["q_scaled"], keep["k_scaled"].transpose(-2, -1)) + mask
        probs = torch.ops.aten._safe_softmax(scores, -1)
        keep["probs"] = probs
        return probs, torch.logsumexp(scores.float(), dim=-1)
    scores = torch.matmul(q, kr.transpose(2, 3)) * scale
    if softcap:
        capped = torch.tanh(scores / softcap)
        keep["capped"] = capped
        scores = capped * softcap
    scores = scores + mask
    if sinks is None:
        probs = F.softmax(scores, dim=-1, dtype=torch.float32)
        keep["probs"] = probs
        return probs.to(q.dtype), torch.logsumexp(scores.float(), dim=-1)
    batch, _, seq, _ = q.shape
    logits = torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(batch, -1, seq, -1)], dim=-1)
    top, keep["at"] = logits.max(dim=-1, keepdim=True)
    logits = logits - top
    probs = F.softmax(logits, dim=-1, dtype=logits.dtype)
    keep["probs"] = probs
    return probs[..., :-1].to(q.dtype), top[..., 0].float() + torch.logsumexp(logits.float(), dim=-1)


def _math_scale(scale: float) -> float:
    """SDPA's math path scales q and k each by the root of the scale before their product."""
    return scale ** 0.5


def eager_forward(q, k, v, scale: float, mask: torch.Tensor, sinks=None, softcap: float = 0.0, keep=None,
                  math: bool = False):
    """(o [B, Hq, S, Dv], lse float32 [B, Hq, S]) of the eager sequence (`math`: SDPA's math path);
    into `keep`, what its backward reads."""
    keep = {} if keep is None else keep
    groups = q.shape[1] // k.shape[1]
    keep["kr"], keep["vr"] = repeated(k, groups), repeated(v, groups)
    probs, lse = _probabilities(q, keep["kr"], scale, mask, sinks, softcap, math, keep)
    keep["kept_probs"] = probs
    return torch.matmul(probs.to(v.dtype), keep["vr"]), lse


def eager_backward(do, q, k, v, scale: float, mask: torch.Tensor, sinks=None, softcap: float = 0.0,
                   math: bool = False):
    """[dq, dk, dv] (+ [dsinks] with sinks) of eager_forward, autograd's formulas one for one."""
    batch, hq, seq, dim = q.shape
    hkv = k.shape[1]
    saved: dict = {}
    eager_forward(q, k, v, scale, mask, sinks, softcap, saved, math)
    d_vr = torch.matmul(saved["kept_probs"].transpose(-1, -2), do)
    d_kept = torch.matmul(do, saved["vr"].transpose(-1, -2))
    probs = saved["probs"]
    if math:
        d_scores = torch._softmax_backward_data(d_kept, probs, -1, probs.dtype)
        root = _math_scale(scale)
        d_q = torch.matmul(d_scores, saved["k_scaled"]) * root
        d_kr = torch.matmul(saved["q_scaled"].transpose(-1, -2), d_scores).transpose(-1, -2) * root
        return [d_q, d_kr.reshape(batch, hkv, hq // hkv, seq, dim).sum(2),
                d_vr.reshape(batch, hkv, hq // hkv, seq, v.shape[-1]).sum(2)]
    if sinks is None:
        d_scores = torch._softmax_backward_data(d_kept.to(probs.dtype), probs, -1, probs.dtype).to(q.dtype)
    else:
        d_probs = torch.zeros_like(probs)
        d_probs[..., :-1] = d_kept
        d_logits = torch._softmax_backward_data(d_probs, probs, -1, probs.dtype)
        # logits - max: the max's gradient, -rowsum, lands on the column it picked
        d_logits = d_logits + torch.zeros_like(d_logits).scatter_(-1, saved["at"], -d_logits.sum(-1, keepdim=True))
        d_scores = d_logits[..., :-1]
        d_sinks = d_logits[..., -1:].sum((0, 2), keepdim=True).view(sinks.shape)
    if softcap:
        d_scores = torch.ops.aten.tanh_backward(d_scores * softcap, saved["capped"]) / softcap
    d_scores = d_scores * scale
    d_q = torch.matmul(d_scores, saved["kr"])
    d_kr = torch.matmul(q.transpose(-1, -2), d_scores).transpose(-1, -2)
    grads = [d_q, d_kr.reshape(batch, hkv, hq // hkv, seq, dim).sum(2),
             d_vr.reshape(batch, hkv, hq // hkv, seq, v.shape[-1]).sum(2)]
    return grads + ([d_sinks] if sinks is not None else [])
