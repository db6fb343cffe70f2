"""A step as a Chrome trace (the trace-event JSON that Perfetto and chrome://tracing open).

Two processes in one file, on one time axis starting at 0 with the step: "predicted", the cost
model's play of the schedule on its streams (cost/predict.py), and "measured", the runtime's
record of the last step (runtime/timeline.py). In each, one track (thread) per stream: compute,
h2d (host -> device), d2h (device -> host), host (the optimizer), and disk where the plan has a
disk tier (measured: one slice per piece of state read or written, from the tier's I/O threads,
which know no schedule node).
Every schedule node is one complete ("X") slice on its stream's track, with `args.node` its
index in the schedule and its op, stage, bytes and origin. Work a node started elsewhere (the
host side of a gradient offload, the disk traffic of an update) and work from the step before
(updates that ran into this step) are slices too, with `args.of_node` instead of `args.node`.
Counters: device bytes (what a node holds at most while it runs, then what stays live after
it) and the budget, per process.
"""
from __future__ import annotations

import json
import os

from ..ir.program import COMPUTE_OPS, Op, Program

TRACKS = ("compute", "h2d", "d2h", "host", "disk")
PREDICTED, MEASURED = 1, 2


def node_label(program: Program, i: int) -> str:
    n = program.nodes[i]
    return n.op.value + ("" if n.stage is None else f" {program.stage_names[n.stage]}")


def node_bytes(program: Program, i: int) -> int:
    """Device bytes the node moves, makes or drops: a transfer's value, a stage's outputs, a FREE's values."""
    n = program.nodes[i]
    names = n.frees if n.op is Op.FREE else n.reads[:1] if n.op is Op.OFFLOAD else n.writes
    return sum(program.values[v].nbytes for v in names)


def _node_args(program: Program, i: int) -> dict:
    n = program.nodes[i]
    args = {"node": i, "op": n.op.value, "stage": None if n.stage is None else program.stage_names[n.stage],
            "bytes": node_bytes(program, i), "origin": n.origin}
    if n.note:
        args["note"] = n.note
    if n.op in COMPUTE_OPS:
        args["transient_bytes"] = n.transient
    return args


class _Events:
    def __init__(self) -> None:
        self.events: list[dict] = []
        self.tids: dict[tuple[int, str], int] = {}

    def process(self, pid: int, name: str) -> None:
        self.events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})
        self.events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})

    def tid(self, pid: int, track: str) -> int:
        key = (pid, track)
        if key not in self.tids:
            known = TRACKS.index(track) if track in TRACKS else len(TRACKS) + len(self.tids)
            tid = self.tids[key] = known + 1
            self.events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": track}})
            self.events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                                "args": {"sort_index": tid}})
        return self.tids[key]

    def slice(self, pid: int, track: str, name: str, start: float, end: float, args: dict) -> None:
        self.events.append({"name": name, "cat": args.get("op", track), "ph": "X", "pid": pid,
                            "tid": self.tid(pid, track), "ts": start * 1e6, "dur": max(end - start, 0.0) * 1e6,
                            "args": args})

    def counter(self, pid: int, name: str, t: float, value: int) -> None:
        self.events.append({"name": name, "ph": "C", "pid": pid, "ts": t * 1e6, "args": {"bytes": value}})


def _memory_counters(ev: _Events, pid: int, points: list[tuple[float, float, int, int]], budget: int) -> None:
    """points: (start, end, peak during, live after) per node, in schedule order."""
    for start, end, peak, live in points:
        ev.counter(pid, "device bytes", start, peak)
        ev.counter(pid, "device bytes", end, live)
    last = max((p[1] for p in points), default=0.0)
    ev.counter(pid, "device budget", 0.0, budget)
    ev.counter(pid, "device budget", last, budget)


def _predicted(ev: _Events, plan) -> None:
    program = plan.program
    ev.process(PREDICTED, f"predicted ({plan.hardware.name})")
    for track in TRACKS[:4] + (("disk",) if plan.disk_bytes_per_step else ()):
        ev.tid(PREDICTED, track)
    compute_at: dict[int, tuple[float, float]] = {}
    for i, stream, start, end in plan.predicted_spans():
        if stream == "disk":
            ev.slice(PREDICTED, "disk", "disk tier: " + node_label(program, i), start, end, {"of_node": i})
            continue
        ev.slice(PREDICTED, stream, node_label(program, i), start, end, _node_args(program, i))
        if stream == "compute":
            compute_at[i] = (start, end)
    points, t = [], 0.0
    for i in range(len(program.nodes)):
        start, t = compute_at.get(i, (t, t))
        points.append((start, t, plan.curve.peak_during[i], plan.curve.live_after[i]))
    _memory_counters(ev, PREDICTED, points, plan.budget_bytes)


def _measured(ev: _Events, plan, timeline) -> None:
    program = plan.program
    ev.process(MEASURED, f"measured ({plan.backend} backend, last step)")
    spans = sorted(timeline.spans, key=lambda s: s.start)
    for track in TRACKS[:4] + (("disk",) if any(s.stream == "disk" for s in spans) else ()):
        ev.tid(MEASURED, track)
    zero = timeline.started
    for span in spans:
        start, end = span.start - zero, span.end - zero
        if span.node is None:
            ev.slice(MEASURED, span.stream, span.what, start, end, {})
        elif span.step != timeline.step:
            ev.slice(MEASURED, span.stream, f"{span.what} (step before)", start, end,
                     {"of_node": span.node, "step": "before"})
        elif span.stream == program.nodes[span.node].stream:
            ev.slice(MEASURED, span.stream, node_label(program, span.node), start, end, _node_args(program, span.node))
        else:
            ev.slice(MEASURED, span.stream, span.what, start, end, {"of_node": span.node})
    points, t = [], 0.0
    for sample in timeline.memory:
        points.append((t, sample.end - zero, sample.peak, sample.live))
        t = sample.end - zero
    _memory_counters(ev, MEASURED, points, plan.budget_bytes)


def trace_events(plan, timeline=None) -> dict:
    """The trace as a dict: the predicted step, and the measured one when `timeline` holds a record
    of this plan's schedule."""
    ev = _Events()
    _predicted(ev, plan)
    if timeline is not None and timeline.program is plan.program and timeline.memory:
        _measured(ev, plan, timeline)
    return {"traceEvents": ev.events, "displayTimeUnit": "ms",
            "otherData": {"budget_bytes": plan.budget_bytes, "hardware": plan.hardware.name,
                          "predicted_step_s": plan.prediction.step_s if plan.prediction else None}}


def write_trace(path: str, plan, timeline=None) -> None:
    """Write the trace to `path` (atomically)."""
    data = trace_events(plan, timeline)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)
