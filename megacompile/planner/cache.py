"""The engine's plans, one per input signature, bounded.

Each new input shape traces the model and plans it anew (about a second and tens of MiB for a
small model, more for a large one) and keeps the result. Past `limit` plans, the least recently
used is dropped (it is rebuilt if its shape comes back), and when shapes keep changing the engine
says so once in a while (RetraceWarning): padding inputs to a few fixed lengths lets plans be
reused.
"""
from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Any

from ..errors import RetraceWarning

LIMIT = 8          # plans an engine keeps
FIRST_WARNING = 4  # new input signatures before the first warning; then at every doubling


class PlanCache(OrderedDict):
    """An OrderedDict that keeps the `limit` most recently used entries."""

    def __init__(self, limit: int = LIMIT):
        super().__init__()
        self.limit = limit

    def get(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            return default
        self.move_to_end(key)
        return self[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


def note_new_shape(seen: int, seconds: float, shapes: str, limit: int = LIMIT, grids: bool = False) -> None:
    """Warn at the FIRST_WARNING-th new input signature, and at every doubling after it. `grids`:
    the inputs carry image grids (Qwen's), constants of a capture, which new image sizes change."""
    if seen < FIRST_WARNING or seen & (seen - 1):
        return
    images = (" Images of sizes not met before are new captures too (their grids are constants of a capture, "
              "as shapes are): resize the images beforehand to a few sizes (e.g. 448 x 448 px) so that their "
              "grids repeat." if grids else "")
    warnings.warn(
        f"step()/forward has now been called with {seen} different input shapes (the last: {shapes}); each new "
        f"shape traces and plans the model again (the last took {seconds:.2f} s) and keeps its plan "
        f"(the {limit} most recent are kept). Pad inputs to a few fixed lengths (buckets, e.g. multiples of "
        f"64 tokens) so that plans are reused.{images}", RetraceWarning, stacklevel=4)
