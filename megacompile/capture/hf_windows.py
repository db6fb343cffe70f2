"""Hugging Face attention spans under capture: a window and documents as numbers, no [B, 1, S, S] mask.

Transformers runs a sliding-window layer (Mistral, Qwen2 with use_sliding_window, Gemma 3's local
layers, Cohere 2, OLMo 3, EXAONE 4, GPT-OSS), any layer of a model given position_ids that may pack
several documents in a row, any layer of a model given a 2D attention_mask (padding), and every
layer of a model whose attention is eager (GPT-OSS, Gemma 2), with a mask the model builds once from
its mask function: B S^2 bytes (bool for SDPA, the compute dtype for eager) that stay on the device
from the prologue to the last backward, and the additive mask SDPA makes of it in every layer (2 B
S^2 in bf16, which an explicit mask also keeps off the flash kernels). At 16 x 4096 that is
256 + 512 MiB; at 128k tokens, 16 GiB for the boolean alone. Eager attention holds B Hq S^2 scores
and probabilities besides: 4 GiB a layer for GPT-OSS-120B's 64 heads at 4096 tokens.

While capturing, transformers' "sdpa" and "eager" mask functions, its "sdpa" attention function and
the eager one each model names as its default are replaced (and put back after), and so are the
three mask-function factories a packed-sequence mask is made of (`and_masks`,
`remap_positions_for_packed_sequence`, `packed_sequence_mask_function`), by ones that call the
originals and remember their parts:
  - where the mask asked for is exactly a causal band over the whole sequence (checked by
    evaluating the model's own mask function on real indices, not by reading its config),
    optionally intersected with the packed-sequence mask of the position_ids or with a [B, S]
    padding mask, and there is no offset, the mask function returns an `AttentionSpan`
    (attention_span.py): the window, for packed documents the first key of each query's document
    ([B, S] integers computed in the trace from transformers' own sequence indices), for padding the
    attention_mask itself;
  - the attention function records `megacompile::window_attention` (megacompile/attention/
    window.py) for an `AttentionSpan`, with the layer's attention sinks (`s_aux`) and logit
    softcapping if it has them; what that operator does not compute (dropout, a position bias,
    queries of another length) runs transformers' own function on the mask the span stands for,
    built in the layer, as does model code that reads the mask as a tensor (attention_span.py);
  - with no mask at all, SDPA's plain causal attention whose v is narrower than q and k
    (DeepSeek's latent attention, which torch's flash kernels do not take, so SDPA would run its
    math path and hold S x S) records the same operator over the whole sequence.
Anything else (overlays such as Gemma 3's bidirectional image spans, chunked attention, a mask
of another shape) goes to transformers' functions unchanged.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

from ..attention import window as _registers_window_attention  # noqa: F401 - the operators the graphs call
from .attention_span import AttentionSpan


class _Parts:
    """A mask function as transformers' factory made it, with what it was made of."""

    def __init__(self, kind: str, function, parts: tuple) -> None:
        self.kind, self.function, self.parts = kind, function, parts

    def __call__(self, *args):
        return self.function(*args)


def _probe_rows(length: int, window: int) -> list[int]:
    """Query rows whose key patterns pin a window down: the edges of the band's first reach and
    of the sequence, and rows spread over the rest."""
    edges = {0, 1, 2, window - 2, window - 1, window, window + 1, 2 * window, length // 2, length - 2, length - 1}
    spread = {round(i * (length - 1) / 31) for i in range(32)}
    return sorted(r for r in edges | spread if 0 <= r < length)


def band_of(mask_function, batch: int, length: int) -> int | None:
    """The w when `mask_function(b, h, i, j)` is True exactly for i - w < j <= i (w = length: plain
    causal), checked on the last row, then on rows spread over the sequence and the first and last
    batch row; None for any other pattern, or one it cannot evaluate (it reads traced values)."""
    if length < 2:
        return None
    with unset_fake_temporarily(), disable_proxy_modes_tracing():
        keys = torch.arange(length)[None, :]

        def seen(b: int, rows: list[int]) -> torch.Tensor:
            out = mask_function(torch.tensor(b), torch.tensor(0), torch.tensor(rows)[:, None], keys)
            return torch.as_tensor(out).expand(len(rows), length)
        try:
            window = int(seen(0, [length - 1])[0].sum())
            if not 0 < window <= length:
                return None
            rows = _probe_rows(length, window)
            lag = torch.tensor(rows)[:, None] - keys
            band = (lag >= 0) & (lag < window)
            if all(torch.equal(seen(b, rows), band) for b in {0, batch - 1}):
                return window
        except Exception:  # noqa: BLE001 - a mask function over traced values, or another kind: not a band
            return None
    return None


def window_of(mask_function, batch: int, length: int) -> int | None:
    """band_of's window where it is shorter than the sequence (a sliding window), else None."""
    window = band_of(mask_function, batch, length)
    return window if window is not None and window < length else None


def _packed(mask_function) -> tuple[Any, torch.Tensor] | None:
    """(the band function, transformers' sequence index per token [B, S]) when `mask_function` is
    transformers' packed-sequence mask: a band function, and-ed with "same sequence"; None
    otherwise. Later releases read the band at the tokens' positions (remapped), 5.17 at the
    tokens' indices; within one sequence the positions go up by one, so both are the same band."""
    if not (isinstance(mask_function, _Parts) and mask_function.kind == "and" and len(mask_function.parts) == 2):
        return None
    band, same = mask_function.parts
    if not (isinstance(same, _Parts) and same.kind == "packed"):
        return None
    if isinstance(band, _Parts) and band.kind == "remap":
        return band.parts[0], same.parts[0]
    return None if isinstance(band, _Parts) and band.kind == "packed" else (band, same.parts[0])


def document_starts(sequence_index: torch.Tensor) -> torch.Tensor:
    """[B, S] int32: the first token of each token's sequence, from transformers' sequence index
    (non-decreasing along a row: a new sequence where the positions do not go up by one). Within
    a sequence the positions go up by one, so a band over positions is the same band over tokens."""
    seq = sequence_index.shape[1]
    new = torch.cat([torch.ones_like(sequence_index[:, :1], dtype=torch.bool),
                     sequence_index[:, 1:] != sequence_index[:, :-1]], dim=1)
    tokens = torch.arange(seq, device=sequence_index.device).expand_as(sequence_index)
    return torch.where(new, tokens, torch.zeros_like(tokens)).cummax(dim=1).values.to(torch.int32)


def _span(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
          dtype: torch.dtype | None, device) -> AttentionSpan | None:
    """The span the mask asked for stands for, or None. `dtype` None: SDPA's boolean mask (which
    transformers skips for a plain causal band with no padding: is_causal); else eager's additive
    mask of that dtype, which it always builds."""
    if not (mask_function is not None and q_offset == 0 and kv_offset == 0
            and isinstance(q_length, int) and q_length == kv_length and isinstance(batch_size, int)):
        return None
    rows = (batch_size, kv_length)
    if attention_mask is not None and not (isinstance(attention_mask, torch.Tensor)
                                           and attention_mask.dtype == torch.bool
                                           and tuple(attention_mask.shape) == rows):
        return None
    made = dict(dtype=dtype or torch.bool, device=device)
    packed = _packed(mask_function)
    if packed is not None:
        band, sequence_index = packed
        window = band_of(band, batch_size, kv_length)
        if window is None or tuple(sequence_index.shape) != rows:
            return None
        return AttentionSpan(window, kv_length, batch_size, document_starts(sequence_index), attention_mask, **made)
    # With padding, or eager's mask, even a plain causal band needs the span; else a plain one needs no mask.
    window = band_of(mask_function, batch_size, kv_length) if attention_mask is not None or dtype is not None \
        else window_of(mask_function, batch_size, kv_length)
    return None if window is None else AttentionSpan(window, kv_length, batch_size, kept=attention_mask, **made)


def _span_mask(original, additive: bool):
    def mask(batch_size, q_length=None, kv_length=None, q_offset=0, kv_offset=0, mask_function=None,
             attention_mask=None, **kwargs):
        dtype = kwargs.get("dtype", torch.float32) if additive else None
        span = _span(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                     dtype, kwargs.get("device"))
        if span is not None:
            return span
        return original(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                        kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask, **kwargs)
    return mask


def _computes(module, query, key, value, length: int, kwargs) -> bool:
    """window_attention computes what transformers' attention function would on this call, over
    `length` keys."""
    sinks, softcap = kwargs.get("s_aux"), kwargs.get("softcap")
    return (not kwargs.get("dropout") and kwargs.get("position_bias") is None
            and (softcap is None or (isinstance(softcap, (int, float)) and softcap > 0))
            and (sinks is None or (isinstance(sinks, torch.Tensor) and tuple(sinks.shape) == (query.shape[1],)))
            and kwargs.get("is_causal") is not False and getattr(module, "is_causal", True)
            and query.dim() == key.dim() == value.dim() == 4
            and query.shape[2] == key.shape[2] == value.shape[2] == length
            and query.shape[-1] == key.shape[-1]
            and key.shape[1] == value.shape[1] and query.shape[1] % key.shape[1] == 0)


def _span_attention(original, eager: bool = False):
    """transformers' attention function `original` ("sdpa", or a model's `eager` one), taking a span.

    A model's eager function applies the sinks (`s_aux`) and the softcap it is given; transformers'
    "sdpa" one does not (5.17 drops them, later releases raise on a softcap), so an "sdpa" call
    given either runs the original, whatever it does with them."""
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        span = attention_mask
        if span is None and _latent(query, value) and query.dim() == 4:
            # Plain causal attention whose v is narrower than q and k (DeepSeek's latent attention):
            # torch's flash kernels do not take it, so SDPA would run its math path, S x S.
            span = AttentionSpan(query.shape[2], query.shape[2], query.shape[0], device=query.device)
        extras = kwargs.get("s_aux") is not None or kwargs.get("softcap") is not None
        if isinstance(span, AttentionSpan):
            if not args and (eager or not extras) and _computes(module, query, key, value, span.length, kwargs):
                scaling = kwargs.get("scaling")
                scale = query.shape[-1] ** -0.5 if scaling is None else scaling
                out, _lse = torch.ops.megacompile.window_attention(query, key, value, float(scale), span.window,
                                                                   span.starts, span.kept, kwargs.get("s_aux"),
                                                                   float(kwargs.get("softcap") or 0.0),
                                                                   span.dtype != torch.bool)   # eager's mask
                return out.transpose(1, 2).contiguous(), None
            if attention_mask is not None:
                attention_mask = span.mask(query.device)
        return original(module, query, key, value, attention_mask, *args, **kwargs)
    return attention


def _latent(query, value) -> bool:
    return query.shape[-1] != value.shape[-1]


@contextlib.contextmanager
def _replaced(module: str, interface: str, name: str, wrap):
    """While inside: `wrap(original)` is the `name` entry of transformers' `module.interface` (a
    no-op where transformers or the entry is not loaded)."""
    mapping = getattr(type(getattr(sys.modules.get(module), interface, None)), "_global_mapping", {})
    original = mapping.get(name)
    if original is None:
        yield
        return
    mapping[name] = wrap(original)
    try:
        yield
    finally:
        mapping[name] = original


@contextlib.contextmanager
def _eager_replaced():
    """While inside: a model's own eager attention function, which it names as the default of
    `ALL_ATTENTION_FUNCTIONS.get_interface("eager", ...)` (every transformers decoder that has one),
    takes a span."""
    interface = getattr(sys.modules.get("transformers.modeling_utils"), "ALL_ATTENTION_FUNCTIONS", None)
    original = getattr(interface, "get_interface", None)
    if original is None:
        yield
        return

    def get_interface(attn_implementation, default):
        found = original(attn_implementation, default)
        return _span_attention(found, eager=True) if attn_implementation == "eager" else found
    interface.get_interface = get_interface           # the instance's, over its class's
    try:
        yield
    finally:
        del interface.get_interface


@contextlib.contextmanager
def span_attention():
    """While capturing: transformers' "sdpa" attention and every model's eager one take an AttentionSpan mask."""
    with _replaced("transformers.modeling_utils", "ALL_ATTENTION_FUNCTIONS", "sdpa", _span_attention), \
            _eager_replaced():
        yield


@contextlib.contextmanager
def _span_masks():
    with _replaced("transformers.masking_utils", "ALL_MASK_ATTENTION_FUNCTIONS", "sdpa",
                   lambda original: _span_mask(original, additive=False)), \
            _replaced("transformers.masking_utils", "ALL_MASK_ATTENTION_FUNCTIONS", "eager",
                      lambda original: _span_mask(original, additive=True)):
        yield


_FACTORIES = {"and_masks": "and", "remap_positions_for_packed_sequence": "remap",
              "packed_sequence_mask_function": "packed"}
_OPTIONAL_FACTORIES = {"remap_positions_for_packed_sequence"}      # not in transformers 5.17


@contextlib.contextmanager
def spans_without_mask():
    """While tracing a model's forward: transformers' "sdpa" and "eager" mask functions return an
    AttentionSpan for a causal band, within packed documents or not."""
    masking = sys.modules.get("transformers.masking_utils")
    factories = {name: getattr(masking, name, None) for name in _FACTORIES}
    factories = {name: f for name, f in factories.items() if f is not None or name not in _OPTIONAL_FACTORIES}
    if masking is None or None in factories.values():
        with _span_masks():
            yield
        return

    def remembering(name, factory):
        return lambda *parts: _Parts(_FACTORIES[name], factory(*parts), parts)
    for name, factory in factories.items():
        setattr(masking, name, remembering(name, factory))
    try:
        with _span_masks():
            yield
    finally:
        for name, factory in factories.items():
            setattr(masking, name, factory)
