"""A step's rows cut after their longest document, to one of a few lengths (trim_padding).

Rows are `seq` tokens long, a record and then padding unless documents are packed. A decoder is
causal and the padding is never a target, so the columns after the last document token of every
row of a step change nothing the step computes: cut, they are work not done. LlamaFactory and TRL
pad each batch to its longest row; megacompile plans one program per input shape, so a step's rows
are cut to the shortest of seq/8, seq/4, seq/2 and seq that holds them: at most four shapes, each
captured and planned when first met (the first step at each), every step of one length after that
running the program planned for it. The budget planned at `seq` holds for each.

Stages dpo, kto and rm pack each row as one (prompt, completion) record and then padding
(posttrain's pack_rows, stage rm's scored_rows): a step's micro-batches, and the rows of each
forward-only pass (the reference's, the KL rows', an evaluation's), are cut after the last target
of their longest row, or after the token a reward model scores (together()).
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager

import numpy as np
import torch

from ...errors import RetraceWarning
from .packing import IGNORE, Rows

PARTS = (8, 4, 2, 1)        # the lengths a step's rows are cut to: seq // 8, seq // 4, seq // 2, seq
TEXT = frozenset({"input_ids", "labels", "attention_mask", "position_ids"})     # no images: those are cut
PER_ROW = frozenset({"last", "margin"})     # stage rm's scored token of each row, each pair's margin: not cut


def filled(rows: Rows, start: int, size: int, shifted: bool) -> int:
    """The input columns rows start .. start+size-1 need: up to the last token of a document in
    any of them (a shifted row's last token is only a target)."""
    longest = 0
    for i in range(start, start + size):
        kept = np.flatnonzero(rows.row(i)[3])
        longest = max(longest, int(kept[-1]) + 1 if len(kept) else 0)
    return max(1, longest - shifted)


def length(needed: int, seq: int) -> int:
    """The shortest of the few lengths (PARTS) that holds `needed` input columns."""
    return next(n for n in (-(-seq // p) for p in PARTS) if n >= needed)


def trimmed(inputs: dict, columns: int) -> dict:
    """`inputs` with every per-token tensor (input_ids, labels, attention_mask, position_ids) cut
    to its first `columns` columns; anything else as it is."""
    seq = inputs["input_ids"].shape[1]
    return {k: v[:, :columns].contiguous() if isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape[1] == seq
            else v for k, v in inputs.items()}


def needed(rows: dict) -> int:
    """The input columns packed (prompt, completion) rows need: up to the last target of any of them
    (labels[t] is the token after position t; a row's last token is only a target), or, for a
    reward model's rows, up to the token each row is scored at (`last`)."""
    if "labels" in rows:
        targets = rows["labels"] != IGNORE                                      # (N, seq)
        return max(1, int((targets * torch.arange(1, targets.shape[1] + 1)).max()))
    return int(rows["last"].max()) + 1


def together(batches: list[dict], on: bool = True) -> list[dict]:
    """Packed micro-batches (needed()) all cut to the one length that holds the longest row of any:
    one program for all of them. As they are when `on` is false or where any holds images (their
    pixel inputs are laid out for the whole rows)."""
    if not on or not batches or any(set(b) - TEXT - PER_ROW for b in batches):
        return batches
    columns = length(max(needed(b) for b in batches), batches[0]["input_ids"].shape[1])
    return [trimmed(b, columns) for b in batches]


@contextmanager
def own_lengths(on: bool = True):
    """The engine's note of inputs that keep changing (RetraceWarning) quiet over the run's own few
    lengths (PARTS)."""
    with warnings.catch_warnings():
        if on:
            warnings.simplefilter("ignore", RetraceWarning)
        yield
