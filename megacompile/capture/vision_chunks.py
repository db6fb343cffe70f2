"""Qwen's vision attention over its chunks, one attention call per chunk length instead of per chunk.

The vision tower of Qwen2.5-VL, Qwen3-VL and Qwen3.5 attends within chunks of its patches: each
image (each video frame) in its full-attention layers, each window of merged patches in Qwen2.5-VL's
windowed layers. Its attention module splits the patches by the chunks' lengths
(`torch.split(..., lengths.tolist())`) and calls the attention function once per chunk, so a trace
holds an attention call per chunk per layer: 16 windows of an image of 448 x 448 px in each of 28
windowed layers of a Qwen2.5-VL-7B. Those calls were about half the time a new set of image sizes
took to capture and plan (benchmarks/image_replan.py: 10.2-13.4 s with them, 5.1-7.3 s batched by
length), and each is a small kernel of its own on a GPU.

While capturing, such an attention module is handed the whole sequence as one chunk (`cu_seqlens`
[0, N]), and the attention function it asks transformers for (whatever its config names: sdpa, eager)
runs once per distinct chunk length, over the chunks of that length stacked as a batch
([chunks, heads, length, head_dim]). What attends to what is unchanged, and the same function
computes each chunk; chunks of one length that are not adjacent are gathered by slicing and put back
in order after, so the graph holds no index tensor (a constant of many elements would keep the
blocks that read it from sharing a template). The lengths are the tables' constants the tower was
given (grid_constants.py): only host arrays of numbers are taken, any other `cu_seqlens` runs the
model's own code. A module handed one chunk that does not then call its attention function once
over all its patches (a release that builds a mask from cu_seqlens, say) would attend across the
chunks: it is refused with a CaptureError instead.
"""
from __future__ import annotations

import contextlib
import inspect
import sys

import numpy
import torch
import torch.nn as nn

from ..errors import CaptureError

_ABSENT = object()


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    """The vision tower's attention modules that split by `cu_seqlens`, in the models whose grids
    are constants of the capture."""
    from .grid_constants import keys_grids
    found = []
    for module in model.modules():
        blocks = getattr(getattr(module, "visual", None), "blocks", None) if keys_grids(module) else None
        for block in blocks or ():
            attn = getattr(block, "attn", None)
            if attn is not None and "cu_seqlens" in inspect.signature(type(attn).forward).parameters:
                found.append(attn)
    return found


@contextlib.contextmanager
def batched_chunks(model: nn.Module):
    """While inside: the vision tower's attention runs once per chunk length (see the module's doc)."""
    modules = _attention_modules(model)
    own = [(m, m.__dict__.get("forward", _ABSENT)) for m in modules]
    for m in modules:
        m.forward = _one_call_per_length(m.forward)
    try:
        yield
    finally:
        for m, forward in own:
            if forward is _ABSENT:
                m.__dict__.pop("forward", None)
            else:
                m.forward = forward


def chunk_lengths(cu_seqlens) -> list[int] | None:
    """The chunks' lengths from cumulative ones given as numbers (a host array or a list), empty
    chunks left out; None for anything else (a tensor: its values are not ours to read here)."""
    if not isinstance(cu_seqlens, (numpy.ndarray, list, tuple)):
        return None
    bounds = [int(x) for x in numpy.asarray(cu_seqlens).reshape(-1).tolist()]
    return [b - a for a, b in zip(bounds, bounds[1:]) if b > a]


def _one_call_per_length(forward):
    def run(hidden_states, *args, **kwargs):
        named = "cu_seqlens" in kwargs
        cu_seqlens = kwargs["cu_seqlens"] if named else (args[0] if args else None)
        lengths = chunk_lengths(cu_seqlens)
        total = hidden_states.shape[0]
        interface = getattr(sys.modules.get("transformers.modeling_utils"), "ALL_ATTENTION_FUNCTIONS", None)
        if lengths is None or sum(lengths) != total or len(lengths) < 2 or interface is None:
            return forward(hidden_states, *args, **kwargs)
        whole = numpy.asarray([0, total], dtype=numpy.asarray(cu_seqlens).dtype)
        if named:
            kwargs["cu_seqlens"] = whole
        else:
            args = (whole,) + args[1:]
        with _attention_by_length(interface, lengths) as ran:
            out = forward(hidden_states, *args, **kwargs)
        # Handed one chunk, the module must have called its attention function once over all of
        # its patches, which ran per chunk length; anything else attended across the chunks.
        if ran != [True]:
            module = type(getattr(forward, "__self__", forward)).__name__
            raise CaptureError(f"{module}: this transformers release's vision attention did not call its attention "
                               f"function once over its patches (calls batched by chunk length: {ran}), the way "
                               "megacompile runs it chunk by chunk; train it with a transformers release whose "
                               "vision attention splits its patches by cu_seqlens and calls the function per chunk "
                               "(5.17 to 5.24)")
        return out
    return run


@contextlib.contextmanager
def _attention_by_length(interface, lengths: list[int]):
    """While inside: the attention functions transformers hands out run per chunk length; yields
    a list that gets True for each call so run, False for each run as given."""
    own = interface.__dict__.get("get_interface", _ABSENT)
    current = interface.get_interface
    ran: list[bool] = []

    def get_interface(attn_implementation, default):
        return by_length(current(attn_implementation, default), lengths, ran)
    interface.get_interface = get_interface
    try:
        yield ran
    finally:
        if own is _ABSENT:
            del interface.get_interface
        else:
            interface.get_interface = own


def by_length(attention, lengths: list[int], ran: list[bool] | None = None):
    """transformers' attention function `attention`, run over [1, heads, sum(lengths), head_dim]
    queries, keys and values as over each chunk on its own: once per distinct length, the chunks of
    that length as a batch. Anything else (a mask, queries of another shape) runs it as given.
    `ran` gets True for each call batched, False for each run as given."""
    def run(module, query, key, value, attention_mask, *args, **kwargs):
        total = sum(lengths)
        batched = attention_mask is None and not args and all(t.dim() == 4 and t.shape[0] == 1 and t.shape[2] == total
                                                              for t in (query, key, value))
        if ran is not None:
            ran.append(batched)
        if not batched:
            return attention(module, query, key, value, attention_mask, *args, **kwargs)
        runs = _runs(lengths)
        groups: dict[int, list[int]] = {}               # length -> its runs, in order
        for r, (_, n, _) in enumerate(runs):
            groups.setdefault(n, []).append(r)
        outputs, placed = [], {}
        for n, members in groups.items():
            q, k, v = (_stacked(t, [runs[r] for r in members]) for t in (query, key, value))
            out = attention(module, q, k, v, None, **kwargs)[0]        # [chunks, n, heads, head_dim]
            out = out.reshape(-1, *out.shape[2:])                      # the runs' positions, in order
            at = 0
            for r in members:
                placed[r] = out.narrow(0, at, runs[r][1] * runs[r][2]) if len(members) > 1 else out
                at += runs[r][1] * runs[r][2]
            outputs.append(out)
        if len(groups) == 1:
            return outputs[0].unsqueeze(0), None
        return torch.cat([placed[r] for r in range(len(runs))]).unsqueeze(0), None
    return run


def _runs(lengths: list[int]) -> list[tuple[int, int, int]]:
    """(start, length, count) of each run of adjacent chunks of one length, in order."""
    runs, at = [], 0
    for n in lengths:
        if runs and runs[-1][1] == n:
            start, _, count = runs[-1]
            runs[-1] = (start, n, count + 1)
        else:
            runs.append((at, n, 1))
        at += n
    return runs


def _stacked(t: torch.Tensor, runs: list[tuple[int, int, int]]) -> torch.Tensor:
    """[chunks, heads, n, head_dim]: the chunks of these runs (one length n) of `t` ([1, heads,
    sequence, head_dim]) as one batch, a view where there is one run."""
    n = runs[0][1]
    parts = [t[:, :, start:start + n * count] for start, _, count in runs]
    span = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    chunks = span.shape[2] // n
    return span.reshape(t.shape[1], chunks, n, t.shape[3]).transpose(0, 1)
