"""The command: sections in order, each bounded by what is left of the time budget."""
from __future__ import annotations

import argparse
import time
import traceback
from pathlib import Path

import torch

from .table import Row, machine, markdown, write

SECTIONS = ("kernels", "parity", "budget", "calibrate", "step")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megacompile.acceptance", description=__doc__)
    p.add_argument("--out", type=Path, default=Path("validate-results"), help="folder for validate.csv and validate.md")
    p.add_argument("--device", default="cuda", help="cuda or cuda:N (default: the current GPU)")
    p.add_argument("--skip", default="", help=f"comma-separated sections to skip, of {', '.join(SECTIONS)}")
    p.add_argument("--minutes", type=float, default=9.5, help="time budget; sections that would start late are skipped")
    p.add_argument("--layers-1b", type=int, default=22, help="layers of the 1B-shaped Llama (22: all of them)")
    p.add_argument("--layers-7b", type=int, default=8, help="layers of the 7B-shaped Llama (host RAM: ~22 GB per 1B params)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if skip - set(SECTIONS):
        parser().error(f"--skip: {', '.join(sorted(skip - set(SECTIONS)))} is not a section; the sections are "
                       f"{', '.join(SECTIONS)}")
    if not torch.cuda.is_available():
        print("megacompile.acceptance: torch sees no GPU here, so there is nothing to validate on a device "
              f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}). The cpu half of these checks "
              "runs in the tests: pytest tests/acceptance.")
        return 0
    from ..runtime import normalize_device
    device = normalize_device(args.device)
    deadline = time.perf_counter() + 60 * args.minutes
    facts = machine()
    rows: list[Row] = []
    profile = None

    def section(name: str, minutes_needed: float, run) -> None:
        nonlocal rows
        if name in skip:
            return
        left = (deadline - time.perf_counter()) / 60
        if left < minutes_needed:
            rows.append(Row(name, "skipped", left, minutes_needed, None, {"reason": "not enough time left"}))
            return
        start = time.perf_counter()
        print(f"== {name} ({left:.1f} min left)", flush=True)
        try:
            new = run()
        except Exception as e:  # noqa: BLE001 - a broken section is a failed row; the others still run
            traceback.print_exc()
            new = [Row(name, "error", float("nan"), float("nan"), False, {"error": f"{type(e).__name__}: {e}"})]
        for r in new:
            print(f"   {r.name}: {r.value:.4g}" + ("" if r.passed is None else f"  {'pass' if r.passed else 'FAIL'}"),
                  flush=True)
        print(f"   ({time.perf_counter() - start:.0f} s)", flush=True)
        rows += new

    from .checks import budget_rows, kernel_rows, parity_rows
    from .speed import calibrate_rows, step_rows
    with torch.cuda.device(device):
        section("kernels", 1.0, kernel_rows)
        section("parity", 1.0, lambda: parity_rows(device))
        section("budget", 1.0, lambda: budget_rows(device))

        def calibrate():
            nonlocal profile
            profile, out = calibrate_rows(device)
            return out
        section("calibrate", 0.5, calibrate)
        if profile is None:
            from ..calibrate import profile_for
            profile = profile_for("cuda")
        section("step", 1.5, lambda: step_rows(device, "llama-1b", args.layers_1b, profile))
        section("step", 2.0, lambda: step_rows(device, "llama-7b", args.layers_7b, profile))
    csv_path, md_path = write(args.out, rows, facts)
    print(markdown(rows, facts))
    print(f"wrote {csv_path} and {md_path}")
    return 1 if any(r.passed is False for r in rows) else 0
