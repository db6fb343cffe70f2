"""Host AdamW updates that start as their owner's gradients land (compile(..., updates="as_gradients_land")).

The optimizer pass (passes/optimizer.py) puts each owner's OPTIMIZER_STEP right after the WAIT of
the last gradient it needs. There the executor hands this owner's update to the host stream
instead of staging it for commit(); the host AdamW then runs beside the rest of the backward.

Each update first waits until the gradients of every owner that has landed by its node are on the
host (their landing checked them), and updates nothing if one of them holds an inf or NaN; nor
does any update after it. The updates run on the host stream in program order: those the planner
moved to the end of the backward (planner/update_order.py) find every gradient landed, so the
first of them refuses the step's non-finite gradients before any of them applies. The AdamW step
counts of the step (host.plan_updates) are fixed by the first update that runs, so a step in
which none ran changes nothing and can still be skipped whole. One that failed after an update
ran cannot be undone: `started` says so, and the engine then refuses to go on until a checkpoint
is loaded (engine/step.py).
"""
from __future__ import annotations

from typing import Callable

from ..capture import CapturedModel
from ..capture.model_graph import owners
from ..ir.program import Op, Program, grads
from .backend import Backend, Event
from .host import HostState


class EarlyUpdates:
    def __init__(self, captured: CapturedModel, program: Program, host: HostState, owner_of: Callable[[int], int]):
        self.host = host
        contributors = owners(captured)[1]
        # Per host owner: the node its update starts at (its program's last OPTIMIZER_STEP for it,
        # after every gradient it needs), the stages whose gradients it needs, and the node of the
        # WAIT on each stage's gradients.
        self.start_at: dict[int, int] = {}
        needs: dict[int, set[int]] = {}
        landed_at: dict[int, int] = {}
        for i, n in enumerate(program.nodes):
            if n.op is Op.OPTIMIZER_STEP:
                owner = owner_of(n.stage)
                self.start_at[owner] = i
                needs.setdefault(owner, set()).update(contributors.get(n.stage, {n.stage}))
            elif n.op is Op.WAIT and grads(n.stage) in n.reads:
                landed_at[n.stage] = i
        # What each update checks before it runs: every owner whose gradients have all landed by its
        # node (its own among them), and the stages it waits for to read their checks.
        self.checks: dict[int, list[int]] = {}
        self.waits_for: dict[int, set[int]] = {}
        for owner, at in self.start_at.items():
            self.checks[owner] = sorted({owner} | {o for o, stages in needs.items()
                                                   if all(landed_at.get(s, at) < at for s in stages)})
            self.waits_for[owner] = set().union(*(needs[o] for o in self.checks[owner]))
        self.clear()

    def begin(self, step: int | None) -> None:
        """A step starts (`step`: the optimizer step its updates make; enter_program and
        begin_micro_batch have run). Its updates keep their own record: the last step's may still
        be running on the host stream."""
        self.this_step = _Step(step, set(self.host.uses), self.host.checks)

    def clear(self) -> None:
        """Before a step of this program: nothing of it has run yet (the record of the last step
        stays with that step's own updates, which may still be running)."""
        self.this_step = _Step(None, set(), {})

    @property
    def started(self) -> int:
        """The running step's owners updated so far (all of them once the host stream drained)."""
        return self.this_step.started

    @property
    def owners(self) -> int:
        return len(self.start_at)

    def start(self, node_index: int, owner: int, landed: dict[int, Event], backend: Backend,
              update: Callable[[], None], what: str) -> bool:
        """At an OPTIMIZER_STEP node: hand `owner`'s update to the host stream if this is the node
        it starts at (True), else nothing (a later node of the same owner starts it)."""
        if self.start_at.get(owner) != node_index:
            return False
        # Every stage it waits for offloaded its gradients before this node (passes/optimizer.py).
        events = [landed[s] for s in sorted(self.waits_for[owner])]
        step, host, owners, checked = self.this_step, self.host, sorted(self.start_at), self.checks[owner]

        def run() -> None:
            for event in events:
                event.wait()
            if step.refused is not None:
                return
            bad = [name for o in checked for name in host.nonfinite_in(o, step.checks)]
            if bad:
                step.refused = f"{len(bad)} gradients hold inf or NaN ({', '.join(bad[:3])})"
                return
            if not step.planned:     # the step's AdamW step counts, once its first update runs
                host.plan_updates(owners, step.number, step.reached)
                step.planned = True
            update()
            step.started += 1
        host.pending[owner] = backend.host_task(run, what)
        return True


class _Step:
    """One step's early updates: the parameters its program reaches, the checks its gradients got
    as they landed (HostState.checks: a new dict every micro-batch), and how far its updates got."""

    def __init__(self, number: int | None, reached: set[str], checks: dict[str, float]):
        self.number, self.reached, self.checks = number, reached, checks
        self.started = 0
        self.refused: str | None = None     # why its updates stopped (a gradient not finite)
        self.planned = False
