"""Print a schedule the way a person reads a program: one node a line, device bytes beside it."""
from __future__ import annotations

from .program import Op, Program
from .simulate import simulate


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def format_program(program: Program, header: list[str] | None = None) -> str:
    curve = simulate(program)
    lines = list(header or [])
    lines.append(f"# built by: {' -> '.join(program.passes)}")
    lines.append(f"# predicted device peak {fmt_bytes(curve.peak)} at node {curve.peak_index}")
    lines.append(f"# {'node':>5}  {'live during':>12}  {'op':<15} {'stage':<12} {'values':<40} origin / why")
    for i, n in enumerate(program.nodes):
        stage = program.stage_names[n.stage] if n.stage is not None else ""
        if n.op is Op.FREE:
            values = ", ".join(n.frees)
        elif n.writes and n.reads:
            values = f"{', '.join(n.reads)} -> {', '.join(n.writes)}"
        else:
            values = ", ".join(n.writes or n.reads)
        if len(values) > 40:
            values = values[:37] + "..."
        why = n.origin + (f"  # {n.note}" if n.note else "")
        mark = "*" if i == curve.peak_index else " "
        lines.append(f"{mark}{i:>6}  {fmt_bytes(curve.peak_during[i]):>12}  {n.op.value:<15} {stage:<12} "
                     f"{values:<40} {why}")
    return "\n".join(lines)
