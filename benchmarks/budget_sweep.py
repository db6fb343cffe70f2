"""Predicted against measured, across budgets, on the cpu backend: step time and device peak.

    python benchmarks/budget_sweep.py [--points 8] [--steps 6]

For budgets from the smallest that fits to one that keeps everything, plans the model, runs a
few steps and records the median step time and the measured device peak beside the plan's
predictions (the `cpu` profile is measured on this machine). Writes
benchmarks/results/budget_sweep.csv (long format); plot it with benchmarks/plot_budget_sweep.py.
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import megacompile  # noqa: E402
from provenance import machine_facts  # noqa: E402
from tests import models  # noqa: E402

GiB = 2 ** 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--csv", default=os.path.join(os.path.dirname(__file__), "results", "budget_sweep.csv"))
    args = ap.parse_args()
    torch.manual_seed(0)
    ids = models.batch(96, 8, 32)
    build = lambda: models.NanoGPT(vocab=96, d=args.dim, layers=args.layers)  # noqa: E731
    probe = megacompile.compile(build(), hbm_budget=64, device="cpu").prepare(idx=ids, targets=ids)
    low, high = probe.minimum_budget_bytes, probe.predicted_peak_bytes
    budgets = [low + (high - low) * i / (args.points - 1) for i in range(args.points)]
    rows = []
    print(f"{'budget':>10} {'pred peak':>10} {'meas peak':>10} {'pred ms':>8} {'meas ms':>8} {'p10':>7} {'p90':>7} "
          f"{'err':>6}  schedule")
    for budget in budgets:
        engine = megacompile.compile(build(), hbm_budget=budget / GiB * 1.0001, device="cpu")
        plan = engine.prepare(idx=ids, targets=ids)
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.step(idx=ids, targets=ids)
            engine.synchronize()
            times.append(time.perf_counter() - start)
        times = sorted(times[1:])
        measured = statistics.median(times)
        predicted = plan.prediction.step_s
        peak = engine.memory_stats()["device_peak_bytes"]
        choice = plan.program.facts["choice"]
        schedule = f"depth {choice.prefetch_depth}, recompute {len(choice.recompute)}"
        print(f"{budget / 2**20:>8.1f}Mi {plan.predicted_peak_bytes / 2**20:>8.1f}Mi {peak / 2**20:>8.1f}Mi "
              f"{predicted * 1e3:>8.1f} {measured * 1e3:>8.1f} {times[0] * 1e3:>7.1f} {times[-1] * 1e3:>7.1f} "
              f"{(predicted - measured) / measured:>+6.0%}  {schedule}")
        base = {"budget_bytes": int(budget), "prefetch_depth": choice.prefetch_depth,
                "recomputed_blocks": len(choice.recompute), **machine_facts()}
        for metric, value in (("predicted_step_s", predicted), ("measured_step_s", measured),
                              ("measured_step_s_p10", times[0]), ("measured_step_s_p90", times[-1]),
                              ("predicted_peak_bytes", plan.predicted_peak_bytes), ("measured_peak_bytes", peak)):
            rows.append({**base, "metric": metric, "value": value})
        engine.close()
    os.makedirs(os.path.dirname(args.csv), exist_ok=True)
    with open(args.csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {args.csv}")


if __name__ == "__main__":
    main()
