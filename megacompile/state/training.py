"""TrainingState: the one object a checkpoint, an export or a load works on.

Weights live in one of three places, and the state says which: in the host state (fp32 masters
and AdamW moments, built at the first step or prepare(); `host`), waiting in files or dicts to
stream in when it is built (`pending_load`, `weight_parts`), or in the module itself (a model
built with real weights; `materialized`). `canonical` maps every state_dict key to the
parameter or buffer it names (tied weights share one).
"""
from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from ..errors import MegacompileError
from ..optim import AdamW
from ..optim.host_update import HostUpdate
from ..optim.lr_handle import LearningRateHandle

if TYPE_CHECKING:
    from ..runtime.host import HostState


class TrainingState:
    def __init__(self, model: nn.Module, optimizer: AdamW, *, compute_dtype: torch.dtype, grad_accum: int,
                 data_parallel=None):
        self.model = model
        self.optimizer = optimizer
        self.torch_optimizer = LearningRateHandle(optimizer)   # torch LR schedulers attach here
        # What the executors call on the host stream; it holds no reference back to the state or the
        # engine, so a dropped engine is freed (and its threads end) without the cyclic collector.
        self.update = HostUpdate(optimizer)
        self.compute_dtype = compute_dtype
        self.grad_accum = grad_accum
        self.data_parallel = data_parallel   # distributed.DataParallel, or None for one process
        first = {id(t): n for n, t in reversed(list(model.named_parameters()) + list(model.named_buffers()))}
        self.canonical = {k: first.get(id(t), k) for k, t in model.state_dict(keep_vars=True).items()}
        self.materialized = not any(p.is_meta for p in model.parameters())
        self.pending_load = None     # io.source.PendingLoad: weights to stream in when host state is built
        self.weight_parts = None     # io.state_dict.LoadedParts: what load_state_dict calls have loaded
        self.source_dir: str | None = None   # the Hugging Face folder from_pretrained read, if any
        self.steps_done = 0          # optimizer steps
        self.micro_batches = 0       # step() calls that committed
        self.skipped_steps = 0       # steps dropped for an inf or NaN loss or gradient
        # Per trainable parameter, the optimizer steps that gave it no gradient (absent: none): its
        # own AdamW count is steps_done less these (the host state reads and updates this dict).
        self.missed_steps: dict[str, int] = {}
        # Names the run in its checkpoints' manifests: keep_last rotates only this run's. A
        # load_checkpoint takes over the saved run's, so a resumed run goes on rotating its own.
        self.run_id = uuid.uuid4().hex
        self.waiting_micro_batches: list[list[torch.Tensor]] = []   # a layer-major step's inputs so far
        # The module's parameters are brought up to date with the state where it changed since
        # (io/model_params.py): masters change at an optimizer step or a load.
        self.loads = 0
        self.module_version: tuple | None = None

    @property
    def host(self) -> HostState | None:
        """The fp32 masters, AdamW moments and gradient sums; None until the first trace."""
        return self.update.host

    @host.setter
    def host(self, host: HostState | None) -> None:
        self.update.host = host

    def host_or_error(self) -> HostState:
        if self.host is None:
            raise MegacompileError("no host state yet: the first step() or prepare(...) builds it")
        return self.host

    def wait_updates(self) -> None:
        """Wait for host updates still running (reads and writes of the masters do this first)."""
        if self.host is not None:
            self.host.wait_updates()

    def layout(self) -> tuple[dict[str, tuple], dict[str, tuple]]:
        """(trainable parameters, buffers and frozen parameters) -> shape, by canonical name: the
        host state's layout if it exists, else the model's."""
        if self.host is not None:
            return ({n: tuple(s.shape) for n, s in self.host.slots.items()},
                    {n: tuple(t.shape) for n, t in self.host.consts.items()})
        trainable, const = {}, {}
        for name, p in self.model.named_parameters():
            (trainable if p.requires_grad else const)[name] = tuple(p.shape)
        for name, b in self.model.named_buffers():
            const[name] = tuple(b.shape)
        return trainable, const

    def adamw_step(self, name: str) -> int:
        """The trainable parameter's own AdamW step count (torch.optim.AdamW's state['step']): the
        optimizer steps that gave it a gradient. 0: none yet (torch holds no state for it)."""
        return self.steps_done - self.missed_steps.get(name, 0)

    def step_context(self) -> dict:
        """Fixed when a step starts, read by its updates on the host stream (which may still be
        running while the next step begins)."""
        step = self.steps_done + 1
        opt = self.optimizer
        lr = opt.lr_at(step) if callable(opt.lr) else float(self.torch_optimizer.param_groups[0]["lr"])
        return {"step": step, "lr": lr, "grad_scale": 1.0}
