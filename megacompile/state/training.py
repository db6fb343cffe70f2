"""TrainingState: the one object a checkpoint, an export or a load works on, and the one owner
of what they change in it.

Weights are in one of four places (`where`), and only the transitions below move them:

    missing   a model built on meta, its weights not (all) loaded yet
    module    the module's own parameters hold them (a model built with real weights)
    pending   in files or dicts (`pending_load`), to stream in when the host state is built
    host      in the host state (fp32 masters and AdamW moments, built at the first step or
              prepare(); `host`)

    weights_arrive   whole weights (from_pretrained's files, a checkpoint's): into the host state
                     now if it exists, else pending
    parts_loaded     a load_state_dict call's part: kept pending before the host state exists
    host_built       the host state exists: what was pending streams in, or the module's own
    restore          a checkpoint's load: its weights arrive, its counters and learning rate return
    moments_arrive   AdamW's moments and step counts alone (engine.torch_optimizer.load_state_dict):
                     into the host state now if it exists, else kept (`pending_moments`) to go in
                     after the weights when it is built

`materialized` says the weights are complete wherever they are (not missing); `weight_parts`
records what load_state_dict calls have loaded. `canonical` maps every state_dict key to the
parameter or buffer it names (tied weights share one). The counters (state/counters.py) change
at a step's commit or skip and at a restore.

Code outside this package reads the fields and calls the transitions; it stores none of them
(tests/layering.py keeps that).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from ..errors import MegacompileError, PartialStepError
from ..optim import AdamW, check_step_lr
from ..optim.host_update import HostUpdate
from ..optim.lr_handle import LearningRateHandle
from ..optim.lr_ratio import parameter_ratios
from ..optim.weight_decay import exempt_parameters
from .counters import Counters

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
        # It holds the host state.
        self.update = HostUpdate(optimizer)
        # The parameters AdamW steps with weight decay 0 (AdamW no_decay), by canonical name.
        self.no_decay = exempt_parameters(optimizer.no_decay, model)
        # Each parameter AdamW steps at lr x a ratio other than 1 (AdamW lr_ratios), by canonical name.
        self.lr_ratios = parameter_ratios(optimizer.lr_ratios, model)
        self.compute_dtype = compute_dtype
        self.grad_accum = grad_accum
        self.data_parallel = data_parallel   # distributed.DataParallel, or None for one process
        first = {id(t): n for n, t in reversed(list(model.named_parameters()) + list(model.named_buffers()))}
        self.canonical = {k: first.get(id(t), k) for k, t in model.state_dict(keep_vars=True).items()}
        self.counters = Counters()
        self.waiting_micro_batches: list[list[torch.Tensor]] = []   # a layer-major step's inputs so far
        self.waiting_weights: list[float | None] = []     # and their weights (Engine.weighted_step; None: 1/k)
        self._complete = not any(p.is_meta for p in model.parameters())
        self._pending = None         # anything with apply(host, model): io.source.PendingLoad, ...
        self._parts = None           # io.state_dict.LoadedParts: what load_state_dict calls have loaded
        self._pending_moments = None     # moments_arrive's load, waiting for the host state
        self._source_dir: str | None = None
        # The counters' weights_version the module's own tensors were last brought up to date at
        # (io/model_params.py).
        self._module_version: tuple | None = None
        # Why the masters hold part of a step (a step failed after its first update started:
        # runtime/early_updates.py); None while the state is whole.
        self.partial_step: str | None = None

    # -- where the weights are -------------------------------------------------------------
    @property
    def host(self) -> HostState | None:
        """The fp32 masters, AdamW moments and gradient sums; None until the first trace."""
        return self.update.host

    @property
    def pending_load(self):
        """Weights waiting to stream in when the host state is built (apply(host, model)), or None."""
        return self._pending

    @property
    def pending_moments(self):
        """AdamW's moments waiting for the host state (apply(host, model)), or None: moments_arrive."""
        return self._pending_moments

    @property
    def weight_parts(self):
        """io.state_dict.LoadedParts of the load_state_dict calls since the last whole load, or None."""
        return self._parts

    @property
    def materialized(self) -> bool:
        """Whether the weights are complete, wherever they are."""
        return self._complete

    @property
    def source_dir(self) -> str | None:
        """The Hugging Face folder from_pretrained read, if any."""
        return self._source_dir

    @property
    def where(self) -> str:
        """'host', 'pending', 'module' or 'missing' (the module docstring)."""
        if self.host is not None:
            return "host"
        if self._pending is not None:
            return "pending"
        return "module" if self._complete else "missing"

    def weights_arrive(self, load: Any, *, source_dir: str | None = None) -> None:
        """Whole weights (anything with apply(host, model)): written into the host state now if it
        exists, else kept to stream in when it is built. Partial loads before them are superseded.
        source_dir: the Hugging Face folder they come from."""
        if self.host is not None:
            self.wait_updates()
            load.apply(self.host, self.model)
            self._pending = None
        else:
            self._pending = load
        self._parts = None
        self._complete = True
        if source_dir is not None:
            self._source_dir = source_dir

    def parts_loaded(self, parts: Any, *, complete: bool) -> None:
        """A load_state_dict call checked and counted its tensors in `parts` (written into the host
        state already if it exists; kept in `parts`, which then stands pending, if not). complete:
        the parts now hold every weight the model needs."""
        if self.host is None:
            self._pending = parts
        self._parts = parts
        self._complete = self._complete or complete
        self.counters.loaded()

    def host_built(self, host: HostState) -> None:
        """The host state exists: the weights pending stream in (or, where the module holds them,
        the module's own), and from now on the host state holds them. A failure leaves the state
        without host state, the weights where they were."""
        host.missed = self.counters.missed_steps     # per-parameter step counts, kept by checkpoints
        host.no_decay = self.no_decay
        host.lr_ratios = self.lr_ratios
        if self._pending is not None:
            self._pending.apply(host, self.model)
        elif self._complete:
            host.load_module(self.model)
        if self._pending_moments is not None:
            self._pending_moments.apply(host, self.model)
        self.update.host = host
        self._pending = self._pending_moments = None

    def restore(self, weights: Any, counters: dict, *, param_group: dict | None = None) -> None:
        """What a checkpoint load read, applied in one go: its weights arrive (weights_arrive), the
        counters take its values (Counters.load_state_dict: those it holds), and the LR handle's
        param group its values (param_group: lr, initial_lr, betas, eps, weight_decay)."""
        self.weights_arrive(weights)
        self._pending_moments = None      # the checkpoint's moments are the ones now
        self.partial_step = None
        self.counters.load_state_dict(counters)
        if param_group:
            self.torch_optimizer.param_groups[0].update(param_group)
        self.counters.loaded()

    def moments_arrive(self, moments: Any, counters: dict) -> None:
        """AdamW's moments of every trainable parameter (anything with apply(host, model)) and the
        counters that go with them (Counters.load_state_dict: steps done, missed steps): written
        into the host state now if it exists, else kept to go in after the weights when it is built."""
        if self.host is not None:
            self.wait_updates()
            moments.apply(self.host, self.model)
            if self.host.disk is not None:
                self.host.disk.settle()     # moments written into an owner read from the disk tier
        else:
            self._pending_moments = moments
        self.counters.load_state_dict(counters)
        self.counters.loaded()

    @property
    def module_version(self) -> tuple | None:
        return self._module_version

    def module_synchronized(self, version: tuple) -> None:
        """The module's own tensors hold the weights of `version` (counters.weights_version)."""
        self._module_version = version

    def host_or_error(self) -> HostState:
        if self.host is None:
            raise MegacompileError("no host state yet: the first step() or prepare(...) builds it")
        return self.host

    def wait_updates(self) -> None:
        """Wait for host updates still running (reads and writes of the masters do this first)."""
        if self.host is not None:
            self.host.wait_updates()

    # -- the counters ----------------------------------------------------------------------
    steps_done = property(lambda self: self.counters.steps_done, doc="optimizer steps")
    micro_batches = property(lambda self: self.counters.micro_batches, doc="step() calls that committed")
    skipped_steps = property(lambda self: self.counters.skipped_steps,
                             doc="steps dropped for an inf or NaN loss or gradient")
    missed_steps = property(lambda self: self.counters.missed_steps,
                            doc="per trainable parameter, the optimizer steps that gave it no gradient")
    run_id = property(lambda self: self.counters.run_id, doc="names the run in its checkpoints")

    def micro_batches_committed(self, micro_batches: int, *, step_ends: bool) -> None:
        """A step() committed `micro_batches` micro-batches; step_ends: the optimizer step ran."""
        self.counters.committed(micro_batches, step_ends)
        if step_ends:
            self.torch_optimizer.step()   # tells attached torch LR schedulers a step happened

    def step_partly_applied(self, why: str) -> None:
        """A step failed after some of its updates ran: nothing more trains or saves until a
        checkpoint is loaded (restore)."""
        self.partial_step = why

    def refuse_partial(self, what: str) -> None:
        if self.partial_step is not None:
            raise PartialStepError(f"{what} refused: {self.partial_step}. The masters and AdamW moments hold part of "
                                   "that step, and so do the model's own parameters (a new compile() of the model, "
                                   "its state_dict() or its save_pretrained() would take it up); "
                                   "load_checkpoint(path) puts a whole state back")

    def step_skipped(self, dropped_micro_batches: int) -> None:
        """A step dropped for an inf or NaN, with the micro-batches of it committed before."""
        self.counters.skipped(dropped_micro_batches)

    # -- reads ---------------------------------------------------------------------------
    def layout(self) -> tuple[dict[str, tuple], dict[str, tuple]]:
        """(trainable parameters, buffers and frozen parameters) -> shape, by canonical name: the
        host state's layout if it exists, else the model's."""
        if self.host is not None:
            return ({n: tuple(s.shape) for n, s in self.host.slots.items()},
                    {n: tuple(t.shape) for n, t in self.host.consts.items()})
        return self.model_layout()

    def model_layout(self) -> tuple[dict[str, tuple], dict[str, tuple]]:
        """layout() as the model's parameters and buffers give it."""
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
        running while the next step begins): lr, betas, eps and weight_decay as the LR handle's
        param group holds them now (a scheduler or the user writes them there), lr from the AdamW's
        function where it is one."""
        step = self.steps_done + 1
        opt = self.optimizer
        context = self.torch_optimizer.settings()
        if callable(opt.lr):
            context["lr"] = opt.lr_at(step)
        check_step_lr(context["lr"], context["weight_decay"], max(self.lr_ratios.values(), default=1.0), step)
        return context | {"step": step, "grad_scale": 1.0}
