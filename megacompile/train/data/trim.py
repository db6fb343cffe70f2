"""A step's rows cut after their longest document, to one of a few lengths (trim_padding).

Rows are `seq` tokens long, a record and then padding unless documents are packed. A decoder is
causal and the padding is never a target, so the columns after the last document token of every
row of a step change nothing the step computes: cut, they are work not done. LlamaFactory and TRL
pad each batch to its longest row; megacompile plans one program per input shape, so a step's rows
are cut to the shortest of seq/8, seq/4, seq/2 and seq that holds them: at most four shapes, each
captured and planned when first met (the first step at each), every step of one length after that
running the program planned for it. The budget planned at `seq` holds for each.
"""
from __future__ import annotations

import numpy as np
import torch

from .packing import Rows

PARTS = (8, 4, 2, 1)        # the lengths a step's rows are cut to: seq // 8, seq // 4, seq // 2, seq
TEXT = frozenset({"input_ids", "labels", "attention_mask", "position_ids"})     # no images: those are cut


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
