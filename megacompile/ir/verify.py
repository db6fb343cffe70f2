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
- with a budget, the simulated peak is within it.
"""
from __future__ import annotations

from ..errors import PlanVerificationError
from .program import Op, Program
from .simulate import simulate


def verify(program: Program, budget_bytes: int | None = None,
           owners: dict[int, set[int]] | None = None, weights_resident: bool = False) -> None:
    """`weights_resident`: before transfers are placed, weights count as always on the device."""
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

