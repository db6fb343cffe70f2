"""The sequence-chunk count of the blocks (capture/chunk.py), chosen by the planner.

Chunking costs time and saves memory: each chunked submodule runs its forward twice (once in the
forward, once again per chunk in its backward) and every chunk pays its ops' launch and tail
costs once more; its intermediates shrink with the count. So the blocks run whole whenever a
schedule fits whole. Otherwise the counts are tried in doubling order, each captured again and
solved like any other model (its recompute, offload and boundary choices included, timed by the
same cost model): the first that fits is the fastest that fits, since more chunks only add
per-chunk costs. The doubling stops as soon as a count lowers the smallest budget no further
(the attention, the head or a block's input is then what does not fit).
"""
from __future__ import annotations

from typing import Callable, TypeVar

from megacompile.errors import BudgetTooSmallError

P = TypeVar("P")
MAX_CHUNKS = 256


def counts(seq: int) -> list[int]:
    """2, 4, 8, ... up to MAX_CHUNKS, never more chunks than tokens."""
    out, n = [], 2
    while n <= min(seq, MAX_CHUNKS):
        out.append(n)
        n *= 2
    return out


def plan_chunked(captured, plan_with: Callable[[object], P], refused: BudgetTooSmallError) -> P:
    """The plan of the fewest chunks that fits, planned by `plan_with(captured with n chunks)`;
    `refused` (the whole blocks' error) again where none fits or nothing can be chunked. The error
    raised is the one of the most chunks tried: its smallest budget is the lowest."""
    seq = max((a.shape[1] for st in captured.stages if st.template.kind == "block" and not captured.in_tower(st.origin)
               for a in st.template.acts if len(a.shape) >= 2), default=0)
    last = refused
    for n in counts(seq):
        chunked = captured.rechunk(n)
        if not any(st.template.chunked for st in chunked.stages):
            raise refused       # no block has a token-wise part it could chunk
        try:
            return plan_with(chunked)
        except BudgetTooSmallError as e:
            if e.minimum_bytes >= last.minimum_bytes:
                raise last      # what stops it is not in the chunked parts: more chunks will not fit
            last = e
    raise last
