"""Predicted against measured, across budgets, on the cpu backend: step time and device peak.

    python benchmarks/budget_sweep.py [--models nanogpt,llama] [--points 8] [--steps 6]

For budgets from the smallest that fits to one that keeps everything, plans each model, runs a
few steps and records the median step time and the measured device peak beside the plan's
predictions (the `cpu` profile is measured on this machine). Writes
benchmarks/results/budget_sweep.csv (long format); plot it with benchmarks/plot_budget_sweep.py.

`--models nanogpt,llama,qwen2,gpt2 --parity --points 2` runs the parity models of
tests/e2e/test_parity.py (12 layers, width 128) at the smallest and the largest budget.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import megacompile  # noqa: E402
from provenance import machine_facts, write_rows  # noqa: E402
from tests import models  # noqa: E402

GiB = 2 ** 30


def builder(kind: str, dim: int, layers: int):
    return {"nanogpt": lambda: models.NanoGPT(vocab=96, d=dim, layers=layers, heads=4),
            "llama": lambda: models.hf_llama(layers=layers, d=dim),
            "qwen2": lambda: models.hf_qwen2(layers=layers, d=dim),
            "gpt2": lambda: models.hf_gpt2(layers=layers, d=dim)}[kind]


def inputs(kind: str, ids: torch.Tensor) -> dict:
    return {"idx": ids, "targets": ids} if kind == "nanogpt" else {"input_ids": ids, "labels": ids}


def sweep(kind: str, args) -> list[dict]:
    torch.manual_seed(0)
    ids = models.batch(96, *((2, 16) if args.parity else (8, 32)))
    build = builder(kind, 128 if args.parity else args.dim, 12 if args.parity else args.layers)
    probe = megacompile.compile(build(), hbm_budget=64, device="cpu").prepare(**inputs(kind, ids))
    low, high = probe.minimum_budget_bytes, probe.predicted_peak_bytes
    budgets = [low + (high - low) * i / (args.points - 1) for i in range(args.points)]
    rows = []
    for budget in budgets:
        engine = megacompile.compile(build(), hbm_budget=budget / GiB * 1.0001, device="cpu")
        plan = engine.prepare(**inputs(kind, ids))
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.step(**inputs(kind, ids))
            engine.synchronize()
            times.append(time.perf_counter() - start)
        times = sorted(times[1:])
        measured = statistics.median(times)
        predicted = plan.prediction.step_s
        peak = engine.memory_stats()["device_peak_bytes"]
        choice = plan.program.facts["choice"]
        schedule = (f"depth {choice.prefetch_depth}, recompute {len(choice.recompute)}, offload {len(choice.offload)}, "
                    f"selective {len(choice.selective)}")
        print(f"{kind:>8} {budget / 2**20:>8.2f}Mi {plan.predicted_peak_bytes / 2**20:>8.2f}Mi {peak / 2**20:>8.2f}Mi "
              f"{predicted * 1e3:>8.1f} {measured * 1e3:>8.1f} {times[0] * 1e3:>7.1f} {times[-1] * 1e3:>7.1f} "
              f"{(predicted - measured) / measured:>+6.0%}  {schedule}", flush=True)
        base = {"model": kind, "budget_bytes": int(budget), "prefetch_depth": choice.prefetch_depth,
                "recomputed_blocks": len(choice.recompute), "offloaded_blocks": len(choice.offload),
                "selective_blocks": len(choice.selective), **machine_facts()}
        for metric, value in (("predicted_step_s", predicted), ("measured_step_s", measured),
                              ("measured_step_s_p10", times[0]), ("measured_step_s_p90", times[-1]),
                              ("predicted_peak_bytes", plan.predicted_peak_bytes), ("measured_peak_bytes", peak)):
            rows.append({**base, "metric": metric, "value": value})
        engine.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="nanogpt", help="comma-separated: nanogpt, llama, qwen2, gpt2")
    ap.add_argument("--points", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--parity", action="store_true", help="the parity tests' models and batch (2 x 16)")
    ap.add_argument("--csv", default=os.path.join(os.path.dirname(__file__), "results", "budget_sweep.csv"))
    args = ap.parse_args()
    print(f"{'model':>8} {'budget':>10} {'pred peak':>10} {'meas peak':>10} {'pred ms':>8} {'meas ms':>8} "
          f"{'p10':>7} {'p90':>7} {'err':>6}  schedule")
    rows = [row for kind in args.models.split(",") for row in sweep(kind, args)]
    write_rows(args.csv, rows)


if __name__ == "__main__":
    main()
