"""Invariants every schedule must keep; checked between passes.

- every read is of a value that was written and not yet freed;
- no compute or output reads a value whose prefetch has not been waited for;
- no value is freed, or written again, while a transfer on it is in flight; in particular an
  offloaded value is freed only after the WAIT on its copy: the cuda backend frees offload
  sources without record_stream, the compute stream's wait on the copy being what orders the
  reuse of their memory after it (runtime/cuda.py);
- every transfer is waited for before the schedule ends;
- a recompute comes after the forward whose random state it replays;
- an optimizer step comes after the wait of every offload that feeds its masters;
- a prefetch reads host masters only after a WAIT on them in this step (an update of the
  previous step, or an earlier one in this step, may still be running on the host);
- with a budget, the simulated peak is within it;
- where the schedule has its arena (passes/arena.py): the arena holds every tensor at an aligned
  offset, no two tensors live at the same step overlap, and with a budget the arena fits it.
"""
from __future__ import annotations

import bisect
import heapq

from ..errors import PlanVerificationError
from .arena import DeviceArena, aligned
from .program import Op, Program
from .simulate import simulate


def verify(program: Program, budget_bytes: int | None = None,
           owners: dict[int, set[int]] | None = None, weights_resident: bool = False,
           arena_budget_bytes: int | None = None) -> None:
    """`weights_resident`: before transfers are placed, weights count as always on the device.
    `arena_budget_bytes`: what the arena may take, when not `budget_bytes` (a GPU plan keeps a
    share of the budget free for the caching allocator's fragmentation beside its peak, not beside
    its arena: cost/reserve.py)."""
    state: dict[str, str] = {}         # value -> "ready" | "arriving" | "leaving"
    if weights_resident:
        state.update({v.name: "ready" for v in program.values.values() if v.kind == "weights"})
    # Host masters may still be updating from the previous step until waited for.
    state.update({v.name: "updating" for v in program.values.values() if v.kind == "host"})
    forwarded: set[int] = set()
    offloaded: set[int] = set()

    def fail(i: int, msg: str) -> None:
        n = program.nodes[i]
        where = program.stage_names[n.stage] if n.stage is not None else n.origin
        raise PlanVerificationError(f"node {i} ({n.op.value} {where}): {msg}")

    for i, n in enumerate(program.nodes):
        if n.op is Op.FREE:
            for v in n.frees:
                if v not in state:
                    fail(i, f"frees {v}, which is not live")
                if state[v] == "leaving":
                    fail(i, f"frees {v} before the WAIT on its offload: the device may still be copying it "
                            "to the host, and nothing but that wait orders the copy before its memory is reused")
                if state[v] != "ready":
                    fail(i, f"frees {v} while its transfer is in flight ({state[v]})")
                del state[v]
            continue
        if n.op is Op.WAIT:
            (v,) = n.reads
            if state.get(v) in ("arriving", "updating"):
                state[v] = "ready"
            elif state.get(v) == "leaving":
                state[v] = "ready"
                if program.values[v].kind == "grads":
                    offloaded.add(n.stage)
            else:
                fail(i, f"waits for {v}, which has no transfer in flight")
            continue
        for v in n.reads:
            if v not in state:
                fail(i, f"reads {v} before it is written or after it is freed")
            if state[v] != "ready":
                fail(i, f"reads {v} while it is {state[v]}")
        if n.op is Op.OFFLOAD:
            state[n.reads[0]] = "leaving"
        if n.op is Op.RECOMPUTE and n.stage not in forwarded:
            fail(i, "recomputes a stage whose forward has not run: no random state to replay")
        if n.op is Op.FORWARD:
            forwarded.add(n.stage)
        if n.op is Op.OPTIMIZER_STEP and owners is not None:
            missing = [c for c in owners.get(n.stage, ()) if c not in offloaded]
            if missing:
                fail(i, f"updates masters before the gradients of stages {missing} arrived")
        for v in n.writes:
            if state.get(v) in ("arriving", "leaving"):
                fail(i, f"writes {v} while a transfer on it is in flight")
            state[v] = {Op.PREFETCH: "arriving", Op.OPTIMIZER_STEP: "updating"}.get(n.op, "ready")
    in_flight = [v for v, s in state.items() if s not in ("ready", "updating")]
    if in_flight:
        raise PlanVerificationError(f"the schedule ends with transfers in flight: {in_flight}")
    if budget_bytes is not None:
        curve = simulate(program)
        if curve.peak > budget_bytes:
            fail(curve.peak_index, f"device peak {curve.peak} B exceeds the budget of {budget_bytes} B")
    arena = program.facts.get("arena")
    if arena is not None:
        verify_arena(arena, budget_bytes if arena_budget_bytes is None else arena_budget_bytes)


def verify_arena(arena: DeviceArena, budget_bytes: int | None = None) -> None:
    """Every tensor inside the arena at an aligned offset; no two tensors live at one step share a
    byte; with a budget, the arena within it. A sweep over the steps keeps the tensors live at the
    current step ordered by offset: while none of them overlap, a new one overlaps one of them
    exactly when it overlaps its neighbour below or above."""
    def name(t) -> str:
        return f"{t.name} (made by node {t.node}, {t.nbytes} B at offset {t.offset}, steps {t.first}..{t.last})"

    for t in arena.tensors:
        if t.first > t.last:
            raise PlanVerificationError(f"in the device arena, {name(t)} ends before it starts")
        if t.offset < 0 or t.offset % arena.alignment or t.offset + aligned(t.nbytes, arena.alignment) > arena.size:
            raise PlanVerificationError(f"the device arena of {arena.size} B does not hold {name(t)} at an offset "
                                        f"aligned to {arena.alignment} B")
    live: list[tuple[int, int, int]] = []        # (offset, end, index), by offset
    ending: list[tuple[int, int]] = []           # heap of (last step, index) of the live ones
    tensors = arena.tensors
    for i in sorted((i for i, t in enumerate(tensors) if t.nbytes), key=lambda i: tensors[i].first):
        t = tensors[i]
        while ending and ending[0][0] < t.first:
            _, gone = heapq.heappop(ending)
            g = tensors[gone]
            del live[bisect.bisect_left(live, (g.offset, g.offset + g.nbytes, gone))]
        item = (t.offset, t.offset + t.nbytes, i)
        at = bisect.bisect_left(live, item)
        for j in (at - 1, at):
            if 0 <= j < len(live) and live[j][0] < item[1] and item[0] < live[j][1]:
                raise PlanVerificationError(f"in the device arena, {name(t)} overlaps {name(tensors[live[j][2]])}, "
                                            "and both are live at once")
        live.insert(at, item)
        heapq.heappush(ending, (t.last, i))
    if budget_bytes is not None and arena.size > budget_bytes:
        raise PlanVerificationError(f"the device arena of {arena.size} B exceeds the budget of {budget_bytes} B "
                                    f"(predicted peak {arena.peak} B)")

