"""The systems the peers bench trains with, each run in a process of its own (runner.py): the same
Workload, warmup steps, then timed steps back to back (timing.py). Each returns its losses, its time
and the memory it held; megacompile's row, here, adds the plan's prediction beside the measurement.
Its peers, DeepSpeed ZeRO-3 offload and FSDP2 CPU offload, are in peer_systems.py."""
from __future__ import annotations

import gc
import json
import time
import weakref
from pathlib import Path

from ..engine.from_pretrained import compile_folder
from ..errors import BudgetTooSmallError
from .budgets import GiB, asked_gib, resident_gib
from .peer_systems import run_deepspeed, run_fsdp2
from .timing import memory, say, sync, timed
from .workload import Workload


def run_megacompile(workload: Workload, budget: str, weights: str, calibrated: str | None = None,
                    host_budget: float | None = None, fuse: bool | None = None, trace: str | None = None,
                    updates: str = "at_commit", host_threads: list[int] | None = None) -> dict:
    """budget: "resident" (the default budget: most of the device), or a fraction of the model's
    bf16 weights ("0.5", "0.34"), raised to the smallest budget the plan fits in when it is below.
    weights: the folder bench/weights.py wrote for this workload. calibrated: a profile's JSON to
    predict with beside the datasheet. host_budget: GiB of host RAM the plan may use. fuse:
    compile()'s (None: the fused kernels on a GPU). trace: where to write the Chrome trace of the last
    timed step, measured beside predicted (where a step's time went: its forward beside the host
    updates of the step before, as a training loop runs them); the step run alone for the host
    optimizer's time goes beside it (alone_trace). updates: compile()'s ("as_gradients_land": each host
    update beside the rest of the backward). host_threads: thread counts of the host AdamW to time
    the step at too, after the timed steps (host_thread_sweep)."""
    from ..cost import predict
    from ..cost.backend_profile import profile_for
    from ..cost.hardware import HardwareProfile
    cuda = workload.device.startswith("cuda")
    asked = asked_gib(workload, budget)
    asked = resident_gib(workload.device) if asked is None else asked
    batches = workload.batches()
    engine, plan, gib, raised = engine_at(workload, asked, weights, batches[0], host_budget, fuse, updates)
    say(f"planned at {gib:.3f} GiB")
    if trace:       # the plan this machine made (its reserve, schedule, prediction), beside `megacompile plan`'s
        Path(plan_text(trace)).write_text(plan.summary() + "\n")
    out = {"hbm_budget_gib": gib, "fused": plan.fused, "asked_budget_gib": asked, "budget_raised_to_minimum": raised,
           "budget_share_of_bf16_weights": gib * GiB / (2 * workload.parameters),
           "recomputed_blocks": len(plan.recomputed), "predicted_device_peak_bytes": plan.predicted_peak_bytes,
           "updates": updates, "attention": plan.attention,
           "updates_in_forward_order": plan.program.facts.get("updates_in_forward_order", 0)}
    if host_budget is not None:
        out["host_budget_gib"] = host_budget
    profiles = {"datasheet": profile_for("cuda" if cuda else "cpu")}
    if calibrated:
        profiles["calibrated"] = HardwareProfile(**json.loads(Path(calibrated).read_text()))
    for name, profile in profiles.items():
        p = predict(plan.program, plan.captured, profile)
        out[f"predicted_step_s_{name}"] = p.step_s
        out[f"predicted_exposed_transfer_s_{name}"] = p.exposed_transfer_s
        out[f"predicted_exposed_update_s_{name}"] = p.exposed_update_s
        out[f"predicted_host_optimizer_s_{name}"] = p.host_s
        out[f"predicted_tflops_6nd_{name}"] = p.tflops_6nd
    try:
        out.update(timed(workload, lambda ids, labels: engine.step(input_ids=ids, labels=labels)))
        out["measured_wait_update_s"] = update_wait_s(engine, plan.program)
        if trace:
            engine.trace(trace)
        if host_threads:
            out.update(host_thread_sweep(engine, plan.program, workload, host_threads))
        out["measured_host_optimizer_s"] = host_optimizer_s(engine, *batches[-1])
        if trace:
            engine.trace(alone_trace(trace))
        stats = engine.memory_stats()
        out["ledger_device_peak_bytes"] = stats["device_peak_bytes"]
        # What the arena held and what escaped it on the device (goal: nothing after the first step);
        # the caching allocator's peak less the arena is the workspaces and op scratch beside it.
        out["device_arena_bytes"] = stats["device_arena_bytes"]
        out["device_allocations_last_step"] = stats["device_allocations_last_step"]
        out["device_copies_into_arena_last_step"] = stats["device_copies_into_arena_last_step"]
        out["host_bytes"] = stats["host_bytes"]
        out["predicted_host_bytes"] = stats["predicted_host_bytes"]
        out.update({f"setup_{phase.replace(' ', '_')}_s": s for phase, s in engine.setup_seconds.items()})
        out.update(memory(workload.device))
    finally:
        engine.close()
    return out


def engine_at(workload: Workload, gib: float, weights: str, batch: tuple, host_budget: float | None = None,
              fuse: bool | None = None, updates: str = "at_commit"):
    """(engine, plan, budget GiB, raised): the engine planned at `gib`, or, when `gib` is below the
    smallest budget the plan fits in, at that smallest one. The model is built on the meta device;
    its fp32 weights stream from `weights` into the masters when the plan is first built."""
    from .. import AdamW
    ids, labels = batch
    raised = False
    while True:
        engine = compile_folder(workload.meta_model(), str(weights), gib, device=workload.device,
                                compute_dtype=workload.compute_dtype, host_budget=host_budget, fuse=fuse,
                                updates=updates,
                                optimizer=AdamW(lr=workload.lr_at if workload.lr_warmup else workload.lr,
                                              weight_decay=workload.weight_decay))
        try:
            return engine, engine.prepare(input_ids=ids, labels=labels), gib, raised
        except BudgetTooSmallError as e:
            if raised:
                engine.close()
                raise
            minimum = e.minimum_bytes
        # Here, past the except block: its exception's traceback holds the refused engine's frames,
        # and through them its host state, until the block ends; a collection inside it frees
        # nothing. The refused engine's host buffers go before the next engine allocates its own.
        engine.close()
        refused = weakref.ref(engine)
        del engine
        _collect(refused)
        gib, raised = minimum / GiB, True


def _collect(refused: weakref.ref, tries: int = 20) -> None:
    """Collect until the refused engine is gone: gc.collect() returns at once, freeing nothing, while
    another thread's collection is under way (a background thread's allocation may start one)."""
    for _ in range(tries):
        gc.collect()
        if refused() is None:
            return
        time.sleep(0.01)


def update_wait_s(engine, program) -> float:
    """Seconds the last timed step's compute thread stood at WAITs on an owner's masters, for the
    host AdamW update of the step before (a host-side wait, so timed as it is on every backend):
    what `predicted_exposed_update_s` predicts. The waits on copies are stream-side on a GPU and
    show in the trace instead."""
    nodes, values = program.nodes, program.values
    return sum(s.end - s.start for s in engine.timeline.on("compute")
               if s.node is not None and s.node < len(nodes) and nodes[s.node].op.value == "wait"
               and values[nodes[s.node].reads[0]].kind == "host")


def host_thread_sweep(engine, program, workload: Workload, counts: list[int]) -> dict:
    """The step timed again with the host AdamW on each of `counts` threads (the timed steps ran on
    every core this rank has: optim/host_threads.py): whether the updates, the copies and the
    compute thread contend for the host's cores or its memory. A few steps per count, back to back,
    on the workload's last batches; the arithmetic is the same on any count (optim/fused_adamw.py),
    so only the time changes. Each count's step_s and its wait on the updates of the step before."""
    from ..optim import fused_adamw
    from ..optim.host_threads import host_threads
    batches = workload.batches()[-min(3, workload.steps):]
    out: dict = {"host_threads": host_threads()}
    try:
        for n in counts:
            fused_adamw.set_num_threads(n)
            engine.synchronize()
            start = time.perf_counter()
            for ids, labels in batches:
                engine.step(input_ids=ids, labels=labels)
            sync(workload.device)
            out[f"step_s_host_threads_{n}"] = (time.perf_counter() - start) / len(batches)
            out[f"measured_wait_update_s_host_threads_{n}"] = update_wait_s(engine, program)
            say(f"{len(batches)} steps on {n} host threads")
    finally:
        fused_adamw.set_num_threads(None)
    return out


def plan_text(trace: str) -> str:
    """Where the row's plan summary goes, beside its trace."""
    stem = trace[:-len(".trace.json")] if trace.endswith(".trace.json") else trace
    return stem + ".plan.txt"


def alone_trace(trace: str) -> str:
    """Where the trace of the step run alone goes, beside the timed step's."""
    stem = trace[:-len(".trace.json")] if trace.endswith(".trace.json") else trace
    return stem + ".alone.trace.json"


def host_optimizer_s(engine, ids, labels) -> float:
    """Seconds of host AdamW in one step, run alone. A step returns with its update still running
    (it overlaps the next forward): the one before is waited for first, or it would be counted too."""
    engine.synchronize()
    engine.timeline.clear()
    engine.step(input_ids=ids, labels=labels)
    engine.synchronize()
    return sum(s.end - s.start for s in engine.timeline.on("host"))


SYSTEMS = {"megacompile": run_megacompile, "fsdp2": run_fsdp2, "deepspeed": run_deepspeed}
