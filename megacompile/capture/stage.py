"""Trace one stage (prologue, the block template, epilogue) as a joint forward+backward graph.

A stage is a function of (parameters, activations) -> outputs. Its joint graph comes from
make_fx over the function and torch.autograd.grad, with fake tensors, so no weight needs memory;
it is then split into the forward and backward graphs that the schedule runs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ..errors import CaptureError, MegacompileError
from ..ir.stage_program import GraphMemory, StageProgram
from .split import split_joint
from .state_writes import refuse_state_writes


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = False

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize

    @staticmethod
    def of(t: torch.Tensor, requires_grad: bool | None = None) -> "TensorMeta":
        rg = t.requires_grad if requires_grad is None else requires_grad
        return TensorMeta(tuple(t.shape), t.dtype, bool(rg))


@dataclass(frozen=True)
class ParamSlot:
    name: str          # name inside the stage (block-local for the template)
    meta: TensorMeta
    trainable: bool    # False for buffers and frozen parameters


@dataclass
class StageTemplate:
    kind: str                       # "prologue" | "block" | "epilogue" | "whole"
    params: list[ParamSlot]
    acts: list[TensorMeta]          # activation inputs, requires_grad where a gradient flows back
    outputs: list[TensorMeta]
    forward: StageProgram | None = None     # (params, acts) -> (outputs, saved)
    backward: StageProgram | None = None    # (bwd params, bwd acts, saved, tangents) -> grads
    inference: StageProgram | None = None   # (params, acts) -> outputs, nothing saved
    saved: list[TensorMeta] = field(default_factory=list)
    bwd_params: list[int] = field(default_factory=list)
    bwd_acts: list[int] = field(default_factory=list)
    fwd_memory: GraphMemory | None = None
    bwd_memory: GraphMemory | None = None
    inf_memory: GraphMemory | None = None
    n_fx_nodes: int = 0
    # The same stage with its cheap ops recomputed in the backward (split.py, `selective`): it
    # saves fewer bytes. None where that saves nothing, and on every stage but the block.
    selective: "StageTemplate | None" = field(default=None, repr=False, compare=False)
    full: "StageTemplate | None" = field(default=None, repr=False, compare=False)  # on a variant: what it replaces
    # Sequence chunks of the token-wise submodules (capture/chunk.py) and their paths in the block.
    chunks: int = 1
    chunked: tuple[str, ...] = ()
    # Inputs that need a gradient the stage does not give (read only through .detach(), or by
    # ops without one): the stage hands zeros back for them (segment.py _refuse_cut_gradients).
    cut_acts: tuple[int, ...] = ()

    @property
    def grad_params(self) -> list[int]:
        return [i for i, p in enumerate(self.params) if p.trainable]

    @property
    def grad_acts(self) -> list[int]:
        return [i for i, a in enumerate(self.acts) if a.requires_grad]

    @property
    def tangent_outputs(self) -> list[int]:
        return [i for i, o in enumerate(self.outputs) if o.requires_grad]

    @property
    def weight_bytes(self) -> int:
        return sum(p.meta.nbytes for p in self.params)

    @property
    def saved_bytes(self) -> int:
        return sum(m.nbytes for m in self.saved)

    @property
    def random(self) -> bool:
        return self.forward is not None and self.forward.random


SourceFn = Callable[[list[torch.Tensor], list[torch.Tensor]], list[torch.Tensor]]


def trace_stage(kind: str, source: SourceFn, params: list[ParamSlot], fake_params: list[torch.Tensor],
                fake_acts: list[torch.Tensor], train: bool, origin: str,
                differentiable: list[bool] | None = None) -> StageTemplate:
    """Trace `source(params, acts) -> outputs` for training (joint, split) or inference.

    An output gets a gradient (a tangent input of the backward) where it depends on something
    trainable and `differentiable` (default: all) allows it: an output no later stage reads
    needs none.

    What crosses a stage boundary (the outputs, the gradients of the inputs) is made contiguous
    inside the graph that produces it where it is a permuted dense layout: the stage that reads it
    was traced on contiguous inputs and tangents, and a value laid out otherwise (a transposed
    layer norm gradient, as Gemma 3's tower hands back) would be copied by the reader at run time,
    outside the plan and its arena. Inside the graph the copy is an op like any other: planned,
    counted and placed, and it costs the bytes the value has. A broadcast (an expanded mask, a
    stride of 0) stays as it is: made contiguous it would grow, and its readers take any strides.
    """
    source = _contiguous(source)
    try:
        probe = source(fake_params, fake_acts)
        wanted = differentiable or [True] * len(probe)
        outputs = [TensorMeta.of(o, bool(train and w and o.requires_grad)) for o, w in zip(probe, wanted)]
        template = StageTemplate(kind, params, [TensorMeta.of(a, a.requires_grad and train) for a in fake_acts], outputs)
        if not train:
            gm = make_fx(lambda p, a: list(source(p, a)), tracing_mode="fake")(fake_params, fake_acts)
            refuse_state_writes(gm, [p.name for p in params], f"the {kind} stage ({origin})")
            template.inference = StageProgram(gm)
            template.inf_memory = template.inference.simulate()
            template.n_fx_nodes = len(gm.graph.nodes)
            return template
        device = (list(fake_acts) + list(fake_params))[0].device
        tangents = [torch.empty(o.shape, dtype=o.dtype, device=device) for o in outputs if o.requires_grad]
        unreached: list[int] = []
        joint = make_fx(_joint(source, template, unreached), tracing_mode="fake")(fake_params, fake_acts, tangents)
        template.cut_acts = tuple(-1 - i for i in unreached if i < 0)
        unreached = [i for i in unreached if i >= 0]
        if unreached:
            # A trainable parameter the stage's outputs do not depend on (unused, or read only
            # through .detach()) gets no gradient here, as eagerly its .grad stays None: the stage
            # reads it like a frozen weight, and a parameter no stage gives a gradient is skipped
            # by the update as torch.optim.AdamW skips it (engine/gradless.py).
            template.params = [dataclasses.replace(p, trainable=False) if i in unreached else p
                               for i, p in enumerate(params)]
            joint = make_fx(_joint(source, template), tracing_mode="fake")(fake_params, fake_acts, tangents)
        refuse_state_writes(joint, [p.name for p in params], f"the {kind} stage ({origin})")
    except MegacompileError:
        raise
    except Exception as e:  # noqa: BLE001 - any tracing failure becomes one clear error
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CaptureError(f"cannot trace the {kind} stage ({origin}): {type(e).__name__}: {first}") from e
    # A block's inputs that need no gradient are the prologue's side inputs (masks, rotary
    # tables), on the device for the whole step: what a block makes from them is redone in its
    # backward, not saved once per block. Other stages run once and save such values (the fused
    # loss in megacompile/fusion reads the labels the epilogue saved).
    grad_acts = template.grad_acts if kind == "block" else None
    _adopt_split(template, split_joint(joint, len(params), len(fake_acts), len(outputs), grad_acts=grad_acts))
    template.n_fx_nodes = len(joint.graph.nodes)
    if kind == "block":
        variant = dataclasses.replace(template)
        _adopt_split(variant, split_joint(joint, len(params), len(fake_acts), len(outputs), selective=True,
                                          grad_acts=grad_acts))
        if variant.saved_bytes < template.saved_bytes:
            template.selective, variant.full = variant, template
    return template


def _adopt_split(template: StageTemplate, split) -> None:
    template.forward = StageProgram(split.forward)
    template.backward = StageProgram(split.backward)
    saved_nodes = list(template.forward.output_node.args[0])[len(template.outputs):]
    template.saved = [TensorMeta.of(n.meta["val"], False) for n in saved_nodes]
    template.bwd_params, template.bwd_acts = split.bwd_params, split.bwd_acts
    template.fwd_memory = template.forward.simulate()
    template.bwd_memory = template.backward.simulate()


def _joint(source: SourceFn, template: StageTemplate, unreached: list[int] | None = None):
    """The stage's joint function. `unreached`, where given, collects the trainable parameters
    (indices into template.params) and, as -1 - k, the inputs k needing a gradient that get none;
    their gradients are traced as zeros."""
    wrt_params = template.grad_params
    wrt_acts = template.grad_acts
    tangent_outputs = template.tangent_outputs

    def joint(params, acts, tangents):
        outputs = list(source(params, acts))
        wrt = [params[i] for i in wrt_params] + [acts[i] for i in wrt_acts]
        if wrt and tangent_outputs:
            grads = list(torch.autograd.grad([outputs[i] for i in tangent_outputs], wrt, tangents,
                                             allow_unused=True))
        else:
            grads = [None] * len(wrt)
        if unreached is not None:
            unreached.extend(i for i, g in zip(wrt_params, grads) if g is None)
            unreached.extend(-1 - k for k, g in zip(wrt_acts, grads[len(wrt_params):]) if g is None)
        grads = [torch.zeros_like(w) if g is None else g for w, g in zip(wrt, grads)]
        n = len(wrt_params)     # the inputs' gradients are the previous stages' tangents (trace_stage)
        return outputs + grads[:n] + [_laid_out(g) for g in grads[n:]]
    return joint


def _contiguous(source: SourceFn) -> SourceFn:
    def laid_out(params, acts):
        return [_laid_out(o) for o in source(params, acts)]
    return laid_out


def _laid_out(t):
    """t made contiguous where it is dense in another order of its dimensions; else t."""
    if not isinstance(t, torch.Tensor) or t.is_contiguous():
        return t
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return t                # a broadcast or a slice: its bytes are not its elements
        expected *= size
    return t.contiguous()
