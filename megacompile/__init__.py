"""megacompile: train large LLMs at full precision on one GPU.

    engine = megacompile.compile(model, hbm_budget=80)   # GiB of device memory the plan may use
    loss = engine.step(input_ids=ids, labels=ids)        # forward + backward + host AdamW
    print(engine.plan)                                   # the schedule, readable
"""
from __future__ import annotations

import os
from typing import Callable

import torch
import torch.nn as nn

if not torch.cuda.is_available():
    # Without a GPU, Triton kernels (compile(..., fuse=True)) can only run in Triton's interpreter,
    # which Triton chooses when a function is decorated, its own library included: decide before
    # anything below imports triton (torch's flop counter does).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from .capture import LossAndOutputs
from .engine import Engine
from .errors import (BudgetExceededError, BudgetTooSmallError, CaptureError, HostMemoryError, InputMismatchError,
                     LossError, MegacompileError, NonFiniteError, OptimizerInputError, PartialStepError,
                     PlanVerificationError, StorageError, WeightsFileError)
from .optim import AdamW, hf_no_decay
from .settings import Settings, from_call
from .engine import from_pretrained
from .planner import Plan
from .planner import minimum_budget, plan  # plan without weights (planner/from_config.py)
from .planner import plan_stage  # a post-training stage's step from its parts (planner/posttrain_step.py)
from . import calibrate  # noqa: F401 - hands cost/ the cpu measurement, for a first plan on the cpu backend

__version__ = "0.1.0"


def compile(model: nn.Module, hbm_budget: float | None = None, *, settings: Settings | None = None,
            optimizer: AdamW | None = None,
            compute_dtype: torch.dtype = Settings.compute_dtype, device: str | torch.device | None = None,
            loss_fn: Callable | None = None, retrace: bool = Settings.retrace, dump_dir: str | None = None,
            grad_accum: int = Settings.grad_accum, fuse: bool | None = None, host_budget: float | None = None,
            on_nonfinite: str = Settings.on_nonfinite, nvme_dir: str | None = None, nvme_budget: float | None = None,
            process_group=None, accumulation: str = Settings.accumulation,
            max_consecutive_skips: int | None = None, share_device: Engine | None = None,
            share_frozen: bool = False, updates: str = Settings.updates) -> Engine:
    """Compile `model` for training under `hbm_budget` GiB (2**30 bytes) of device memory.

    optimizer:     megacompile.AdamW(...) (defaults as torch.optim.AdamW); masters are always float32
    compute_dtype: torch.float32 or torch.bfloat16, the dtype of the device copies
    device:        "cuda" if available, else "cpu" (a simulated device with the budget enforced)
    loss_fn:       loss_fn(output, *args, **kwargs) when the model's output is not the loss
    retrace:       build a new plan when step() gets inputs of new shapes (else InputMismatchError)
    dump_dir:      write the schedule after every pass there (also: MEGACOMPILE_DUMP_DIR)
    grad_accum:    micro-batches per optimizer step: each step() call is one micro-batch, and
                   every grad_accum-th call updates the masters
    fuse:          rewrite the stage graphs onto megacompile's fused Triton kernels (megacompile/fusion);
                   default: on for cuda, off for cpu (where Triton runs in its slow interpreter)
    host_budget:   GiB of host RAM for masters, AdamW state and offloaded activations; default: 90%
                   of this machine's RAM, or of this process's memory cgroup limit where lower (a
                   container's, a SLURM job's). Too little for the masters raises HostMemoryError.
    on_nonfinite:  a step whose loss or any gradient is inf or NaN updates nothing; "skip" (default)
                   warns and goes on, "raise" raises NonFiniteError. `engine.last_step` says which.
    max_consecutive_skips: with "skip", this many optimizer steps skipped in a row raise
                   NonFiniteError (nothing updated since the last good step); default None: never
    nvme_dir:      a folder on a fast disk for the disk tier: when the host budget cannot hold the
                   host state, the AdamW moments (8 B/param) go there first, then the fp32 masters
                   (4 B/param), streamed past the host AdamW (megacompile/disk)
    nvme_budget:   GiB the disk tier may take in nvme_dir; default: the disk's free space
    process_group: data parallelism over these torch.distributed ranks (default: the initialised
                   default group, if it has 2 or more): each rank steps on its own micro-batch and
                   holds 1/R of the masters and AdamW state (docs/distributed.md)
    accumulation:  with grad_accum > 1, "micro" (default: each call through the whole model),
                   "layer" (the step's micro-batches through each block together: weights cross
                   the link once per direction per step; the first grad_accum-1 calls of a step
                   return None and the last runs them all) or "auto" (the planner's choice)
    updates:       when each owner's host AdamW update starts: "at_commit" (default: once the whole
                   step is known sound, loss and every gradient finite, overlapping the next
                   forward) or "as_gradients_land" (as soon as the owner's gradients are on the
                   host and finite, overlapping the rest of the backward: a shorter step where the
                   host AdamW is as long as the backward; no clipping (max_grad_norm None, or
                   math.inf, which only measures the norm), grad_accum=1, one process,
                   no disk tier; a step that fails after its first update leaves the engine to be
                   reloaded from a checkpoint)
    share_device:  an open Engine whose device this one runs on, taking turns with it: the same
                   budget (give the same hbm_budget), streams and device arena, so the two hold one
                   budget between them, and this engine's host state placed in the host budget the
                   other's leaves (a frozen reference model beside its policy: forward calls only,
                   its weights kept once in their own dtype, no moments)
    share_frozen:  with share_device: the frozen weights and buffers this model holds that the
                   other engine holds frozen too (same names, shapes and dtypes: a reference
                   beside a LoRA policy's base) are that engine's host tensors, not copies; every
                   value loaded into one is checked to be the one already there

    settings:      a megacompile.Settings holding the plain settings above (hbm_budget included)
                   instead of keywords; a keyword given beside it must agree with it

    torch LR schedulers attach to `engine.torch_optimizer`.
    """
    plain = from_call(compile, settings, dict(
        hbm_budget=hbm_budget, compute_dtype=compute_dtype, device=device, retrace=retrace, dump_dir=dump_dir,
        grad_accum=grad_accum, fuse=fuse, host_budget=host_budget, on_nonfinite=on_nonfinite, nvme_dir=nvme_dir,
        nvme_budget=nvme_budget, accumulation=accumulation, updates=updates))
    return Engine(model, optimizer=optimizer, loss_fn=loss_fn, process_group=process_group,
                  max_consecutive_skips=max_consecutive_skips, share_device=share_device,
                  share_frozen=share_frozen, **plain)


__all__ = ["compile", "plan", "plan_stage", "minimum_budget", "Settings", "Engine", "Plan", "AdamW", "hf_no_decay",
           "LossAndOutputs",
           "MegacompileError",
           "BudgetTooSmallError", "HostMemoryError",
           "BudgetExceededError", "CaptureError", "LossError", "InputMismatchError", "PlanVerificationError",
           "OptimizerInputError", "NonFiniteError", "PartialStepError", "StorageError", "from_pretrained",
           "WeightsFileError"]
