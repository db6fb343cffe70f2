"""From a captured model and a budget to a verified plan, or an error naming the smallest budget."""
from __future__ import annotations

from .capture import CapturedModel
from .errors import BudgetTooSmallError
from .ir.printer import fmt_bytes
from .ir.simulate import simulate
from .ir.verify import verify
from .capture.model_graph import owners
from .passes import ScheduleChoice, StepKind, build_schedule, solve
from .plan import Plan

GiB = 2 ** 30


def make_plan(captured: CapturedModel, budget_bytes: int, kind: StepKind = StepKind(), *, backend: str,
              host_bytes: int, dump_dir: str | None = None, fuse: bool = False) -> Plan:
    """The verified plan for `captured` under the budget. With `fuse`, the stage graphs are first
    rewritten onto the fused kernels (passes/fusion), and the plan runs those graphs."""
    if fuse:
        from .passes.fusion import fuse as fuse_stages
        captured = fuse_stages(captured)
    blocks = [s for s, st in enumerate(captured.stages) if st.template.kind == "block"]
    peaks: dict[ScheduleChoice, int] = {}

    def peak_of(choice: ScheduleChoice) -> int:
        if choice not in peaks:
            peaks[choice] = simulate(build_schedule(captured, choice, check=False)).peak
        return peaks[choice]

    choice, minimum = solve(blocks, budget_bytes, peak_of)
    if choice is None:
        largest = max(captured.stages, key=lambda s: s.template.weight_bytes)
        raise BudgetTooSmallError(
            f"hbm_budget of {budget_bytes / GiB:.4g} GiB is too small: the smallest budget that fits this model "
            f"at these input shapes is {minimum / GiB:.4g} GiB ({fmt_bytes(minimum)}), with every block "
            f"recomputed and no prefetch overlap (the largest stage, {largest.name}, holds "
            f"{fmt_bytes(largest.template.weight_bytes)} of weights). Raise hbm_budget to at least "
            f"{minimum / GiB:.4g}, or lower the batch size or sequence length.", minimum)
    program = build_schedule(captured, choice, kind, check=True, dump_dir=dump_dir)
    verify(program, budget_bytes=budget_bytes, owners=owners(captured)[1] if captured.train else None)
    minimum = peak_of(ScheduleChoice(0, frozenset(blocks))) if captured.train else peak_of(ScheduleChoice(0))
    return Plan(program, captured, budget_bytes, host_bytes, backend, minimum)
