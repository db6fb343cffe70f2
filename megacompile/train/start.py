"""`megacompile train`'s entry: a run of its stage, SFT (loop.py) or post-training (stage_run.py)."""
from __future__ import annotations

from . import loop, stage_run
from .config import RunConfig


def run(c: RunConfig, trace: str | None = None) -> dict:
    """Train as `c` says; returns the figures the final line prints (loop.run, stage_run.run)."""
    return (loop.run if c.stage == "sft" else stage_run.run)(c, trace)
