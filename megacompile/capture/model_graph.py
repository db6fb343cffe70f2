"""What capture hands to the passes: the model as a chain of stage instances over templates."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from .grid_constants import GridConstants
from .image_tokens import ImageTokens
from .lookups import lookup_params
from .rope_positions import HeldRopeDeltas
from .stage import StageTemplate, TensorMeta


@dataclass(frozen=True)
class Port:
    """Where a stage input comes from: a model input (stage == -1) or a stage's output."""
    stage: int
    index: int


@dataclass(frozen=True)
class StateEntry:
    shape: tuple[int, ...]
    dtype: torch.dtype        # the model's own dtype (the host copy keeps it; masters are float32)
    trainable: bool
    is_buffer: bool
    persistent: bool = True   # buffers only: part of state_dict()

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass
class StageInstance:
    name: str                 # "prologue", "block.3", "epilogue", "whole"
    template: StageTemplate
    params: list[str]         # model state names, aligned with template.params
    inputs: list[Port]        # aligned with template.acts
    origin: str               # module path the stage came from


@dataclass
class CapturedModel:
    stages: list[StageInstance]
    state: dict[str, StateEntry]
    inputs: list[TensorMeta]          # the model's input tensors, flattened from (args, kwargs)
    input_spec: pytree.TreeSpec
    input_constants: list[Any]        # non-tensor input leaves (None at tensor positions)
    outputs: list[Port]               # training: [loss, *extras]; inference: the output's tensors
    out_spec: pytree.TreeSpec | None = None
    out_constants: list[Any] = field(default_factory=list)
    out_is_tensor: list[bool] = field(default_factory=list)
    train: bool = True
    # Training: the names of outputs[1:], the tensors the forward handed out beside its loss
    # (loss.py LossAndOutputs), detached: no tangent flows into them.
    extra_outputs: tuple[str, ...] = ()
    compute_dtype: torch.dtype = torch.float32
    block_path: str | None = None
    # Module paths of the towers whose layers stream as blocks beside the decoder's (a vision tower).
    towers: tuple[str, ...] = ()
    # For each block stage that starts a template of its own: how it differs from the first block.
    template_notes: dict[str, str] = field(default_factory=dict)
    # Image placeholder tokens each step's input_ids must hold (image_tokens.py); checked before a step.
    image_tokens: list[ImageTokens] = field(default_factory=list)
    # Image grids the capture took as constants (grid_constants.py); each step must give the same.
    grids: list[GridConstants] = field(default_factory=list)
    trace_seconds: float = 0.0
    # Parameters of routed experts: the share of each that one token uses (top_k / experts).
    routed_fractions: dict[str, float] = field(default_factory=dict)
    # n -> this model captured again with its blocks run over n sequence chunks (capture/chunk.py);
    # None where nothing could be chunked (inference, no block stack).
    rechunk: Callable[[int], "CapturedModel"] | None = field(default=None, repr=False, compare=False)

    @property
    def active_params(self) -> int:
        """Trainable parameters one token uses: every expert's count scaled by top_k / experts."""
        return round(sum(e.numel * self.routed_fractions.get(n, 1.0) for n, e in self.state.items() if e.trainable))

    @property
    def flop_params(self) -> int:
        """The N of 6ND: the active parameters less the tables a token only looks rows up in (token and
        position embeddings, lookups.py). A head tied to the embedding counts, once."""
        lookups = lookup_params(self.stages)
        return round(sum(e.numel * self.routed_fractions.get(n, 1.0) for n, e in self.state.items()
                         if e.trainable and n not in lookups))

    def in_tower(self, origin: str) -> bool:
        """Whether a stage traced from module `origin` is a tower's block."""
        return any(origin.startswith(t + ".") for t in self.towers)

    @property
    def block_templates(self) -> list[StageTemplate]:
        """The distinct templates the blocks run, in the order of their first block."""
        return [t for t in self.templates if t.kind == "block"]

    @property
    def templates(self) -> list[StageTemplate]:
        seen: dict[int, StageTemplate] = {}
        for s in self.stages:
            seen.setdefault(id(s.template), s.template)
        return list(seen.values())

    def check_inputs(self, inputs: list[torch.Tensor]) -> None:
        """What the capture fixed about the inputs' values: the image grids, the image tokens' count."""
        for grid in self.grids:
            grid.check(inputs)
        for tokens in self.image_tokens:
            tokens.check(inputs)

    def rebuild_output(self, tensors: list[torch.Tensor]) -> Any:
        it = iter(tensors)
        leaves = [next(it) if is_t else c.value() if isinstance(c, HeldRopeDeltas) else c
                  for is_t, c in zip(self.out_is_tensor, self.out_constants)]
        return pytree.tree_unflatten(leaves, self.out_spec)


def owners(captured: CapturedModel) -> tuple[dict[str, int], dict[int, set[int]]]:
    """Which stage owns each trainable parameter (the first to use it in the forward), and for
    each owning stage, the stages whose backward produces gradients for its parameters."""
    owner: dict[str, int] = {}
    for s, stage in enumerate(captured.stages):
        for name, slot in zip(stage.params, stage.template.params):
            if slot.trainable:
                owner.setdefault(name, s)
    contributors: dict[int, set[int]] = {s: set() for s in set(owner.values())}
    for s, stage in enumerate(captured.stages):
        for name, slot in zip(stage.params, stage.template.params):
            if slot.trainable:
                contributors[owner[name]].add(s)
    return owner, contributors


def readers(captured: CapturedModel) -> dict[int, set[int]]:
    """For each stage, the owners whose masters its weights are copied from."""
    owner = owners(captured)[0]
    return {s: {owner[n] for n in stage.params if n in owner} for s, stage in enumerate(captured.stages)}
