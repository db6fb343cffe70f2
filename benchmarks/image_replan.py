"""What a new set of image sizes costs a vision-language run: its capture and plan, made again.

    python benchmarks/image_replan.py         # Qwen2.5-VL-7B's shape, 2 images a row, 2048 tokens, 80 GiB H100

Qwen's grids are constants of a capture (docs/decisions.md), so a micro-batch whose images have
sizes not met before is captured and planned anew. Each mode runs in a fresh Python: one plan to
warm it (imports, the model on the meta device), then one plan per image size, timed, with the
capture's own seconds (trace_seconds) beside the whole. The modes:

    batched     as a run captures: every block logged that an earlier capture did not log called alike
                (capture.top.blocks_logged_before), the tower's attention once per chunk length
                (capture/vision_chunks.py)
    per-chunk   the peer, in the same run: transformers' own attention call per chunk (each image, each window)
    planned     as `megacompile plan` captures: batched, the first two and the last block of each group
                built alike logged for the rest (capture/alike.py)

Side lengths that are multiples of 112 px give windows of one length; the others, windows of
several. Prints a table and appends to benchmarks/results/image_replan.csv (long format, with the
machine and its load). No timed asserts: the figures move with the machine's load.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ("batched", "per-chunk", "planned")


def one_mode(args) -> dict:
    """Plan once per size in this process (after a warm-up plan); the seconds of each."""
    import torch
    import megacompile.capture as capture
    import megacompile.planner.from_config as from_config
    from megacompile.planner.from_config import model_from_config, plan
    if args.mode == "per-chunk":
        capture.batched_chunks = lambda model: contextlib.nullcontext()
    if args.mode != "planned":
        # As a run's engine captures: every block logged, but for those called as an earlier
        # capture of the run called them (the language model's, when only the images change).
        memo: dict = {}
        from_config.blocks_grouped_once = lambda: capture.blocks_logged_before(memo)
    kwargs = dict(batch=args.batch, seq=args.seq, images_per_row=args.images_per_row, host_budget=args.host_budget,
                  compute_dtype=torch.bfloat16)
    model = model_from_config(args.config)      # one model, as a run holds it
    plan(model, args.hbm_budget, image_size=args.warm_size, **kwargs)
    rows = []
    for size in args.sizes:
        t = time.perf_counter()
        result = plan(model, args.hbm_budget, image_size=size, **kwargs)
        rows.append({"image_size": size, "plan_s": time.perf_counter() - t,
                     "trace_s": result.captured.trace_seconds, "predicted_step_s": result.prediction.step_s})
    return {"rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.path.join(HERE, "configs", "qwen2.5-vl-7b.json"))
    ap.add_argument("--hbm-budget", type=float, default=80)
    ap.add_argument("--host-budget", type=float, default=200, help="GiB (the plan's host side; not this machine's)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--images-per-row", type=int, default=2)
    ap.add_argument("--sizes", type=int, nargs="+", default=[448, 476, 504, 532])
    ap.add_argument("--warm-size", type=int, default=420)
    ap.add_argument("--csv", default=os.path.join(HERE, "results", "image_replan.csv"))
    ap.add_argument("--mode", choices=MODES, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode is not None:       # the child
        print(json.dumps(one_mode(args)))
        return

    sys.path.insert(0, HERE)
    from plan_time import append_rows
    from provenance import machine_facts
    results = {}
    for mode in MODES:
        load = os.getloadavg()[0]
        cmd = [sys.executable, __file__, "--mode", mode, "--config", args.config, "--hbm-budget", str(args.hbm_budget),
               "--host-budget", str(args.host_budget), "--batch", str(args.batch), "--seq", str(args.seq),
               "--images-per-row", str(args.images_per_row), "--warm-size", str(args.warm_size),
               "--sizes", *map(str, args.sizes)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        results[mode] = {**json.loads(out), "load_before": load, "load_after": os.getloadavg()[0]}

    print(f"{os.path.basename(args.config)}: {args.batch} x {args.seq} tokens, {args.images_per_row} images a row, "
          f"{args.hbm_budget:g} GiB; seconds to capture and plan a new image size (capture's own in brackets)")
    print(f"{'image px':>9} {'batched':>16} {'per-chunk':>16} {'per-chunk / batched':>20} {'planned':>16}")
    for ours, theirs, planned in zip(*(results[m]["rows"] for m in MODES)):
        print(f"{ours['image_size']:>9} {ours['plan_s']:>8.2f} ({ours['trace_s']:>5.2f}) "
              f"{theirs['plan_s']:>8.2f} ({theirs['trace_s']:>5.2f}) {theirs['plan_s'] / ours['plan_s']:>19.2f}x "
              f"{planned['plan_s']:>8.2f} ({planned['trace_s']:>5.2f})")
    for mode, r in results.items():
        print(f"{mode}: load average (1 min) {r['load_before']:.2f} -> {r['load_after']:.2f}")
    facts = machine_facts()
    rows = [{**facts, "config": os.path.basename(args.config), "batch": args.batch, "seq": args.seq,
             "images_per_row": args.images_per_row, "hbm_budget": args.hbm_budget, "mode": mode,
             "image_size": row["image_size"], "figure": figure, "value": row[figure]}
            for mode, r in results.items() for row in r["rows"] for figure in ("plan_s", "trace_s", "predicted_step_s")]
    append_rows(args.csv, rows)


if __name__ == "__main__":
    main()
