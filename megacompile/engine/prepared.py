"""A capture and its plan made before the engine that runs them exists, handed to it explicitly.

A run that plans before it trains (`megacompile train` finding its budget and choosing its
micro-batch) captures each input shape once and plans the chosen one with the very request the
engine would make at its first step (`request`, as engine.py _build asks). `Engine.adopt(prepared)`
gives the engine both: at the first call with those inputs it takes the capture instead of
tracing again, and the plan where its own request is equal (under data parallelism or with a
dump folder it is not, and the engine plans again from the same capture).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from ..capture import CapturedModel, capture
from ..capture.grid_constants import grid_key
from ..cost import profile_for
from ..cost.host_memory import default_host_budget_bytes, module_resident
from ..passes import StepKind
from ..planner import Plan
from ..planner.request import PlanRequest, disk_room, fused, host_accumulation
from ..planner.attention_choice import faster_attention_plan
from ..planner.search import make_plan, place_host_state
from ..runtime import normalize_device
from ..settings import Settings


def signature(model: nn.Module, args: tuple, kwargs: dict, train: bool) -> tuple:
    """What tells two calls' plans apart: the inputs' structure, shapes and dtypes, their image
    grids (constants of a capture), every submodule's mode (one block put in eval() stops its
    dropout) and which parameters train (requires_grad set or cleared after a step)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    shape = tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else ("const", repr(x)) for x in leaves)
    modes = tuple(m.training for m in model.modules())
    trains = tuple(p.requires_grad for p in model.parameters())
    return (train, modes, trains, str(spec), shape, grid_key(kwargs))


@dataclass(frozen=True)
class Prepared:
    module: nn.Module = field(repr=False, compare=False)     # the module captured
    signature: tuple
    device: torch.device
    compute_dtype: torch.dtype
    captured: CapturedModel
    request: PlanRequest
    plan: Plan

    def captures(self, module: nn.Module, signature: tuple, device: torch.device, compute_dtype: torch.dtype,
                 loss_fn) -> bool:
        """Whether this capture is the one an engine would make for the call: of the same module
        (another module's capture would run its graph with this one's weights), the same inputs,
        device and dtype, and no loss_fn."""
        return (module is self.module and loss_fn is None and signature == self.signature
                and torch.device(device) == self.device and compute_dtype == self.compute_dtype)


def training_capture(module: nn.Module, inputs: dict, settings: Settings, train: bool = True,
                     flash_attention: bool = False) -> CapturedModel:
    """The capture an engine with these settings makes of `module` at its first step with these
    inputs (meta tensors lend their shapes); `train` False: at its first forward-only call.
    `flash_attention`: the capture of a fused plan's other attention (planner/attention_choice.py)."""
    device = normalize_device(settings.device)      # as make_backend: cuda -> cuda:N, the one the engine runs on
    return capture(module, (), inputs, device=device, compute_dtype=settings.compute_dtype, train=train,
                   flash_attention=flash_attention)


def prepare(module: nn.Module, inputs: dict, settings: Settings, clip: bool,
            captured: CapturedModel | None = None) -> Prepared:
    """The plan an Engine(module, **settings) builds at its first step with these inputs, asked
    for with the request it will make. clip: the optimizer clips gradients (max_grad_norm).
    `captured`: training_capture(module, inputs, settings), when already made."""
    device = normalize_device(settings.device)
    backend = device.type
    if captured is None:
        captured = training_capture(module, inputs, settings)
    host_budget = settings.host_budget_bytes or default_host_budget_bytes()
    host_cost = place_host_state(captured, settings.compute_dtype,
                                 host_accumulation(settings.grad_accum, settings.accumulation), host_budget,
                                 disk_room(settings.nvme_dir, settings.nvme_budget_bytes),
                                 module_resident=module_resident(module), updates=settings.updates)
    request = PlanRequest(
        settings.budget_bytes, StepKind(update=True, clip=clip, updates=settings.updates), backend,
        profile_for(backend),
        host_bytes=host_cost.ram_bytes, host_cost=host_cost, host_budget_bytes=host_budget,
        fuse=fused(settings.fuse, on_gpu=backend == "cuda"), grad_accum=settings.grad_accum,
        accumulation=settings.accumulation)
    flash = (lambda: training_capture(module, inputs, settings, flash_attention=True)) if request.fuse else None
    return Prepared(module, signature(module, (), inputs, True), device, settings.compute_dtype, captured, request,
                    faster_attention_plan(lambda c: make_plan(c, request), captured, flash))
