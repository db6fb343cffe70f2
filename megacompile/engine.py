"""The Engine that compile() returns: step() trains, calling it runs the forward only.

The engine captures the model lazily, at the first call with real inputs (it needs their shapes),
and keeps one plan per input signature: a call with other shapes builds and verifies a new plan
(or, with retrace=False, raises InputMismatchError). Host state (fp32 masters, AdamW moments,
gradients) is shared by every plan.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from .capture import CapturedModel, capture
from .capture.loss import LossFn
from .errors import InputMismatchError, MegacompileError
from .optim import AdamW
from .optim.lr_handle import LearningRateHandle
from .passes import StepKind
from .optim.fused_adamw import adamw_update_
from .plan import Plan
from .planner import make_plan, require_host_room
from .planning import host_bytes_of
from .runtime import Executor, HostState, make_backend

GiB = 2 ** 30


@dataclass
class _Compiled:
    captured: CapturedModel
    plan: Plan
    executor: Executor


class Engine:
    def __init__(self, model: nn.Module, hbm_budget: float, *, optimizer: AdamW | None = None,
                 compute_dtype: torch.dtype = torch.float32, device: str | torch.device | None = None,
                 loss_fn: LossFn | None = None, retrace: bool = True, dump_dir: str | None = None,
                 grad_accum: int = 1, fuse: bool | None = None, host_budget: float | None = None):
        if not isinstance(model, nn.Module):
            raise MegacompileError(f"compile() takes an nn.Module, got {type(model).__name__}")
        if not isinstance(hbm_budget, (int, float)) or not hbm_budget > 0:
            raise MegacompileError(f"hbm_budget is the device memory the plan may use, in GiB (2**30 bytes), "
                                   f"and must be a positive number; got {hbm_budget!r}")
        if compute_dtype not in (torch.float32, torch.bfloat16):
            raise MegacompileError(f"compute_dtype must be torch.float32 or torch.bfloat16, got {compute_dtype}; "
                                   "masters are always float32")
        if not isinstance(grad_accum, int) or grad_accum < 1:
            raise MegacompileError(f"grad_accum is the number of micro-batches per optimizer step, an int >= 1; "
                                   f"got {grad_accum!r}")
        if not any(True for _ in model.parameters()):
            raise MegacompileError(f"{type(model).__name__} has no parameters: there is nothing to train")
        if host_budget is not None and (not isinstance(host_budget, (int, float)) or not host_budget > 0):
            raise MegacompileError(f"host_budget is the host RAM the plan may use, in GiB, and must be a positive "
                                   f"number (or None for 90% of this machine's RAM); got {host_budget!r}")
        self.model = model
        self.budget_bytes = int(hbm_budget * GiB)
        self.host_budget_bytes = int(host_budget * GiB) if host_budget is not None else int(0.9 * physical_ram())
        self.optimizer = optimizer or AdamW()
        self.compute_dtype = compute_dtype
        self.loss_fn = loss_fn
        self.retrace = retrace
        self.dump_dir = dump_dir
        self.grad_accum = grad_accum
        self.backend = make_backend(device, self.budget_bytes)
        # Fused kernels by default on a GPU; on the cpu backend they run in Triton's interpreter,
        # far slower than ATen, so only when asked for.
        self.fuse = (self.backend.name == "cuda") if fuse is None else fuse
        self.torch_optimizer = LearningRateHandle(self.optimizer)
        if getattr(getattr(model, "config", None), "use_cache", False):
            model.config.use_cache = False   # a KV cache has no place in a training step
        self.device = self.backend.device
        self.host: HostState | None = None
        self._materialized = not any(p.is_meta for p in model.parameters())
        # state_dict key -> the parameter/buffer name it stands for (tied weights share one)
        first = {id(t): n for n, t in reversed(list(model.named_parameters()) + list(model.named_buffers()))}
        self._canonical = {k: first.get(id(t), k) for k, t in model.state_dict(keep_vars=True).items()}
        self._captured: dict[tuple, CapturedModel] = {}
        self._compiled: dict[tuple, _Compiled] = {}
        self._last: _Compiled | None = None
        self._last_train: _Compiled | None = None
        self.steps_done = 0          # optimizer steps
        self.micro_batches = 0       # step() calls

    # -- compiling -----------------------------------------------------------------------
    def _signature(self, args: tuple, kwargs: dict, train: bool) -> tuple:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        shape = tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else ("const", repr(x))
                      for x in leaves)
        return (train, self.model.training, str(spec), shape)

    def _compile(self, args: tuple, kwargs: dict, train: bool, update: bool = True) -> _Compiled:
        signature = self._signature(args, kwargs, train)
        kind = StepKind(update=update and train, clip=self.optimizer.max_grad_norm is not None)
        compiled = self._compiled.get((signature, kind))
        if compiled is not None:
            return compiled
        captured = self._captured.get(signature)
        if captured is None:
            previous = next((c for k, c in self._captured.items() if k[0] == train), None)
            if previous is not None and not self.retrace:
                raise InputMismatchError(
                    f"{'step()' if train else 'the forward'} got inputs {_describe(args, kwargs)}, but the plan "
                    f"was built for {_describe_meta(previous)}; pass inputs of the traced shapes, or "
                    "compile(..., retrace=True) to build a plan per input shape")
            captured = capture(self.model, args, kwargs, device=self.device, compute_dtype=self.compute_dtype,
                               loss_fn=self.loss_fn, train=train)
            self._captured[signature] = captured
        if self.host is None:
            # Before allocating: too little host RAM must fail here, not in the allocator.
            require_host_room(host_bytes_of(self.model, self.compute_dtype), self.host_budget_bytes)
            self.host = HostState(captured, self.compute_dtype, pin=self.backend.name == "cuda",
                                  grad_accum=self.grad_accum)
            if self._materialized:
                self.host.load_module(self.model)
        plan = make_plan(captured, self.budget_bytes, kind, backend=self.backend.name,
                         host_bytes=self.host.nbytes, dump_dir=self.dump_dir, fuse=self.fuse,
                         host_budget_bytes=self.host_budget_bytes)
        executor = Executor(plan.captured, plan.program, self.backend, self.host, self._adamw, self._clip)
        compiled = _Compiled(plan.captured, plan, executor)
        self._compiled[(signature, kind)] = compiled
        if train:
            self._last_train = compiled
        return compiled

    def _step_context(self) -> dict:
        """Fixed when a step starts, read by its updates on the host stream (which may still be
        running while the next step begins)."""
        step = self.steps_done + 1
        opt = self.optimizer
        lr = opt.lr_at(step) if callable(opt.lr) else float(self.torch_optimizer.param_groups[0]["lr"])
        return {"step": step, "lr": lr, "grad_scale": 1.0}

    def _clip(self, context: dict) -> None:
        norm = self.host.grad_sq_norm(context.pop("owner_sq_norms", None)) ** 0.5
        context["grad_norm"] = norm
        # torch.nn.utils.clip_grad_norm_: coefficient max_norm / (norm + 1e-6), at most 1
        context["grad_scale"] = min(1.0, self.optimizer.max_grad_norm / (norm + 1e-6))

    def _adamw(self, stage: int, context: dict) -> None:
        buffers = self.host.owners[stage]
        opt = self.optimizer
        adamw_update_(buffers.master, buffers.grad, buffers.exp_avg, buffers.exp_avg_sq,
                      lr=context["lr"], beta1=opt.betas[0], beta2=opt.betas[1], eps=opt.eps,
                      weight_decay=opt.weight_decay, step=context["step"], grad_scale=context["grad_scale"],
                      out=None if buffers.compute is buffers.master else buffers.compute,
                      **({"backend": "torch"} if opt.kernel == "torch" else {}))

    def _inputs(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        return [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]

    def _require_weights(self) -> None:
        if not self._materialized:
            raise MegacompileError(
                "the model was built on the meta device and has no weights: load them with "
                "engine.load_state_dict(state_dict) before step() or a forward")

    def prepare(self, *args, train: bool = True, **kwargs) -> Plan:
        """Build (and verify) the plan for these inputs without running it: says whether the model
        fits before the first step. The inputs only lend their shapes; nothing is computed."""
        return self._compile(args, kwargs, train=train).plan

    # -- running -------------------------------------------------------------------------
    def step(self, *args, **kwargs) -> float:
        """Forward and backward of one micro-batch; returns its loss.

        With grad_accum=k (compile), gradients of k consecutive calls add up (each scaled by 1/k,
        as eager code does with (loss / k).backward()) and the k-th call runs host AdamW over the
        fp32 masters. With k=1 (the default) every call is a full optimizer step.
        """
        micro = self.micro_batches % self.grad_accum
        last = micro == self.grad_accum - 1
        compiled = self._compile(args, kwargs, train=True, update=last)
        self._require_weights()
        # The last step's updates may still be running: the plan waits for each owner's update
        # before its first prefetch, so they finish before this step's offloads touch the grads.
        self.host.begin_micro_batch(first=micro == 0)
        (loss,) = compiled.executor.run(self._inputs(args, kwargs), seed=1.0 / self.grad_accum,
                                        context=self._step_context())
        self.micro_batches += 1
        if last:
            self.steps_done += 1
            self.torch_optimizer.step()   # tells attached torch LR schedulers a step happened
        compiled.plan.measured_peak_bytes = self.backend.memory.peak_bytes
        self._last = self._last_train = compiled
        return float(loss)

    def synchronize(self) -> None:
        """Wait for host updates still running (state_dict and load_state_dict do this)."""
        if self.host is not None:
            self.host.wait_updates()

    @torch.no_grad()
    def __call__(self, *args, **kwargs) -> Any:
        """The model's forward under the same budget, without gradients; returns its output."""
        compiled = self._compile(args, kwargs, train=False)
        self._require_weights()
        outputs = compiled.executor.run(self._inputs(args, kwargs))
        compiled.plan.measured_peak_bytes = self.backend.memory.peak_bytes
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

    def memory_stats(self) -> dict:
        """Device peak measured in the last run beside the predicted one, and host bytes. The
        device peak is the ledger's (equal to the prediction when the plan is right); on a GPU the
        caching allocator's own peaks of the last run sit beside it (allocator_peak_allocated_bytes,
        allocator_peak_reserved_bytes: what the device really gave, workspaces and scratch included)."""
        compiled = self._last
        return {
            "device_peak_bytes": self.backend.memory.peak_bytes if compiled else None,
            "predicted_device_peak_bytes": compiled.plan.predicted_peak_bytes if compiled else None,
            "device_budget_bytes": self.budget_bytes,
            "device_live_bytes": self.backend.memory.live_bytes,
            "host_bytes": self.host.nbytes if self.host else None,
            **self.backend.allocator_stats(),
        }

    def state_dict(self) -> "OrderedDict[str, torch.Tensor]":
        """float32 masters (and buffers) under the model's own names, tied names included."""
        if self.host is None:
            raise MegacompileError("no state yet: run step() once (or load_state_dict) first")
        self.synchronize()
        out: OrderedDict[str, torch.Tensor] = OrderedDict()
        for key, name in self._canonical.items():
            if name in self.host.slots:
                out[key] = self.host.master(name).clone()
            elif name in self.host.consts:
                out[key] = self.host.consts[name].clone()
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load weights into the masters; checks every name and shape before writing anything."""
        if self.host is None:
            raise MegacompileError("load_state_dict needs a plan: run one step()/forward first, or "
                                   "build the model with weights")
        self.synchronize()
        known = {**{n: s.shape for n, s in self.host.slots.items()},
                 **{n: tuple(t.shape) for n, t in self.host.consts.items()}}
        names = {key: self._canonical.get(key, key) for key in state}
        unexpected = [k for k, n in names.items() if n not in known]
        # Buffers are already on the host unless the model had no weights (built on meta).
        required = list(self.host.slots) + ([] if self._materialized else list(self.host.consts))
        missing = sorted(set(required) - set(names.values()))
        bad = [f"{k}: {tuple(t.shape)} (expected {tuple(known[names[k]])})" for k, t in state.items()
               if names[k] in known and tuple(t.shape) != tuple(known[names[k]])]
        if missing or bad or unexpected:
            raise MegacompileError(
                f"load_state_dict: missing {missing[:5]}, unexpected {unexpected[:5]}, wrong shapes {bad[:5]}; "
                "nothing was loaded (non-persistent buffers of a meta model must be passed too)")
        self.host.load({names[k]: t for k, t in state.items()})
        self._materialized = True

    def _host_or_error(self) -> HostState:
        if self.host is None:
            raise MegacompileError("no host state yet: the first step() or prepare(...) builds it")
        return self.host

    def save_checkpoint(self, path: str) -> None:
        """Write masters, AdamW moments, step counters and the random state to `path`, atomically."""
        from .checkpoint import save
        save(self, path)

    def load_checkpoint(self, path: str) -> None:
        """Resume from `path`: training continues exactly where the saved run left off."""
        from .checkpoint import load
        load(self, path)

    def close(self) -> None:
        self.synchronize()
        self.backend.close()


def _describe(args: tuple, kwargs: dict) -> str:
    leaves, _ = pytree.tree_flatten((args, kwargs))
    return ", ".join(f"{tuple(x.shape)}:{str(x.dtype).replace('torch.', '')}" for x in leaves
                     if isinstance(x, torch.Tensor))


def _describe_meta(captured: CapturedModel) -> str:
    return ", ".join(f"{m.shape}:{str(m.dtype).replace('torch.', '')}" for m in captured.inputs)


def physical_ram() -> int:
    """Bytes of RAM this machine has."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
