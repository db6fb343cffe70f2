"""Hugging Face sliding-window layers under capture: a window as a number, no [B, 1, S, S] mask.

Transformers runs a sliding-window layer (Mistral, Qwen2 with use_sliding_window, Gemma 3's local
layers, Cohere 2, OLMo 3, EXAONE 4) through SDPA with a boolean mask the model builds once from its
mask function, i - window < j <= i: B S^2 bytes that stay on the device from the prologue to the last
backward, and the additive mask SDPA makes of it in every layer (2 B S^2 in bf16, which an explicit
mask also keeps off the flash kernels). At 16 x 4096 that is 256 + 512 MiB; at 128k tokens, 16 GiB
for the boolean alone.

While capturing, two entries of transformers' interfaces are replaced (and put back after):
  - the "sdpa" mask function: where the mask it is asked for is exactly a causal window over the
    whole sequence (no padding mask, no offsets, no overlay, no packed sequences: checked by
    evaluating the model's own mask function, not by reading its config), it returns a
    `SlidingWindow` that carries the window instead of building the mask;
  - the "sdpa" attention function: given a `SlidingWindow`, it records
    `megacompile::window_attention` (megacompile/attention/window.py), which needs no mask; what
    that operator does not compute (dropout, softcapping, attention sinks, a position bias, queries
    of another length) runs transformers' own SDPA path on the mask the window stands for, built
    in the layer.
Anything else goes to transformers' functions unchanged.
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

from ..attention import window as _registers_window_attention  # noqa: F401 - the operators the graphs call


@dataclass(frozen=True)
class SlidingWindow:
    """What a layer's attention_mask is while capturing: query i sees keys i - window < j <= i of
    `length` keys, for every row of a batch of `batch`."""
    window: int
    length: int
    batch: int

    def mask(self, device) -> torch.Tensor:
        """The [B, 1, S, S] boolean transformers would have built (True: attended)."""
        i = torch.arange(self.length, device=device)
        lag = i[:, None] - i[None, :]
        band = (lag >= 0) & (lag < self.window)
        return band.expand(self.batch, 1, self.length, self.length)


def _probe_rows(length: int, window: int) -> list[int]:
    """Query rows whose key patterns pin a window down: the edges of the band's first reach and
    of the sequence, and rows spread over the rest."""
    edges = {0, 1, 2, window - 2, window - 1, window, window + 1, 2 * window, length // 2, length - 2, length - 1}
    spread = {round(i * (length - 1) / 31) for i in range(32)}
    return sorted(r for r in edges | spread if 0 <= r < length)


def window_of(mask_function, batch: int, length: int) -> int | None:
    """The window w when `mask_function(b, h, i, j)` is True exactly for i - w < j <= i with w
    shorter than the sequence (checked on the last row, then on rows spread over the sequence and
    the first and last batch row); None for any other pattern, or one it cannot evaluate."""
    if length < 2:
        return None
    with unset_fake_temporarily(), disable_proxy_modes_tracing():
        keys = torch.arange(length)[None, :]

        def seen(b: int, rows: list[int]) -> torch.Tensor:
            out = mask_function(torch.tensor(b), torch.tensor(0), torch.tensor(rows)[:, None], keys)
            return torch.as_tensor(out).expand(len(rows), length)
        try:
            last = seen(0, [length - 1])[0]
            window = int(last.sum())
            if not 0 < window < length:
                return None
            rows = _probe_rows(length, window)
            lag = torch.tensor(rows)[:, None] - keys
            band = (lag >= 0) & (lag < window)
            if all(torch.equal(seen(b, rows), band) for b in {0, batch - 1}):
                return window
        except Exception:  # noqa: BLE001 - a mask function over traced values, or another kind: not a window
            return None
    return None


def _window_mask(original):
    def mask(batch_size, q_length=None, kv_length=None, q_offset=0, kv_offset=0, mask_function=None,
             attention_mask=None, **kwargs):
        plain = (attention_mask is None and mask_function is not None and q_offset == 0 and kv_offset == 0
                 and isinstance(q_length, int) and q_length == kv_length and isinstance(batch_size, int))
        window = window_of(mask_function, batch_size, kv_length) if plain else None
        if window is not None:
            return SlidingWindow(window, kv_length, batch_size)
        return original(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                        kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask, **kwargs)
    return mask


def _computes(module, query, key, value, window: SlidingWindow, dropout, is_causal, position_bias, kwargs) -> bool:
    """window_attention computes what transformers' SDPA path would on this call."""
    return (not dropout and position_bias is None and kwargs.get("softcap") is None and kwargs.get("s_aux") is None
            and is_causal is not False and getattr(module, "is_causal", True)
            and query.dim() == key.dim() == value.dim() == 4
            and query.shape[2] == key.shape[2] == value.shape[2] == window.length
            and query.shape[-1] == key.shape[-1] == value.shape[-1]
            and key.shape[1] == value.shape[1] and query.shape[1] % key.shape[1] == 0)


def _window_attention(original):
    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                  position_bias=None, **kwargs):
        if isinstance(attention_mask, SlidingWindow):
            window = attention_mask
            if _computes(module, query, key, value, window, dropout, is_causal, position_bias, kwargs):
                scale = query.shape[-1] ** -0.5 if scaling is None else scaling
                out, _lse = torch.ops.megacompile.window_attention(query, key, value, float(scale), window.window)
                return out.transpose(1, 2).contiguous(), None
            attention_mask = window.mask(query.device)
        return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                        is_causal=is_causal, position_bias=position_bias, **kwargs)
    return attention


@contextlib.contextmanager
def _replaced(module: str, interface: str, wrap):
    """While inside: `wrap(original)` is the "sdpa" entry of transformers' `module.interface` (a
    no-op where transformers or the entry is not loaded)."""
    mapping = getattr(type(getattr(sys.modules.get(module), interface, None)), "_global_mapping", {})
    original = mapping.get("sdpa")
    if original is None:
        yield
        return
    mapping["sdpa"] = wrap(original)
    try:
        yield
    finally:
        mapping["sdpa"] = original


def windowed_attention():
    """While capturing: transformers' "sdpa" attention takes a SlidingWindow mask."""
    return _replaced("transformers.modeling_utils", "ALL_ATTENTION_FUNCTIONS", _window_attention)


def sliding_windows_without_mask():
    """While tracing a model's forward: transformers' "sdpa" mask function returns a SlidingWindow
    for a plain causal window."""
    return _replaced("transformers.masking_utils", "ALL_MASK_ATTENTION_FUNCTIONS", _window_mask)
