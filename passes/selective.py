"""Selective saving: the chosen blocks run the variant of their template that saves only the
outputs of matmuls and attention, and recomputes the cheap ops in its backward (capture/split.py).

The variant has the same parameters, inputs and outputs as the block it stands for, so swapping
it in changes only what the forward leaves for the backward and what the backward recomputes:
the passes, the simulator, the cost model and the runtime all read it like any template.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

from megacompile.capture import CapturedModel


def with_selective(captured: CapturedModel, blocks: Iterable[int]) -> CapturedModel:
    """`captured` with the given stages on their selective variants (stages without one, and
    stages already on it, stay as they are)."""
    chosen = set(blocks)
    if not any(captured.stages[s].template.selective is not None for s in chosen):
        return captured
    stages = [dataclasses.replace(st, template=st.template.selective)
              if s in chosen and st.template.selective is not None else st
              for s, st in enumerate(captured.stages)]
    return dataclasses.replace(captured, stages=stages)
