"""Captures shared within a scope: the same module called with inputs of the same shapes is
traced once. A run that plans before it trains (`megacompile train` choosing its budget and
micro-batch) captures each input shape once, and its engine takes those captures at its first
step instead of tracing again.

A capture reads the module's structure and the inputs' shapes and dtypes, and of values only the
image grids it takes as constants (grid_constants.py), so two calls alike in those give the same
capture. Inside the scope every capture is a training capture
(every block traced, as blocks_grouped_once would not): one the engine may run.
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from .grid_constants import grid_key

_SHARED: ContextVar[list | None] = ContextVar("megacompile_shared_captures", default=None)


@contextlib.contextmanager
def scope(memo: ContextVar):
    """Within: `memo` holds a list of what was made in the scope. Nested, the outer scope holds."""
    if memo.get() is not None:
        yield
        return
    token = memo.set([])
    try:
        yield
    finally:
        memo.reset(token)


def captures_shared():
    """Within: capture() returns the capture it made already for the same call."""
    return scope(_SHARED)


def active() -> bool:
    return _SHARED.get() is not None


def _call(model: nn.Module, args: tuple, kwargs: dict, device: torch.device, compute_dtype: torch.dtype,
          train: bool) -> tuple:
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    inputs = tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else ("const", repr(x)) for x in leaves)
    return model.training, str(spec), inputs, grid_key(kwargs), torch.device(device), compute_dtype, train


def lookup(model: nn.Module, args: tuple, kwargs: dict, device, compute_dtype, loss_fn, train: bool):
    """The capture made in this scope for this call, or None."""
    call = _call(model, args, kwargs, device, compute_dtype, train)
    return next((c for m, f, k, c in _SHARED.get() or () if m is model and f is loss_fn and k == call), None)


def keep(model: nn.Module, args: tuple, kwargs: dict, device, compute_dtype, loss_fn, train: bool, captured) -> None:
    _SHARED.get().append((model, loss_fn, _call(model, args, kwargs, device, compute_dtype, train), captured))
