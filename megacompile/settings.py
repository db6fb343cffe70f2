"""The plain settings of a run, in one place: one set of defaults and one check.

compile() (and the Engine), plan(), plan_global_batch, `megacompile plan` and run.yaml all build a
Settings from what they were given; building it checks every field with the checks of
arguments.py, so a setting is refused with the same words wherever it comes in. Objects (the
optimizer, loss_fn, a process group, a HardwareProfile) stay arguments beside it, and so do the
input shapes a plan is made for (batch, seq, inputs).

A field's default is the class attribute of the same name (`Settings.accumulation` is "micro"):
the signatures of compile() and plan() read their defaults from here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from . import arguments
from .errors import ArgumentError

GiB = 2 ** 30

# How the micro-batches of a step run (engine/layer_major_step.py, passes/layer_major.py).
ACCUMULATION = ("micro", "layer", "auto")
COMPUTE_DTYPES = (torch.float32, torch.bfloat16)
ON_NONFINITE = ("skip", "raise")
# When each owner's host AdamW update starts (passes/optimizer.py): once the whole step is known
# sound, or as soon as its gradients have landed (docs/decisions.md, "A step either happens
# completely or not at all").
UPDATES = ("at_commit", "as_gradients_land")
# The share of a GPU's memory a run plans in when no hbm_budget is given; the rest is left to the
# CUDA context, other processes and what the allocator cannot hand out.
DEVICE_SHARE = 0.9


@dataclass(frozen=True)
class Settings:
    """hbm_budget, host_budget, nvme_budget: GiB (2**30 bytes). hbm_budget None: not chosen yet
    (run.yaml derives it); compile() and plan() require it (budget_bytes)."""
    hbm_budget: float | None = None
    compute_dtype: torch.dtype = torch.float32
    device: str | torch.device | None = None
    retrace: bool = True
    dump_dir: str | None = None
    grad_accum: int = 1
    fuse: bool | None = None
    host_budget: float | None = None
    on_nonfinite: str = "skip"
    nvme_dir: str | None = None
    nvme_budget: float | None = None
    accumulation: str = "micro"
    updates: str = "at_commit"

    def __post_init__(self):
        arguments.budget_bytes("hbm_budget", self.hbm_budget, optional=True)
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ArgumentError(f"compute_dtype must be torch.float32 or torch.bfloat16, got {self.compute_dtype!r}; "
                                "masters are always float32")
        arguments.count("grad_accum", self.grad_accum, what=" (micro-batches per optimizer step)")
        if self.on_nonfinite not in ON_NONFINITE:
            raise ArgumentError(f"on_nonfinite says what a step with an inf or NaN loss or gradient does: "
                                f"'skip' (warn, update nothing) or 'raise' (NonFiniteError); got {self.on_nonfinite!r}")
        arguments.budget_bytes("host_budget", self.host_budget, optional=True)
        object.__setattr__(self, "device", arguments.device(self.device))
        arguments.flag("retrace", self.retrace)
        arguments.flag("fuse", self.fuse, optional=True)
        arguments.folder("dump_dir", self.dump_dir)
        object.__setattr__(self, "nvme_dir", arguments.disk_folder("nvme_dir", self.nvme_dir))
        arguments.budget_bytes("nvme_budget", self.nvme_budget, optional=True)
        if self.accumulation not in ACCUMULATION:
            raise ArgumentError("accumulation says how the micro-batches of a step run: 'micro' (each step() call "
                                "through the whole model, the default), 'layer' (all of a step's micro-batches "
                                "through each block while its weights are on the device) or 'auto' (the planner's "
                                f"choice by predicted time); accumulation must be one of {', '.join(ACCUMULATION)}; "
                                f"got {self.accumulation!r}")

        if self.updates not in UPDATES:
            raise ArgumentError("updates says when each owner's host AdamW update starts: 'at_commit' (the default: "
                                "once the whole step is known sound, overlapping the next forward) or "
                                "'as_gradients_land' (as soon as its gradients are on the host, overlapping the "
                                f"rest of the backward); got {self.updates!r}")
        if self.updates == "as_gradients_land":
            if self.grad_accum > 1:
                raise ArgumentError(f"updates='as_gradients_land' needs grad_accum=1 (an update starts as its owner's "
                                    f"gradient lands, which is the step's whole gradient only then); got grad_accum="
                                    f"{self.grad_accum}: use updates='at_commit' with accumulation")
            if self.nvme_dir is not None or self.nvme_budget is not None:
                given = "nvme_dir" if self.nvme_dir is not None else "nvme_budget"
                raise ArgumentError(f"updates='as_gradients_land' is not built for the disk tier ({given}), which "
                                    "reads each owner's state ahead in the order the updates start at commit: drop "
                                    f"{given} or use updates='at_commit'")

    def check_updates(self, *, clip: bool, ranks: int = 1) -> None:
        """What `updates` needs of the optimizer and the process group: an update that starts as its
        gradients land cannot wait for a global norm, nor for the other ranks' sums. clip: the
        optimizer scales by the global norm (a finite max_grad_norm; math.inf only measures it,
        which needs no wait)."""
        if self.updates != "as_gradients_land":
            return
        if clip:
            raise ArgumentError("updates='as_gradients_land' cannot clip gradients: the global norm is known only "
                                "after the last gradient lands, and every update scales by it; use AdamW("
                                "max_grad_norm=None) (math.inf measures the norm without clipping) or "
                                "updates='at_commit'")
        if ranks > 1:
            raise ArgumentError("updates='as_gradients_land' is not built for data parallelism (a step commits "
                                "or skips on every rank together): use updates='at_commit' with process groups")

    def replace(self, **changes: Any) -> Settings:
        """These settings with some changed, checked again."""
        return dataclasses.replace(self, **changes)

    def for_a_run(self) -> Settings:
        """The checks of settings that run (compile(), run.yaml), beyond those of a plan: a disk
        tier bounded by nvme_budget needs its folder (plan() sizes a tier without one)."""
        if self.nvme_budget is not None and self.nvme_dir is None:
            raise ArgumentError("nvme_budget bounds the disk tier in nvme_dir: give nvme_dir=PATH too")
        return self

    @property
    def budget_bytes(self) -> int:
        return arguments.budget_bytes("hbm_budget", self.hbm_budget)

    @property
    def host_budget_bytes(self) -> int | None:
        return arguments.budget_bytes("host_budget", self.host_budget, optional=True)

    @property
    def nvme_budget_bytes(self) -> int | None:
        return arguments.budget_bytes("nvme_budget", self.nvme_budget, optional=True)


def default_hbm_budget(device: str | torch.device = "cuda") -> float:
    """GiB: the budget a run plans in on this GPU when none is given (DEVICE_SHARE of it)."""
    return DEVICE_SHARE * torch.cuda.get_device_properties(torch.device(device)).total_memory / GiB


def from_call(door, settings: "Settings | None", given: dict[str, Any]) -> dict[str, Any]:
    """The plain settings of a call to a front door (compile, plan, minimum_budget): its keywords as
    given, or with `settings`, the Settings' own fields. A keyword the caller set (not at the door's
    default) must then agree with the settings: a setting is given once."""
    if settings is None:
        return given
    if not isinstance(settings, Settings):
        raise ArgumentError(f"settings must be a megacompile.Settings, got {type(settings).__name__}")
    import inspect
    defaults = inspect.signature(door).parameters
    taken = {}
    for name, value in given.items():
        mine = getattr(settings, name)
        default = defaults[name].default if name in defaults else None
        if not _same(value, default) and not _same(value, mine):
            raise ArgumentError(f"{name} is given twice: {value!r} as a keyword and {mine!r} in settings; "
                                "give each setting once")
        taken[name] = mine
    return taken


def _same(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    if isinstance(a, (str, torch.device)) and isinstance(b, (str, torch.device)):
        return str(a) == str(b)
    return a == b
