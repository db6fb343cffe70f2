"""Causal attention over a sliding window and packed documents, as operators with no mask tensor.

    window_attention(q [B, Hq, S, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv], scale, window, starts [B, S] or None,
                     kept [B, S] or None, sinks [Hq] or None, softcap, eager) -> (o [B, Hq, S, Dv], lse [B, Hq, S])
    window_attention_backward(do, q, k, v, o, lse, scale, window, starts, kept, softcap, eager)
        -> (dq, dk, dv, delta [B, Hq, S])
    window_attention_sinks_backward(do, q, k, v, o, lse, scale, window, starts, kept, sinks, softcap, eager)
        -> (dq, dk, dv, delta, dsinks [Hq])

Query i sees key j when i - window < j <= i (transformers' sliding_window_overlay over its causal
mask; a window of S or more is plain causal) and, given `starts`, the first key of each query's
document, when j >= starts[i] (transformers' packed-sequence mask: documents laid end to end in a
row, none seeing another) and, given `kept` (a 2D attention_mask, bool), when key j of the row is
kept: a query that then sees no key (left padding) gets o = 0 and no gradient, as torch's SDPA
gives it. Given `sinks` (GPT-OSS's attention sinks), each head's logit joins every row's softmax
with no value behind it: lse holds its share, so the backward of q, k and v is the same, and the
sinks' gradient, -sum over rows of exp(sink - lse) * delta, comes with it from the second backward
operator (kernels/attention_sinks.py). Given `softcap` (not 0; Gemma 2's logit softcapping), each
scaled score s becomes softcap * tanh(s / softcap) before the mask and the softmax. `eager` says the
model ran transformers' eager attention, not SDPA: only the cpu path reads it, to compute as that
did (host.py). Hq is a
multiple of Hkv (grouped-query heads); v's head dim may differ from q's and k's (DeepSeek's latent
attention: 192 and 128), which torch's flash kernels do not take, so its SDPA runs the math path
and holds [B, Hq, S, S] scores. Transformers expresses
such a layer as SDPA with a [B, 1, S, S] boolean mask, which the model builds once and every layer
turns into an additive one: 2 B S^2 bytes in bf16 per layer, 512 MiB at 16 x 4096, and past 100k
tokens more than any GPU holds (eager attention, as GPT-OSS runs, holds B Hq S^2 scores besides).
These operators carry a number and B S integers instead.

Results keep the layouts of the flash ops (o, dq, dk, dv as [B, S, H, D] memory viewed
[B, H, S, D]; lse float32 [B, Hq, S] in natural log), and delta = rowsum(do * o), the backward's one
temporary, is a result of its own, so the device arena places all of them: every path makes its
results through kernels/outputs.py. The paths, chosen when the graph runs:
  - bf16 or fp16 on a GPU, head dims up to 256: the Triton kernels of kernels/attention.py, which
    skip the key tiles outside the window (work grows with S * window, not S^2);
  - on the cpu: the op eager PyTorch runs for transformers' masked SDPA (host.py);
  - otherwise (float32 or wider heads on a GPU): a float32 reference over chunks of query rows
    (reference.py), each against the keys its rows see, so its scratch is a chunk's scores.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import CaptureError
from .host import backward_host, forward_host
from .reference import KERNEL_DTYPES, KERNEL_HEAD_DIM, backward_reference, forward_reference
from .seen import heads_layout


def _per_row(t: torch.Tensor | None, q: torch.Tensor, dtype_ok) -> bool:
    return t is None or (tuple(t.shape) == (q.shape[0], q.shape[2]) and dtype_ok(t.dtype))


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, starts: torch.Tensor | None,
           kept: torch.Tensor | None, sinks: torch.Tensor | None) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] \
            or q.shape[2:] != k.shape[2:] or q.shape[1] % k.shape[1] or window < 1 \
            or not _per_row(starts, q, lambda d: not d.is_floating_point and d != torch.bool) \
            or not _per_row(kept, q, lambda d: d == torch.bool) \
            or not (sinks is None or (tuple(sinks.shape) == (q.shape[1],) and sinks.dtype.is_floating_point)):
        def described(t):
            return None if t is None else (list(t.shape), t.dtype)
        raise CaptureError(f"window_attention takes q and k [B, Hq or Hkv, S, D], v [B, Hkv, S, Dv] with Hq a multiple of "
                           f"Hkv, a window of at least 1, integer document starts [B, S] or none, a bool [B, S] "
                           f"of kept keys or none and float sinks [Hq] or none; got q {list(q.shape)}, "
                           f"k {list(k.shape)}, v {list(v.shape)}, window {window}, starts {described(starts)}, "
                           f"kept {described(kept)}, sinks {described(sinks)}")


def _on_gpu(x: torch.Tensor) -> bool:
    return x.is_cuda


def uses_kernel(q: torch.Tensor) -> bool:
    """The Triton kernels run this call: half precision on a GPU, head dims they tile."""
    return _on_gpu(q) and q.dtype in KERNEL_DTYPES and q.shape[-1] <= KERNEL_HEAD_DIM


@torch.library.custom_op("megacompile::window_attention", mutates_args=())
def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int,
                     starts: Optional[torch.Tensor] = None, kept: Optional[torch.Tensor] = None,
                     sinks: Optional[torch.Tensor] = None, softcap: float = 0.0, eager: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    _check(q, k, v, window, starts, kept, sinks)
    if uses_kernel(q):
        from ..kernels.attention import attention_forward
        return attention_forward(q, k, v, True, scale, window=window, starts=starts, kept=kept, sinks=sinks,
                                 softcap=softcap)
    if not _on_gpu(q):
        return forward_host(q, k, v, scale, window, starts, kept, sinks, softcap, eager)
    return forward_reference(q, k, v, scale, window, starts, kept, sinks, softcap)


@window_attention.register_fake
def _window_attention_fake(q, k, v, scale, window, starts=None, kept=None, sinks=None, softcap=0.0, eager=False):
    _check(q, k, v, window, starts, kept, sinks)
    batch, hq, seq, _ = q.shape
    shape = (batch, hq, seq, v.shape[-1])
    return (torch.empty_strided(shape, heads_layout(shape), dtype=q.dtype, device=q.device),
            q.new_empty((batch, hq, seq), dtype=torch.float32))


@torch.library.custom_op("megacompile::window_attention_backward", mutates_args=())
def window_attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                              lse: torch.Tensor, scale: float, window: int, starts: Optional[torch.Tensor] = None,
                              kept: Optional[torch.Tensor] = None, softcap: float = 0.0, eager: bool = False
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if uses_kernel(q):
        from ..kernels.attention import attention_backward
        return attention_backward(do if do.stride(-1) == 1 else do.contiguous(), q, k, v, o, lse, True, scale,
                                  window=window, starts=starts, kept=kept, softcap=softcap)
    if not _on_gpu(q):
        return backward_host(do, q, k, v, o, lse, scale, window, starts, kept, softcap=softcap, eager=eager)
    return backward_reference(do, q, k, v, o, lse, scale, window, starts, kept, softcap)


@window_attention_backward.register_fake
def _window_attention_backward_fake(do, q, k, v, o, lse, scale, window, starts=None, kept=None, softcap=0.0,
                                    eager=False):
    batch, hq, seq, _ = q.shape
    return (torch.empty_strided(q.shape, heads_layout(q), dtype=q.dtype, device=q.device),
            torch.empty_strided(k.shape, heads_layout(k), dtype=k.dtype, device=k.device),
            torch.empty_strided(v.shape, heads_layout(v), dtype=v.dtype, device=v.device),
            q.new_empty((batch, hq, seq), dtype=torch.float32))


@torch.library.custom_op("megacompile::window_attention_sinks_backward", mutates_args=())
def window_attention_sinks_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                    o: torch.Tensor, lse: torch.Tensor, scale: float, window: int,
                                    starts: Optional[torch.Tensor], kept: Optional[torch.Tensor], sinks: torch.Tensor,
                                    softcap: float = 0.0, eager: bool = False
                                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if not _on_gpu(q):
        return backward_host(do, q, k, v, o, lse, scale, window, starts, kept, sinks, softcap, eager)
    # The lse holds the sinks' share: q, k and v get what they get without sinks.
    dq, dk, dv, delta = window_attention_backward(do, q, k, v, o, lse, scale, window, starts, kept, softcap)
    from ..kernels.attention_sinks import attention_sinks_backward      # any dtype: a reduction over rows
    return dq, dk, dv, delta, attention_sinks_backward(sinks, lse, delta)


@window_attention_sinks_backward.register_fake
def _window_attention_sinks_backward_fake(do, q, k, v, o, lse, scale, window, starts, kept, sinks, softcap=0.0,
                                          eager=False):
    return (*_window_attention_backward_fake(do, q, k, v, o, lse, scale, window, starts, kept),
            torch.empty_like(sinks, memory_format=torch.contiguous_format))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, scale, window, starts, kept, sinks, softcap, eager = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, starts, kept, sinks)
    ctx.scale, ctx.window, ctx.softcap, ctx.eager = scale, window, softcap, eager


def _backward(ctx, do: torch.Tensor, _dlse):
    q, k, v, o, lse, starts, kept, sinks = ctx.saved_tensors
    if sinks is None:
        dq, dk, dv, _ = window_attention_backward(do, q, k, v, o, lse, ctx.scale, ctx.window, starts, kept,
                                                  ctx.softcap, ctx.eager)
        return dq, dk, dv, None, None, None, None, None, None, None
    dq, dk, dv, _, dsinks = window_attention_sinks_backward(do, q, k, v, o, lse, ctx.scale, ctx.window, starts, kept,
                                                            sinks, ctx.softcap, ctx.eager)
    return dq, dk, dv, None, None, None, None, dsinks, None, None


window_attention.register_autograd(_backward, setup_context=_setup_context)
