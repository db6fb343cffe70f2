"""What a plan is asked for: a run's settings resolved once into everything make_plan reads.

Three doors plan: an Engine at its first step with new inputs, `plan()` / `minimum_budget()` from a
model or config, and `megacompile train`, which plans before its engine exists and hands the
engine that plan. Each builds a PlanRequest with the rules here, so a rule that combines settings
is written once:
  host accumulation   layer-major accumulation lands one gradient sum per step: its host state is
                      that of grad_accum=1 (`host_accumulation`)
  disk room           nvme_budget, else the free space where nvme_dir is (`disk_room`)
  fusion              the fused kernels on a GPU, unless `fuse` says otherwise (`fused`)
  host placement      the masters and moments in RAM, else the moments then the masters on disk,
                      with the module's own weights counted where they cannot be shared
                      (search.place_host_state, given the two rules above)
The hardware profile is the caller's: the one given, else the backend's own (calibrate.profile_for,
a room above this one).
Two requests are equal when they ask for the same plan: an engine takes a plan made before it
(engine/prepared.py) only for a request equal to its own.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from ..cost import HardwareProfile
from ..cost.host_memory import HostCost, free_disk_bytes
from ..passes import StepKind


@dataclass(frozen=True)
class PlanRequest:
    budget_bytes: int                  # device memory the step may hold
    kind: StepKind                     # what the step does (update, clip; a forward alone)
    backend: str                       # "cpu", "cuda", or "planned for <profile>" without a device
    hardware: HardwareProfile          # times the candidates (the planner only reads it)
    host_bytes: int                    # host RAM the masters, moments and the module's own weights take
    host_cost: HostCost | None = None  # where they are (RAM, disk), as search.place_host_state chose
    host_budget_bytes: int | None = None   # activations go to the host only as far as the rest holds them
    fuse: bool = False                 # rewrite the stage graphs onto the fused kernels first
    grad_accum: int = 1                # micro-batches per optimizer step
    accumulation: str = "micro"        # "layer": the k micro-batches in one program, layer by layer
    dump_dir: str | None = None        # write the schedule's passes there (never served from a memo)

    def at(self, budget_bytes: int) -> "PlanRequest":
        return dataclasses.replace(self, budget_bytes=budget_bytes)


def host_accumulation(grad_accum: int, accumulation: str) -> int:
    """The accumulation the host state is laid out for: a layer-major step adds its micro-batches'
    gradients on the device and lands one sum."""
    return 1 if accumulation == "layer" else grad_accum


def disk_room(nvme_dir: str | None, nvme_budget_bytes: int | None) -> int | None:
    """Disk bytes the tier may take: nvme_budget, else the free space where nvme_dir is (or would be)."""
    if nvme_dir is None or nvme_budget_bytes is not None:
        return nvme_budget_bytes
    existing = os.path.abspath(nvme_dir)
    while not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    return free_disk_bytes(existing)


def fused(fuse: bool | None, on_gpu: bool) -> bool:
    """`fuse` as given, or by default the fused kernels on a GPU (the cpu backend runs them only
    under Triton's interpreter)."""
    return on_gpu if fuse is None else fuse

