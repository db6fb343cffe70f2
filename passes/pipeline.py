"""The pass pipeline: one list, run in order, with timing, verification and dumps in one place.

Why this order:
  lower        every stage's forward, then every backward: the dataflow, nothing else;
  remat        drops saved activations of the chosen blocks and adds their RECOMPUTE, before
               transfers, because a recompute needs the block's weights on the device too;
  offload      sends other chosen blocks' saved activations to host memory and back;
  boundary     sends chosen blocks' inputs to host memory and back; after remat, since a
               recompute is the first node that reads a recomputed block's input again;
  layer_major  with k micro-batches per program, copies each unit (a stage's back-to-back compute
               nodes and the transfers placed for them) k times in place, after the passes that
               place per-micro-batch transfers and before transfers, so weights come once per run;
  transfers    weight prefetch/evict and gradient offload around the compute nodes as they now
               stand, so a recompute and its backward share one fetch;
  optimizer    host AdamW after the last offload feeding each stage's masters (needs the WAITs);
  lifetimes    frees every remaining device value after its last use; it must see every read;
  arena        gives every device tensor of the step (values' storages and the ops' outputs inside
               each stage graph) an offset in one arena; last, because a tensor's place depends
               on the lifetimes of everything live beside it, which only the finished schedule
               fixes. It moves no node, so the simulator's curve is the one it packs. Run for the
               schedules the planner keeps (build_schedule(arena=True)), not for every candidate;
  (memory)     the simulator over the finished schedule gives the curve and the peak.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable

from megacompile.capture import CapturedModel
from megacompile.capture.model_graph import owners, readers
from megacompile.ir.printer import format_program
from megacompile.ir.program import Program
from megacompile.ir.verify import verify

from .arena import place_in_arena
from .lifetimes import lifetimes
from .layer_major import layer_major
from .lower import lower
from .boundary import offload_boundaries
from .offload import offload_saved
from .optimizer import place_optimizer
from .remat import remat
from .selective import with_selective
from .transfers import transfers


@dataclass(frozen=True)
class StepKind:
    """What a step does besides forward and backward (set by the user, not the solver)."""
    update: bool = True     # run the optimizer (False: a micro-batch that only accumulates)
    clip: bool = False      # global-norm clipping before the updates
    updates: str = "at_commit"   # or "as_gradients_land": each update right after its last gradient


@dataclass(frozen=True)
class ScheduleChoice:
    """What the solver decides: how far ahead to prefetch and which stages to recompute.

    `selective` blocks run their template's variant that saves only the outputs of matmuls and
    attention and recomputes the cheap ops in the backward (capture/split.py). The last three fields are never chosen by the solver; they express other systems' schedules
    (passes/baselines.py) in the same IR, so the cost model can compare them.
    """
    prefetch_depth: int = 1
    recompute: frozenset[int] = field(default_factory=frozenset)
    resident: frozenset[int] = field(default_factory=frozenset)   # fetched once, kept the whole step
    offload: frozenset[int] = field(default_factory=frozenset)    # saved values kept in host memory
    offload_lag: int = 1          # compute nodes an offload (or restore) runs beside before it is needed
    selective: frozenset[int] = field(default_factory=frozenset)  # blocks that save only costly values
    boundary: frozenset[int] = field(default_factory=frozenset)   # blocks whose input waits in host memory
    extra_forwards: int = 0            # forwards run and thrown away before each recompute
    refetch_per_pass: bool = False     # fetch weights again for every recompute
    serial_optimizer: bool = False     # updates after the whole backward; the next step waits for all
    micro_batches: int = 1             # >1: layer-major, this many micro-batches in one program


Pass = Callable[[Program, CapturedModel, ScheduleChoice, StepKind], Program]


def _optimizer(p: Program, c: CapturedModel, ch: ScheduleChoice, kind: StepKind) -> Program:
    return place_optimizer(p, owners(c)[1], readers(c), update=kind.update and c.train, clip=kind.clip,
                           serial=ch.serial_optimizer, as_gradients_land=kind.updates == "as_gradients_land")


TRAINING_PASSES: list[tuple[str, Pass]] = [
    ("remat", lambda p, c, ch, k: remat(p, ch.recompute, ch.extra_forwards)),
    ("offload", lambda p, c, ch, k: offload_saved(p, ch.offload, ch.offload_lag)),
    ("boundary", lambda p, c, ch, k: offload_boundaries(p, ch.boundary, ch.offload_lag)),
    ("layer_major", lambda p, c, ch, k: layer_major(p, ch.micro_batches)),
    ("transfers", lambda p, c, ch, k: transfers(p, ch.prefetch_depth, ch.refetch_per_pass, ch.resident)),
    ("optimizer", _optimizer),
    ("lifetimes", lambda p, c, ch, k: lifetimes(p)),
    ("arena", lambda p, c, ch, k: place_in_arena(p, c)),
]

INFERENCE_PASSES: list[tuple[str, Pass]] = [
    ("transfers", lambda p, c, ch, k: transfers(p, ch.prefetch_depth)),
    ("optimizer", _optimizer),     # no updates, only the waits for the last ones
    ("lifetimes", lambda p, c, ch, k: lifetimes(p)),
    ("arena", lambda p, c, ch, k: place_in_arena(p, c)),
]


# The passes that place what each block keeps between its forward and its backward. They lead
# the training pipeline and read only the lowered program and these fields of the choice.
BLOCK_PASSES = ("remat", "offload", "boundary", "layer_major")


def _blocks_key(captured: CapturedModel, choice: ScheduleChoice) -> tuple:
    # The lowered program by the templates the stages run, as the solver's cached `lower` keys it.
    return (tuple(id(st.template) for st in captured.stages), choice.recompute, choice.extra_forwards,
            choice.offload, choice.offload_lag, choice.boundary, choice.micro_batches)


def build_schedule(captured: CapturedModel, choice: ScheduleChoice, kind: StepKind = StepKind(), *,
                   check: bool = True, dump_dir: str | None = None,
                   lowered: Callable[[CapturedModel], Program] = lower, arena: bool = False,
                   placed: dict | None = None) -> Program:
    """Run the pipeline; verify after every pass when `check`; write each pass's output to `dump_dir`.

    `lowered` makes the first program; the solver passes a cached `lower` (it builds hundreds of
    schedules over a few distinct sets of templates). The arena pass runs only with `arena`: it
    costs a hundred times the rest of the pipeline, and the solver judges its candidates by their
    simulated peak; the planner lays out the schedules it keeps. `placed`: a table the solver
    keeps, with that cached `lower`, of the programs the BLOCK_PASSES made: candidates that differ
    only in what later passes read (prefetch depth, residents) start from the same one. It is
    used only for a training schedule built without `check`, dumps or `arena`."""
    dump_dir = dump_dir or os.environ.get("MEGACOMPILE_DUMP_DIR")
    captured = with_selective(captured, choice.selective)
    contributors = owners(captured)[1] if captured.train and check else None
    passes = TRAINING_PASSES if captured.train else INFERENCE_PASSES
    key = _blocks_key(captured, choice) if placed is not None and captured.train and not (
        check or dump_dir or arena) else None
    if key is not None and key in placed:
        kept, seconds = placed[key]
        program, seconds, done = kept.copy(), dict(seconds), BLOCK_PASSES
    else:
        done = ()
        start = time.perf_counter()
        program = lowered(captured)
        seconds = {"lower": time.perf_counter() - start}
        _after_pass(program, "lower", 0, check, dump_dir, None)
    for k, (name, run) in enumerate(passes, start=1):
        if name in done or name == "arena" and not arena:
            continue
        start = time.perf_counter()
        program = run(program, captured, choice, kind)
        seconds[name] = time.perf_counter() - start
        program.passes.append(name)
        _after_pass(program, name, k, check, dump_dir, contributors if name in ("optimizer", "lifetimes", "arena") else None)
        if key is not None and name == BLOCK_PASSES[-1] and key not in placed:
            placed[key] = program, dict(seconds)
    program.facts["pass_seconds"] = seconds
    program.facts["choice"] = choice
    program.facts["step_kind"] = kind
    return program


def _after_pass(program: Program, name: str, k: int, check: bool, dump_dir: str | None,
                contributors: dict | None) -> None:
    if check:
        verify(program, owners=contributors, weights_resident=name in ("lower", "remat", "offload", "boundary", "layer_major"))
    if dump_dir:
        os.makedirs(dump_dir, exist_ok=True)
        with open(os.path.join(dump_dir, f"{k:02d}_{name}.txt"), "w") as f:
            f.write(format_program(program) + "\n")
