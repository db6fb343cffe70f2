"""Print a schedule the way a person reads a program: one node a line, device bytes beside it.

A legend of the value names the schedule uses comes first. Runs of blocks that do the same
thing (ir/fold.py) are folded: the first and the last block of a run in full, one line for
those between (`fold=False` prints every node). The values column wraps onto further lines
rather than being cut.
"""
from __future__ import annotations

import math
import re
import textwrap

from .fold import Run, find_runs, window_label
from .program import Op, Program
from .simulate import simulate

VALUES_WIDTH = 40
# Value-name prefixes, in the order the legend lists them: what a name stands for (s: a stage).
LEGEND = (
    ("in", "in<k> model input k"),
    ("seed", "seed the loss gradient"),
    ("w", "w<s> stage s's weights on the device"),
    ("m", "m<s> its fp32 masters in host memory (the update to wait for)"),
    ("x", "x<s>.<k> its k-th output"),
    ("saved", "saved<s> what its backward reads"),
    ("rsaved", "rsaved<s> the same, recomputed"),
    ("xsaved", "xsaved<s> an extra forward's, thrown away"),
    ("hsaved", "h<v> value v back from host memory"),
    ("g", "g<s> its parameters' gradients"),
    ("dx", "dx<s>.<k> the gradient of its k-th input"),
)
_PREFIX = re.compile(r"^([a-z]+?)\d")


_NAME = re.compile(r"^(h?)([a-z]+?)(\d*)(?:\.(\d+))?(?:@(\d+))?$")
# What a value of each prefix is, for a reader who has not seen the legend ({} the stage's module).
_MEANING = {"w": "weights of {}", "m": "fp32 masters of {}", "saved": "saved activations of {}",
            "rsaved": "recomputed saved activations of {}", "xsaved": "an extra forward's saved activations of {}",
            "g": "gradients of {}'s parameters"}


def describe_value(name: str, places: list[str]) -> str:
    """A schedule value's name (w35, hsaved80, dx3.0@1) in words: what it is and whose, where
    `places[s]` names stage s for a reader (a block's module path, "the prologue", ...)."""
    m = _NAME.match(name)
    if m is None:
        return name
    back, prefix, stage, index, micro = m.groups()
    if prefix == "in":
        text = f"model input {stage}"
    elif prefix == "seed":
        text = "the loss gradient"
    elif not stage or int(stage) >= len(places):
        return name
    elif prefix in _MEANING:
        text = _MEANING[prefix].format(places[int(stage)])
    elif prefix == "x":
        text = f"{'output' if index in (None, '0') else f'output {index}'} of {places[int(stage)]}"
    elif prefix == "dx":    # what stage s's backward hands back for its k-th input
        text = f"gradient of the {'input' if index in (None, '0') else f'input {index}'} of {places[int(stage)]}"
    else:
        return name
    if back:
        text += ", back from host memory"
    if micro is not None:
        text += f", micro-batch {micro}"
    return text


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def fmt_need(n: int) -> str:
    """Bytes a reader may give back as a budget, as fmt_bytes writes them but rounded up at the
    digit shown: 4,610,156,407 B is 4.2935 GiB, written 4.30 GiB (4.29 would be 3.6 MiB short)."""
    for power, unit in enumerate(("B", "KiB", "MiB", "GiB", "TiB")):
        if n < 1024 ** (power + 1) or unit == "TiB":
            if unit == "B":
                return f"{math.ceil(n)} B"
            hundredths = -(-math.ceil(n * 100) // 1024 ** power)      # integer ceiling: no float rounding
            return f"{hundredths // 100}.{hundredths % 100:02d} {unit}"
    raise AssertionError


def gib_need(n: int, digits: int = 4) -> str:
    """Bytes as GiB to `digits` significant figures, rounded up: a budget given back in GiB
    (hbm_budget=, --hbm-budget) that holds n bytes."""
    return _gib(n, digits, up=True)


def gib_within(n: int, digits: int = 4) -> str:
    """Bytes as GiB to `digits` significant figures, rounded down: a budget given back in GiB that
    stays within n bytes (a device's memory)."""
    return _gib(n, digits, up=False)


def _gib(n: int, digits: int, up: bool) -> str:
    if n <= 0:
        return "0"
    decimals = max(0, digits - 1 - math.floor(math.log10(n / 2**30)))
    units = -(-n * 10**decimals // 2**30) if up else n * 10**decimals // 2**30     # in 10^-decimals GiB, exact
    text = f"{units // 10**decimals}.{units % 10**decimals:0{decimals}d}" if decimals else str(units)
    return text.rstrip("0").rstrip(".") if "." in text else text


def fmt_seconds(s: float) -> str:
    """Seconds as s, ms or us, three significant digits, never an exponent."""
    if s == 0:
        return "0 s"
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if abs(s) >= scale * 0.9995 or unit == "us":
            v = s / scale
            return f"{v:,.0f} {unit}" if abs(v) >= 99.95 else f"{v:.3g} {unit}" if abs(v) >= 0.01 else f"0 {unit}"
    raise AssertionError


def fmt_rate(x: float) -> str:
    """A rate (TFLOPS, tok/s) to three significant digits, never an exponent: a tiny model on the
    simulated device runs at 6.29e-05 TFLOPS, which reads as 0.0000629."""
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    decimals = max(0, 2 - math.floor(math.log10(abs(x))))
    return f"{x:,.{decimals}f}"


def legend(program: Program) -> list[str]:
    """The value-name prefixes this schedule uses, and which stage each number names."""
    used = set()
    for v in program.values:
        m = _PREFIX.match(v)
        prefix = m.group(1) if m else v
        used.add("hsaved" if prefix.startswith("h") else prefix)
    parts = [text for prefix, text in LEGEND if prefix in used]
    names = program.stage_names
    stages = (f"stage s is the s-th of {len(names)}: "
              + ", ".join(f"{s} {names[s]}" for s in range(min(2, len(names))))
              + (f", ..., {len(names) - 1} {names[-1]}" if len(names) > 2 else ""))
    return textwrap.wrap("values: " + "; ".join(parts) + "; " + stages, 110)


def _values(n) -> str:
    if n.op is Op.FREE:
        return ", ".join(n.frees)
    if n.writes and n.reads:
        return f"{', '.join(n.reads)} -> {', '.join(n.writes)}"
    return ", ".join(n.writes or n.reads)


def _node_lines(program: Program, curve, i: int) -> list[str]:
    n = program.nodes[i]
    stage = program.stage_names[n.stage] if n.stage is not None else ""
    values = textwrap.wrap(_values(n), VALUES_WIDTH, break_on_hyphens=False) or [""]
    why = n.origin + (f"  # {n.note}" if n.note else "")
    mark = "*" if i == curve.peak_index else " "
    lines = [f"{mark}{i:>6}  {fmt_bytes(curve.peak_during[i]):>12}  {n.op.value:<15} {stage:<12} "
             f"{values[0]:<{VALUES_WIDTH}} {why}"]
    pad = " " * (1 + 6 + 2 + 12 + 2 + 15 + 1 + 12 + 1)
    lines += [f"{pad}{more}" for more in values[1:]]
    return lines


def _fold_line(program: Program, curve, run: Run) -> str:
    first, last = 1, run.count - 2
    a, b = window_label(program, run, first), window_label(program, run, last)
    start, end = run.start + run.period, run.start + (run.count - 1) * run.period - 1
    # How device bytes move from one block to the next (constant in a run that holds more each block).
    steps = {curve.peak_during[j + run.period] - curve.peak_during[j] for j in range(run.start, end + 1)}
    moves = ""
    if len(steps) == 1 and (step := steps.pop()):
        moves = f"; {'+' if step > 0 else '-'}{fmt_bytes(abs(step))} live per block"
    elif steps:
        span = curve.peak_during[start:end + 1]
        moves = f"; {fmt_bytes(min(span))} .. {fmt_bytes(max(span))} live"
    peak = " (holds the peak, *)" if start <= curve.peak_index <= end else ""
    shift = "offset by one" if run.shift > 0 else "offset by minus one"
    return (f" {start:>6}  {'..' + str(end):>12}  {a} .. {b}: same as {window_label(program, run, 0)}, {shift} "
            f"({run.period} node{'s' if run.period > 1 else ''} each, {end - start + 1} in all{moves}){peak}")


def format_program(program: Program, header: list[str] | None = None, fold: bool = True) -> str:
    curve = simulate(program)
    lines = list(header or [])
    lines += [f"# {line}" for line in legend(program)]
    lines.append(f"# built by: {' -> '.join(program.passes)}")
    arena = program.facts.get("arena")
    laid_out = (f"; device arena {fmt_bytes(arena.size)} ({fmt_bytes(arena.fragmentation)} above the peak, "
                f"{len(arena.tensors)} tensors at planned offsets)" if arena is not None else "")
    lines.append(f"# predicted device peak {fmt_bytes(curve.peak)} at node {curve.peak_index}{laid_out}")
    lines.append(f"# {'node':>5}  {'live during':>12}  {'op':<15} {'stage':<12} {'values':<{VALUES_WIDTH}} origin / why")
    runs = {r.start: r for r in find_runs(program)} if fold else {}
    i = 0
    while i < len(program.nodes):
        run = runs.get(i)
        if run is None:
            lines += _node_lines(program, curve, i)
            i += 1
            continue
        for j in range(run.start, run.start + run.period):
            lines += _node_lines(program, curve, j)
        lines.append(_fold_line(program, curve, run))
        for j in range(run.end - run.period, run.end):
            lines += _node_lines(program, curve, j)
        i = run.end
    return "\n".join(lines)
