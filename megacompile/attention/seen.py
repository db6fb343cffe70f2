"""Which keys a query sees under a causal band, packed documents and padding, and the results' layout.

A query i of row b sees key j when i - window < j <= i, j >= starts[b, i] (documents) and
kept[b, j] (padding); the host and reference paths build this from indices, a chunk at a time.
"""
from __future__ import annotations

import torch


def seen(rows: range, first_key: int, end: int, window: int, starts: torch.Tensor | None,
         kept: torch.Tensor | None, device) -> torch.Tensor:
    """[rows, keys first_key..end), or [B, 1, rows, keys] with documents or padding: which keys
    each row sees."""
    keys = torch.arange(first_key, end, device=device)
    lag = torch.arange(rows.start, rows.stop, device=device)[:, None] - keys[None, :]
    out = (lag >= 0) & (lag < window)
    if starts is not None:
        out = out & (keys[None, None, None, :] >= starts[:, None, rows.start:rows.stop, None])
    if kept is not None:
        out = out & kept[:, None, None, first_key:end]
    return out


def heads_layout(t) -> tuple[int, int, int, int]:
    """The flash ops' result layout ([B, S, H, D] memory viewed [B, H, S, D]) for a tensor or a
    shape, as the kernels make it."""
    from ..kernels.attention import heads_layout as layout
    return layout(*(t.shape if isinstance(t, torch.Tensor) else t))
