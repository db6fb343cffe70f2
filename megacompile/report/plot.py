"""The memory picture of a plan: a PNG with two panels over the schedule's nodes.

Top: device bytes stacked by kind (report/memory.py), the budget and the part of it the plan may
fill (budget less the reserve) as lines, and, once the plan has run, the measured bytes (the most
held during each node, the runtime's ledger). Bottom: host RAM stacked by kind, the host budget
when there is one, and the disk tier's bytes when the plan has one. matplotlib is an optional
extra (`pip install megacompile[plot]`); without it a MegacompileError says so.
"""
from __future__ import annotations

import os

from ..errors import MegacompileError
from ..ir.printer import fmt_bytes
from .memory import DEVICE_KINDS, device_by_kind, host_by_kind

UNITS = ((2 ** 30, "GiB"), (2 ** 20, "MiB"), (2 ** 10, "KiB"), (1, "B"))
COLORS = {"weights": "#4c72b0", "saved activations": "#dd8452", "block boundaries": "#55a868",
          "gradients": "#c44e52", "transient": "#bbbbbb"}


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise MegacompileError("the memory picture needs matplotlib: pip install 'megacompile[plot]' "
                               "(or pip install matplotlib)") from e
    matplotlib.use("Agg")      # files only, no display
    import matplotlib.pyplot as plt
    return plt


def _unit(largest: float) -> tuple[int, str]:
    return next((u for u in UNITS if largest >= u[0]), UNITS[-1])


def plot_memory(plan, path: str, measured: list | None = None) -> None:
    """measured: the last step's device bytes per node (Plan.measured_memory()), or None before a run."""
    plt = _pyplot()
    program = plan.program
    x = list(range(len(program.nodes)))
    device = device_by_kind(program)
    ram, disk = host_by_kind(plan)
    shown = max([plan.curve.peak] + [m.peak for m in measured or []])
    # The budget is drawn unless it is far above everything else (a generous budget on a small model).
    budget_on_scale = plan.budget_bytes <= 3 * shown
    GiB, unit = _unit(max(shown, plan.budget_bytes if budget_on_scale else 0))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True, height_ratios=(3, 2))
    top.stackplot(x, *[[b / GiB for b in device[k]] for k in DEVICE_KINDS], labels=DEVICE_KINDS,
                  colors=[COLORS[k] for k in DEVICE_KINDS], step="post", linewidth=0)
    if budget_on_scale:
        top.axhline(plan.budget_bytes / GiB, color="black", linewidth=1.2, label="budget")
    if plan.reserve.total and budget_on_scale:
        top.axhline((plan.budget_bytes - plan.reserve.total) / GiB, color="black", linewidth=0.8, linestyle=":",
                    label="budget less reserve")
    top.step(x, [b / GiB for b in plan.curve.peak_during], where="post", color="#222222", linewidth=0.8,
             label="predicted")
    if measured is not None:
        top.step(x, [m.peak / GiB for m in measured], where="post", color="#8172b3", linewidth=1.0,
                 linestyle="--", label="measured (last step)")
    top.set_ylabel(f"device {unit}")
    top.set_ylim(0, max(shown, plan.budget_bytes if budget_on_scale else 0) / GiB * 1.25)
    top.legend(loc="upper left", fontsize=7, ncol=3, frameon=False)
    fits = "fits" if plan.fits else "does NOT fit"
    top.set_title(f"device memory over the schedule ({plan.hardware.name}): predicted peak {fmt_bytes(plan.curve.peak)}"
                  f" of a {fmt_bytes(plan.budget_bytes)} budget{'' if budget_on_scale else ' (off the scale)'}, {fits}",
                  fontsize=9)

    kinds = list(ram)
    host_top = max([sum(ram[k][i] for k in kinds) for i in x] + [sum(disk.values())])
    host_budget = plan.host_budget_bytes if (plan.host_budget_bytes or 0) <= 3 * host_top else None
    host_top = max(host_top, host_budget or 0)
    GiB, unit = _unit(host_top)
    bottom.stackplot(x, *[[b / GiB for b in ram[k]] for k in kinds], labels=[f"RAM: {k}" for k in kinds],
                     step="post", linewidth=0, alpha=0.85)
    if host_budget is not None:
        bottom.axhline(host_budget / GiB, color="black", linewidth=1.2, label="host budget")
    if disk:
        total = sum(disk.values())
        bottom.axhline(total / GiB, color="#937860", linewidth=1.2, linestyle="--",
                       label=f"disk tier: {', '.join(disk)} ({fmt_bytes(total)})")
    bottom.set_ylabel(f"host {unit}")
    bottom.set_ylim(0, host_top / GiB * 1.3)
    bottom.set_xlabel("schedule node")
    bottom.legend(loc="upper left", fontsize=7, ncol=2, frameon=False)
    fig.tight_layout()
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp")
    fig.savefig(tmp, dpi=80, format="png")
    plt.close(fig)
    os.replace(tmp, path)
