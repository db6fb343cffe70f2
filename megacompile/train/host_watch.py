"""The process's host memory, step by step, against the run's host budget.

The plan places the masters, the AdamW moments, the gradients and the offloaded activations in the
host budget, beside what the run holds besides (train/beside.py), and log.csv records the process's
resident set after every step (`host_resident_bytes`). Past the budget, something the plan does not
count has grown (the interpreter and torch are outside it, and small): over a long run that ends in
the kernel killing the process once the machine, or a container's or job's memory limit, is full.
The run says so once, at the first step past it that has also grown a quarter above the first
step's (the state is in place by then: a small run's budget may sit below the interpreter's own
memory, which is no growth), naming what the plan placed and the memory there is, so that it can be
stopped with a checkpoint rather than killed without one. On the cpu backend the simulated device
is host memory too, and its budget is allowed beside the host's.
"""
from __future__ import annotations

from ..cost import default_host_budget_bytes, process_ram
from ..ir import fmt_bytes


GROWN = 1.25       # above the first step's resident set, and past the budget: said


class HostWatch:
    """`budget_bytes`: the run's host budget (per process); `planned_bytes`: what the plan placed in it."""

    def __init__(self, budget_bytes: int, planned_bytes: int | None):
        self.budget_bytes, self.planned_bytes = budget_bytes, planned_bytes
        self.first: int | None = None
        self.said = False

    def check(self, resident: int | None, step: int) -> str | None:
        """The line said the first time `resident` passes the budget, grown since the first step
        (printed), else None."""
        if resident is None:
            return None
        if self.first is None:
            self.first = resident
        if self.said or resident <= self.budget_bytes or resident <= GROWN * self.first:
            return None
        self.said = True
        usable, limit = process_ram()
        room = (f"its memory cgroup allows {fmt_bytes(limit)}" if limit is not None
                else f"the machine has {fmt_bytes(usable)} of RAM")
        planned = "" if self.planned_bytes is None else f" (the plan placed {fmt_bytes(self.planned_bytes)} of state)"
        line = (f"  host memory    after step {step} the process holds {fmt_bytes(resident)}, past the run's host "
                f"budget of {fmt_bytes(self.budget_bytes)}{planned}, and {room}: something the plan does not count "
                "is growing (log.csv's host_resident_bytes, step by step); past that the kernel stops the run "
                "without a checkpoint")
        print(line, flush=True)
        return line


def watch_host(c, engine) -> HostWatch:
    """The watch of a run (`c`, its run.yaml) on `engine`: its host budget, one process's share of
    it under data parallelism, the simulated device's beside it on the cpu backend."""
    total = int(c.host_budget * 2 ** 30) if c.host_budget is not None else default_host_budget_bytes()
    dp = getattr(engine, "data_parallel", None)
    budget = total // (dp.per_node if dp is not None else 1)
    if engine.device.type == "cpu":
        budget += engine.budget_bytes
    cost = getattr(engine, "host_cost", None)
    return HostWatch(budget, cost.ram_bytes if cost is not None else None)
