"""What a layer's attention mask is while capturing: a causal band, documents and padding as numbers.

Transformers builds a [B, 1, S, S] mask in the prologue and hands it to every layer; under capture
the mask functions return an `AttentionSpan` instead (hf_windows.py), which the attention interface
turns into megacompile::window_attention. Model code that treats the mask as a tensor (adds it to
its scores, slices it, reads its shape) gets the mask it stands for, made where it is read: every
torch function and tensor attribute of a span goes to that mask, so such a model traces as it
would have, only with the mask built in the layer rather than carried from the prologue.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree


@dataclass(frozen=True, eq=False)
class AttentionSpan:
    """Query i of `length` sees keys max(i - window + 1, starts[b, i]) <= j <= i (starts None: from
    0) that kept[b, j] keeps (kept None: all), for each row b of `batch`. `dtype` is the mask's
    transformers would have made: bool (SDPA's: True where seen) or a float type (eager's: 0 where
    seen, the type's lowest elsewhere); `device` is where."""
    window: int
    length: int
    batch: int
    starts: torch.Tensor | None = None
    kept: torch.Tensor | None = None
    dtype: torch.dtype = torch.bool
    device: torch.device | str | None = None

    def seen(self, device=None) -> torch.Tensor:
        """[B, 1, S, S] bool: True where a query sees a key."""
        keys = torch.arange(self.length, device=device if device is not None else self.device)
        lag = keys[:, None] - keys[None, :]
        seen = ((lag >= 0) & (lag < self.window)).expand(self.batch, 1, self.length, self.length)
        if self.starts is not None:
            seen = seen & (keys[None, None, None, :] >= self.starts[:, None, :, None])
        if self.kept is not None:
            seen = seen & self.kept[:, None, None, :]
        return seen

    def mask(self, device=None) -> torch.Tensor:
        """The [B, 1, S, S] mask transformers would have built, in its dtype."""
        seen = self.seen(device)
        if self.dtype == torch.bool:
            return seen
        return torch.where(seen, torch.zeros((), device=seen.device, dtype=self.dtype), torch.finfo(self.dtype).min)

    # -- a span read as a tensor is its mask --------------------------------------------------

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def as_mask(tree):    # a span is a pytree node of its own: stop at it, not at its tensors
            return pytree.tree_map(lambda a: a.mask() if isinstance(a, AttentionSpan) else a, tree,
                                   is_leaf=lambda a: isinstance(a, AttentionSpan))
        return func(*as_mask(args), **as_mask(kwargs or {}))

    def __getattr__(self, name: str):
        if name.startswith("__"):                      # copy, pickle and the like: not a tensor's
            raise AttributeError(name)
        return getattr(self.mask(), name)

    def __getitem__(self, index):
        return self.mask()[index]


# The starts and kept keys are tensors the blocks read: the span flattens to them, so a block call
# takes them as inputs.
pytree.register_pytree_node(
    AttentionSpan,
    lambda s: ([s.starts, s.kept], (s.window, s.length, s.batch, s.dtype, s.device)),
    lambda children, context: AttentionSpan(*context[:3], *children, *context[3:]),
    serialized_type_name="megacompile.capture.attention_span.AttentionSpan")
