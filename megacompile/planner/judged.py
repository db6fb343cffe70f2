"""What planning judged of a captured model, kept for its next plans while the model lives.

A model is often planned several times over (at other budgets, at no budget for the smallest
one, then at the user's): each plan's solver asks the peak and the predicted seconds of many of
the same choices, each a schedule built, simulated or timed. A choice's figures depend on the
captured model, the step kind and, for seconds, the hardware profile and the disk's bytes per
parameter: each table is kept per captured object and keyed by those, and goes when the object
does. A captured model is not edited once captured (its variants are new objects: with_selective,
rechunk, fusion), so nothing else can make a kept figure stale.
"""
from __future__ import annotations

import weakref

from ..capture import CapturedModel

_tables: dict[int, dict[tuple, dict]] = {}


def judged_before(captured: CapturedModel, *key) -> dict:
    """The table of figures `captured` was judged by under `key` (empty the first time)."""
    ident = id(captured)
    tables = _tables.get(ident)
    if tables is None:
        tables = _tables[ident] = {}
        # Runs as the object goes, before its id can name another one.
        weakref.finalize(captured, _tables.pop, ident, None)
    return tables.setdefault(key, {})
