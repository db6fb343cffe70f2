"""The Engine that compile() returns: step() trains, calling it runs the forward only.

The engine captures the model lazily, at the first call with real inputs (it needs their shapes),
and keeps one plan per input signature: a call with other shapes builds and verifies a new plan
(or, with retrace=False, raises InputMismatchError). Host state (fp32 masters, AdamW moments,
gradients) is shared by every plan.
"""
from __future__ import annotations

import math
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from ..capture import CapturedModel, blocks_logged_before, capture
from ..capture.grid_constants import describe_grids, grid_key
from ..capture.loss import LossFn
from ..capture.rope_positions import with_rope_positions
from .. import arguments
from ..errors import ArgumentError, InputMismatchError, MegacompileError
from ..optim import AdamW
from ..optim.adamw import given_optimizer
from ..passes import StepKind
from ..planner import Plan
from ..planner.cache import PlanCache, note_new_shape
from ..planner.measured import MeasuredRun
from ..planner.quantized import refuse_quantized_model
from ..cost import HardwareProfile, profile_for
from ..cost.host_memory import default_host_budget_bytes
from ..planner.request import PlanRequest, fused
from ..planner.attention_choice import faster_attention_plan
from ..planner.search import make_plan
from ..runtime import Executor, HostState, make_backend, shutdown
from ..runtime.host_heap import resident_set_bytes
from ..settings import Settings
from ..state import TrainingState
from ..io import model_params, state_dict
from ..io.checkpoint import LocalCheckpoints
from ..io.torch_adamw_state import TorchAdamWState
from ..distributed import data_parallel_for
from ..distributed.checkpoint import ShardedCheckpoints
from .host_setup import build_host_state
from .layer_major_step import layer_major_step
from .prepared import Prepared, signature
from .shared_device import SharedDevice, join
from .skip_streak import SkipStreak
from .state_io import StateIO
from .step import StepRecord, run_step, tokens

GiB = 2 ** 30


@dataclass
class _Compiled:
    captured: CapturedModel
    plan: Plan
    executor: Executor
    measured: MeasuredRun     # what its runs measured, beside the plan: its peak, the backend's last step


class Engine(StateIO):
    def __init__(self, model: nn.Module, hbm_budget: float, *, optimizer: AdamW | None = None,
                 compute_dtype: torch.dtype = Settings.compute_dtype, device: str | torch.device | None = None,
                 loss_fn: LossFn | None = None, retrace: bool = Settings.retrace, dump_dir: str | None = None,
                 grad_accum: int = Settings.grad_accum, fuse: bool | None = None, host_budget: float | None = None,
                 on_nonfinite: str = Settings.on_nonfinite, nvme_dir: str | None = None,
                 nvme_budget: float | None = None, process_group=None, accumulation: str = Settings.accumulation,
                 hardware: HardwareProfile | None = None, max_consecutive_skips: int | None = None,
                 share_device: "Engine | None" = None, share_frozen: bool = False,
                 updates: str = Settings.updates):
        if not isinstance(model, nn.Module):
            raise MegacompileError(f"compile() takes an nn.Module, got {type(model).__name__}")
        # Every plain setting checked at once, by the one check (megacompile/settings.py).
        self.settings = Settings(hbm_budget=hbm_budget, compute_dtype=compute_dtype, device=device, retrace=retrace,
                                 dump_dir=dump_dir, grad_accum=grad_accum, fuse=fuse, host_budget=host_budget,
                                 on_nonfinite=on_nonfinite, nvme_dir=nvme_dir, nvme_budget=nvme_budget,
                                 accumulation=accumulation, updates=updates).for_a_run()
        self.budget_bytes = self.settings.budget_bytes
        if not any(True for _ in model.parameters()):
            raise MegacompileError(f"{type(model).__name__} has no parameters: there is nothing to train")
        # A model quantized in memory (bitsandbytes, GPTQ, AWQ, HQQ, torchao, FP8, ...) would train as wrong numbers.
        refuse_quantized_model(model)
        host_bytes = self.settings.host_budget_bytes
        optimizer = given_optimizer(optimizer, model)
        # Data parallelism over torch.distributed (an initialised group of 2 or more, or process_group=).
        self.data_parallel = data_parallel_for(process_group)
        self.settings.check_updates(clip=optimizer.max_grad_norm not in (None, math.inf),
                                    ranks=1 if self.data_parallel is None else 2)
        device = self.settings.device
        if device is None and self.data_parallel is not None:
            device = arguments.device(self.data_parallel.default_device())
        arguments.callable_or_none("loss_fn", loss_fn)
        self.nvme_dir = self.settings.nvme_dir
        self.nvme_budget_bytes = self.settings.nvme_budget_bytes
        self.host_cost = None        # where the host state lives and what it takes (cost/host_memory.py)
        self.host_budget_bytes = host_bytes if host_bytes is not None else default_host_budget_bytes()
        if self.data_parallel is not None:    # the budget is the node's: each of its ranks plans in its part
            self.host_budget_bytes //= self.data_parallel.per_node
        # The model, its masters and moments, the optimizer and the counters: what io/ and
        # distributed/ read and write (state/training.py).
        self.state = TrainingState(model, optimizer, compute_dtype=compute_dtype, grad_accum=grad_accum,
                                   data_parallel=self.data_parallel)
        self.state.torch_optimizer.hold_state(TorchAdamWState(self.state))   # its state_dict: the moments
        self.loss_fn = loss_fn
        self.retrace = retrace
        self.dump_dir = dump_dir
        # The profile plans are timed with; None: the backend's own (cost.profile_for, at the first plan).
        if hardware is not None and not isinstance(hardware, HardwareProfile):
            raise ArgumentError(f"hardware is a HardwareProfile to time plans with, or None for the device's own; "
                                f"got {hardware!r}")
        self.hardware = hardware
        self.accumulation = accumulation   # engine/layer_major_step.py
        if self.accumulation == "layer" and self.data_parallel is not None:
            raise ArgumentError(f"accumulation={accumulation!r} is not supported with data parallelism yet: "
                                "use accumulation='micro' (the default) or 'auto' with process groups")
        if self.data_parallel is not None:
            self.accumulation = "micro"     # 'auto' has one choice with process groups
        if self.nvme_dir is not None and self.data_parallel is not None:
            raise ArgumentError("the disk tier (nvme_dir) is not sharded across ranks: drop nvme_dir with process "
                                "groups (each rank keeps its share of the host state in RAM: docs/distributed.md)")
        if not isinstance(share_frozen, bool) or (share_frozen and share_device is None):
            raise ArgumentError(f"share_frozen is True or False, and True only with share_device=engine (whose frozen "
                                f"weights this one then shares); got share_frozen={share_frozen!r}"
                                + ("" if share_device is not None else " without share_device"))
        if share_device is None:
            self.backend = make_backend(device, self.budget_bytes)
            self.device_share, self.device_owner = SharedDevice(self.backend), None
            # Its threads end at close(), when the engine is dropped, or at exit (runtime/shutdown.py).
            shutdown.watch(self.backend)
            self._end = weakref.finalize(self, shutdown.end, self.backend)
        else:       # the owner's device (engine/shared_device.py); held, so it outlives this engine
            self.device_share = join(share_device, self.budget_bytes, device, self.data_parallel)
            self.backend, self.device_owner, self._end = self.device_share.backend, share_device, lambda: None
        self.device_share.engines.add(self)
        self.share_frozen = share_frozen     # borrow the owner's frozen weights (engine/host_setup.py)
        # Fused kernels by default on a GPU; on the cpu backend they run in Triton's interpreter,
        # far slower than ATen, so only when asked for.
        self.fuse = fused(fuse, on_gpu=self.backend.name == "cuda")
        # Checkpoints: one process's folder writer, or each rank its share of it.
        self._checkpoints = LocalCheckpoints() if self.data_parallel is None else ShardedCheckpoints()
        # A KV cache has no place in a training step: off on every config the model holds (a wrapper's
        # inner Hugging Face model carries its own); a vision-language model's text config holds its own flag.
        configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}
        for config in configs.values():
            for c in (config, getattr(config, "get_text_config", lambda: None)()):
                if getattr(c, "use_cache", False):
                    c.use_cache = False
        self.device = self.backend.device
        self._captured: dict[tuple, CapturedModel] = PlanCache()
        self._logged_blocks: dict = {}    # the blocks' calls its captures logged (capture.top.blocks_logged_before)
        self._compiled: dict[tuple, _Compiled] = PlanCache()
        self._shapes_seen = 0
        # Seconds the set-up took, by phase (capture, host state: its allocation and the weights
        # streamed into it, plan), summed over every input shape: where a first step's wait went.
        self.setup_seconds: dict[str, float] = {}
        self._input_limits = arguments.InputLimits(model)
        self._last: _Compiled | None = None
        self._last_train: _Compiled | None = None
        self._prepared: Prepared | None = None     # adopt()
        self.on_nonfinite = on_nonfinite
        # With "skip": this many optimizer steps skipped in a row raise NonFiniteError (engine/skip_streak.py).
        if max_consecutive_skips is not None:
            arguments.count("max_consecutive_skips", max_consecutive_skips, what=" (skipped steps in a row that stop "
                            "the run; None: never)")
        self.skip_streak = SkipStreak(max_consecutive_skips, "compile(..., max_consecutive_skips=N) sets how many "
                                      "skipped steps in a row raise this (None: never)")
        self.last_step: StepRecord | None = None
        # What the last step() call's forward handed out beside its loss (step(), engine/step.py _hand_out).
        self.last_outputs: dict[str, torch.Tensor] | None = None
        self.accumulated_outputs: list[dict[str, torch.Tensor]] = []
        self._busy = self.device_share.lock      # one call at a time on the device, whichever engine's
        self._closed = False
        model_params.attach(self.state)   # model.state_dict() reads the trained weights

    # -- the training state, read through the engine ---------------------------------------
    @property
    def host(self) -> HostState | None:
        """The fp32 masters, AdamW moments and gradient sums; None until the first trace."""
        return self.state.host

    model = property(lambda self: self.state.model)
    optimizer = property(lambda self: self.state.optimizer)
    torch_optimizer = property(lambda self: self.state.torch_optimizer,
                               doc="torch LR schedulers attach here")
    compute_dtype = property(lambda self: self.state.compute_dtype)
    grad_accum = property(lambda self: self.state.grad_accum)
    steps_done = property(lambda self: self.state.steps_done, doc="optimizer steps")
    micro_batches = property(lambda self: self.state.micro_batches, doc="step() calls that committed")
    skipped_steps = property(lambda self: self.state.skipped_steps,
                             doc="steps dropped for an inf or NaN loss or gradient")
    run_id = property(lambda self: self.state.run_id, doc="names the run in its checkpoints")
    source_dir = property(lambda self: self.state.source_dir,
                          doc="the Hugging Face folder from_pretrained read, if any")
    waiting_micro_batches = property(lambda self: self.state.waiting_micro_batches,
                                     doc="a layer-major step's inputs so far")

    # -- compiling -----------------------------------------------------------------------
    def _signature(self, args: tuple, kwargs: dict, train: bool) -> tuple:
        return signature(self.model, args, kwargs, train)

    def adopt(self, prepared: Prepared) -> None:
        """Take a capture and plan made before this engine (engine/prepared.py): the first call
        with their inputs runs them instead of tracing and planning again."""
        self._prepared = prepared

    def _compile(self, args: tuple, kwargs: dict, train: bool, update: bool = True) -> _Compiled:
        signature = self._signature(args, kwargs, train)
        kind = StepKind(update=update and train, clip=self.optimizer.max_grad_norm is not None,
                        updates=self.settings.updates)
        compiled = self._compiled.get((signature, kind))
        if compiled is not None:
            return compiled
        # Tracing and planning may draw random numbers (a first calibration of the cpu profile
        # does): the user's random stream, which dropout reads and a checkpoint restores, must come
        # out as it went in, or a run resumed on a fresh engine draws other masks.
        with torch.random.fork_rng(devices=[self.device] if self.backend.name == "cuda" else []):
            return self._build(args, kwargs, train, signature, kind)

    def _build(self, args: tuple, kwargs: dict, train: bool, signature: tuple, kind: StepKind) -> _Compiled:
        captured, start = self._captured.get(signature), None
        if captured is None:
            previous = next((c for k, c in self._captured.items() if k[0] == train), None)
            if previous is not None and not self.retrace:
                raise InputMismatchError(
                    f"{'step()' if train else 'the forward'} got inputs {_describe(args, kwargs)}, but the plan "
                    f"was built for {_describe_meta(previous)}; pass inputs of the traced shapes, or "
                    "compile(..., retrace=True) to build a plan per input shape")
            start = time.perf_counter()
            prepared = self._prepared
            if prepared is not None and prepared.captures(self.model, signature, self.device, self.compute_dtype,
                                                                 self.loss_fn):
                captured = prepared.captured
            else:
                with blocks_logged_before(self._logged_blocks):
                    captured = capture(self.model, args, kwargs, device=self.device, compute_dtype=self.compute_dtype,
                                       loss_fn=self.loss_fn, train=train)
                self._spent("capture", start)
            self._captured[signature] = captured
            self._shapes_seen += 1
        if self.host is None:
            host_start = time.perf_counter()
            build_host_state(self, captured)     # engine/host_setup.py
            self._spent("host state", host_start)
        request = PlanRequest(
            self.budget_bytes, kind, self.backend.name, self.hardware or profile_for(self.backend.name),
            host_bytes=self.host.nbytes + self.host_cost.module_bytes, host_cost=self.host_cost,
            host_budget_bytes=self._host_room(), fuse=self.fuse, grad_accum=self.grad_accum,
            accumulation=self.accumulation, dump_dir=self.dump_dir)
        prepared = self._prepared
        if prepared is not None and prepared.captured is captured and prepared.request == request:
            plan = prepared.plan
        else:
            plan_start = time.perf_counter()

            def flash() -> CapturedModel:     # the capture with FlashAttention's op, for a fused plan
                return capture(self.model, args, kwargs, device=self.device, compute_dtype=self.compute_dtype,
                               loss_fn=self.loss_fn, train=train, flash_attention=True)
            plan = faster_attention_plan(lambda c: make_plan(c, request), captured, flash if self.fuse else None)
            self._spent("plan", plan_start)
        executor = Executor(plan.captured, plan.program, self.backend, self.host, self.state.update.adamw,
                            self.state.update.clip)
        measured = MeasuredRun(self.backend.timeline)     # its measured step, for traces and the memory picture
        compiled = _Compiled(plan.captured, plan.with_measured(measured), executor, measured)
        self._compiled[(signature, kind)] = compiled
        if start is not None:   # a new input signature: traced and planned just now
            note_new_shape(self._shapes_seen, time.perf_counter() - start, _describe(args, kwargs),
                           grids=bool(grid_key(kwargs)))
        if train:
            self._last_train = compiled
        return compiled

    def _host_room(self) -> int:
        """The host budget this engine's state plans in: the machine's, less what the engines sharing
        its device hold (engine/shared_device.py)."""
        return self.device_share.host_room(self, self.host_budget_bytes)[0]

    def host_plan_bytes(self) -> int:
        """Host bytes this engine's plans say it holds: its state, as placed (0 before its first
        plan), and the offloaded activations of its largest plan."""
        state = self.host_cost.ram_bytes if self.host_cost is not None else 0
        return state + max((c.plan.stash_bytes for c in self._compiled.values()), default=0)

    def _spent(self, phase: str, start: float) -> None:
        self.setup_seconds[phase] = self.setup_seconds.get(phase, 0.0) + time.perf_counter() - start

    def _inputs(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        return [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]

    def _require_weights(self) -> None:
        if not self.state.materialized:
            raise state_dict.missing_error(self.state)

    def prepare(self, *args, train: bool = True, **kwargs) -> Plan:
        """Build (and verify) the plan for these inputs without running it: says whether the model
        fits before the first step. The inputs only lend their shapes (and image grids, with a
        Qwen2.5-VL's 3D positions computed from them); nothing is trained."""
        return self._compile(args, with_rope_positions(self.model, args, kwargs), train=train).plan

    # -- running -------------------------------------------------------------------------
    def step(self, *args, **kwargs) -> float:
        """Forward and backward of one micro-batch; returns its loss.

        With grad_accum=k (compile), gradients of k consecutive calls add up (each scaled by 1/k,
        as eager code does with (loss / k).backward()) and the k-th call runs host AdamW over the
        fp32 masters. With k=1 (the default) every call is a full optimizer step.

        A model whose forward returns `megacompile.LossAndOutputs(loss, {name: tensor})` hands
        those tensors out of the same forward whose gradient the step takes, detached: after the
        call `engine.last_outputs` maps each name to its value on the host (the call's micro-batch;
        None where the call raised, or its micro-batch waits for the rest of a layer-major step,
        whose last call sets `engine.accumulated_outputs`, one dict per micro-batch). A step
        skipped for an inf or NaN still hands out its forward's values; other models give {}.
        """
        self.last_outputs, self.accumulated_outputs = None, []      # set once a walk has ended
        self._input_limits.check(args, kwargs, self.backend.name)
        self.state.refuse_partial("step()")
        # A step trains whatever the caller's grad mode (what runs eagerly inside it, such as the
        # gated delta rule's backward, takes gradients).
        with self._in_use("step()"), torch.enable_grad():
            return self._step(args, with_rope_positions(self.model, args, kwargs))

    def weighted_step(self, weight: float, *args, **kwargs) -> float:
        """step() whose micro-batch weighs `weight` in the optimizer step: its loss gradient is
        `weight`, not 1/grad_accum. Token-weighted accumulation, as transformers' Trainer weighs
        micro-batches by num_items_in_batch: weight = the micro-batch's counted tokens over the
        step's, so the step trains the mean over all its tokens rather than the mean of its
        micro-batches' means. A step's weights should add up to 1 (nothing checks it: a sum of
        2 doubles the gradient). A micro-batch with no counted token (every label -100) has no
        loss to weigh (its mean is 0/0, NaN, whatever its weight, and the step is skipped): leave it
        out and give the step's other micro-batches weights that add up to 1 over theirs, as
        `megacompile train` does (a step is still grad_accum calls). Under data parallelism each
        rank's gradient is still averaged with the others' (docs/distributed.md)."""
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                or weight <= 0:
            raise ArgumentError(f"weighted_step: weight must be a finite number > 0 (the micro-batch's share of the "
                                f"step, such as its counted tokens over the step's); got {weight!r}"
                                + (". A micro-batch with no counted token (every label -100) is left out of the "
                                   "step: run grad_accum others whose weights add up to 1" if weight == 0 else ""))
        self.last_outputs, self.accumulated_outputs = None, []
        self._input_limits.check(args, kwargs, self.backend.name)
        self.state.refuse_partial("step()")
        with self._in_use("step()"), torch.enable_grad():
            return self._step(args, with_rope_positions(self.model, args, kwargs), float(weight))

    def _step(self, args: tuple, kwargs: dict, weight: float | None = None) -> float:
        """One micro-batch, all or nothing (engine/step.py)."""
        started = time.perf_counter()
        if self.grad_accum > 1 and self.accumulation != "micro":
            loss = layer_major_step(self, args, kwargs, started, weight)
            if loss is not NotImplemented:
                return loss
        micro = self.state.micro_batches % self.grad_accum
        last = micro == self.grad_accum - 1
        compiled = self._compile(args, kwargs, train=True, update=last)
        compiled.captured.check_inputs(self._inputs(args, kwargs))
        self._require_weights()
        return run_step(self, compiled, self._inputs(args, kwargs), micro=micro, last=last,
                        tokens=tokens(args, kwargs), started=started, weights=[weight])

    @contextmanager
    def _in_use(self, what: str):
        """One caller at a time, and none after close(): a step's plans, events and host buffers
        belong to a single walk."""
        if self._closed:
            raise MegacompileError(f"{what} on a closed engine: close() stopped its streams; "
                                   "compile the model again to keep training")
        if self.device_share.closed:
            raise MegacompileError(f"{what} on an engine whose shared device was closed (the engine it was compiled "
                                   "with share_device= closed its streams)")
        if not self._busy.acquire(blocking=False):
            raise MegacompileError(f"{what} was called while another call runs on this engine or one sharing its "
                                   "device (another thread): a device runs one step or forward at a time; use one "
                                   "engine per thread")
        try:
            yield
        finally:
            self._busy.release()

    def synchronize(self) -> None:
        """Wait for host updates still running, and bring the model's own parameters (where it holds
        real ones) up to date with the trained masters: after it, `model.state_dict()` and
        `model.save_pretrained()` see the trained weights (io/model_params.py)."""
        model_params.synchronize(self.state)

    @torch.no_grad()
    @torch.inference_mode(False)   # the copy streams write device tensors this thread makes
    def __call__(self, *args, **kwargs) -> Any:
        """The model's forward under the same budget, without gradients; returns its output."""
        self._input_limits.check(args, kwargs, self.backend.name, train=False)
        with self._in_use("the forward"):
            return self._forward(args, with_rope_positions(self.model, args, kwargs))

    def _forward(self, args: tuple, kwargs: dict) -> Any:
        compiled = self._compile(args, kwargs, train=False)
        compiled.captured.check_inputs(self._inputs(args, kwargs))
        self._require_weights()
        outputs = compiled.executor.run(self._inputs(args, kwargs))
        compiled.measured.peak_bytes = self.backend.memory.peak_bytes
        self._last = compiled
        return compiled.captured.rebuild_output(outputs)

    # -- reading -------------------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        """The training plan (the last one used, if there are several)."""
        compiled = self._last_train or self._last
        if compiled is None:
            raise MegacompileError("no plan yet: the plan is built at the first step() or forward call, "
                                   "from the inputs' shapes (megacompile.plan(...) plans without running)")
        return compiled.plan

    @property
    def timeline(self):
        return self.backend.timeline

    def trace(self, path: str) -> None:
        """Write the last step as a Chrome trace (Perfetto, chrome://tracing): the plan's predicted
        timeline and the measured one, per stream, with device bytes and the budget (report/trace.py).
        Before any step, the prediction alone. Waits for the step's host updates first."""
        from ..report import write_trace
        plan = self._last.plan if self._last is not None else self.plan
        self.state.wait_updates()
        write_trace(path, plan, self.backend.timeline)

    def memory_stats(self) -> dict:
        """Device peak measured in the last run beside the predicted one, and host bytes. The
        device peak is the ledger's (equal to the prediction when the plan is right); on a GPU the
        caching allocator's own peaks of the last run sit beside it (allocator_peak_allocated_bytes,
        allocator_peak_reserved_bytes: what the device really gave, workspaces and scratch included;
        allocator_alloc_retries, of the last run, and _total, since the engine opened: how often the
        allocator hit the cap and flushed its cache, goal 0; allocator_conf: its segments' setting).
        Host: the state's bytes (host_bytes, and by part: host_parts) beside the plan's figure
        (predicted_host_bytes: the state and what of the model's own weights it cannot share), and
        the process's resident set as measured now (host_resident_bytes: the interpreter, torch and
        the data pipeline included).
        The device arena (runtime/arena.py): device_arena_bytes (allocated once, the largest plan's),
        fragmentation (the last plan's arena above its peak: alignment and packing),
        device_allocations_last_step (device tensors the last step held outside the arena, goal 0;
        device_allocations_outside names them) and device_copies_into_arena_last_step (results of
        ops with no out= form, copied into their arena tensors: scratch the size of the result)."""
        compiled = self._last
        executor = compiled.executor if compiled else None
        arena = executor.arena_plan if executor is not None else None
        return {
            "device_peak_bytes": compiled.measured.peak_bytes if compiled else None,
            "predicted_device_peak_bytes": compiled.plan.predicted_peak_bytes if compiled else None,
            "device_budget_bytes": self.budget_bytes,
            "device_live_bytes": self.backend.memory.live_bytes,
            "host_bytes": self.host.nbytes if self.host else None,
            "host_parts": ({**self.host.parts(), "the model's own weights": model_params.own_bytes(self.state)}
                           if self.host else None),
            "predicted_host_bytes": self.host_cost.ram_bytes if self.host_cost is not None else None,
            "host_resident_bytes": resident_set_bytes(),
            "device_arena_bytes": self.backend.arena.size,
            "fragmentation": arena.fragmentation if arena is not None else None,
            "device_allocations_last_step": len(self.backend.memory.outside) if arena is not None else None,
            "device_allocations_outside": list(self.backend.memory.outside[:16]) if arena is not None else None,
            "device_copies_into_arena_last_step": executor.copied.count if arena is not None else None,
            **self.backend.allocator_stats(),
        }

    def close(self) -> None:
        """Stop the engine's streams (after the running updates finish); the host state stays
        readable (state_dict, save_checkpoint). Closing twice is harmless."""
        if self._closed:
            return
        if self.device_share.closed:     # a sharer after its device's owner: nothing of it runs there
            self.synchronize()
            self._closed = True
            return
        with self._in_use("close()"):
            self.synchronize()        # the model's own parameters get the trained weights
            self._closed = True
            if self.device_owner is None:     # the device's owner: its streams stop
                self.device_share.closed = True
            self._end()


def _describe(args: tuple, kwargs: dict) -> str:
    leaves, _ = pytree.tree_flatten((args, kwargs))
    return ", ".join(f"{tuple(x.shape)}:{str(x.dtype).replace('torch.', '')}" for x in leaves
                     if isinstance(x, torch.Tensor)) + describe_grids(kwargs)


def _describe_meta(captured: CapturedModel) -> str:
    return ", ".join(f"{m.shape}:{str(m.dtype).replace('torch.', '')}" for m in captured.inputs) + "".join(
        f", {g.name} {list(g.values)}" for g in captured.grids)
