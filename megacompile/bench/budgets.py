"""megacompile's budgets in the peers bench: what a requested budget is in GiB, and one row per
budget actually used. A budget below the smallest the plan fits in is raised to that smallest one;
two requested budgets both below it would train the same plan twice, so the second is not run and
the first row stands for both (its setting names them)."""
from __future__ import annotations

from .workload import Workload

GiB = 2**30


def asked_gib(workload: Workload, budget: str) -> float | None:
    """GiB for a fraction of the model's bf16 weights ("0.5", "0.34"); None for "resident" (most of
    the device: settings.default_hbm_budget, asked in the system's own process, which alone
    touches the GPU)."""
    if budget == "resident":
        return None
    return float(budget) * workload.parameters * 2 / GiB


def resident_gib(device: str) -> float:
    from ..settings import default_hbm_budget
    return default_hbm_budget(device) if device.startswith("cuda") else 64.0


def same_plan(workload: Workload, budget: str, updates: str, rows: list[dict]) -> dict | None:
    """The megacompile row already run that this budget would repeat: one with the same `updates`
    raised to its minimum when this budget is at or below that minimum, or one run at this very
    budget."""
    asked = asked_gib(workload, budget)
    if asked is None:
        return None
    for r in rows:
        if not (r.get("ok") and r.get("system") == "megacompile" and r.get("updates", "at_commit") == updates):
            continue
        used = r["hbm_budget_gib"]
        if (r.get("budget_raised_to_minimum") and asked <= used) or abs(asked - used) <= 1e-9 * used:
            return r
    return None


def merge(row: dict, budget: str) -> None:
    """`row` stands for `budget` too."""
    requested = row.get("requested_budgets", row["setting"].removeprefix("budget ").split(", ")[0])
    row["requested_budgets"] = f"{requested},{budget}"
    updates = row.get("updates", "at_commit")
    row["setting"] = f"budget {row['requested_budgets']}" + ("" if updates == "at_commit" else f", updates {updates}")
