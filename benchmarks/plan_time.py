"""How long planning takes, by part: imports, the model on the meta device, capture, fusion, the solver.

    cd benchmarks
    python plan_time.py --config configs/llama-118b.json --hbm-budget 80 --hardware h100 --batch 16 --seq 4096
    python plan_time.py --config configs/llama-118b.json --hbm-budget 80 --hardware h100 --global-batch 16

The first line times one micro-batch part by part; with --global-batch it times the whole choice
of a micro-batch (plan_global_batch: every power-of-two divisor captured and planned). Prints a
table and writes benchmarks/results/plan_time.csv (long format). No model weights.
"""
from __future__ import annotations

import argparse
import os
import time

start = time.perf_counter()
import torch  # noqa: E402

from megacompile.plan.from_config import model_from_config, plan_global_batch  # noqa: E402
from provenance import machine_facts, write_rows  # noqa: E402

IMPORTS_S = time.perf_counter() - start


def one_micro_batch(args) -> dict[str, float]:
    from megacompile.capture import capture
    from megacompile.cost import get_profile
    from megacompile.errors import BudgetTooSmallError
    from megacompile.passes.fusion import fuse
    from megacompile.plan.search import make_plan
    from megacompile.cost.host_memory import host_costs
    seconds = {"imports": IMPORTS_S}
    t = time.perf_counter()
    model = model_from_config(args.config)
    seconds["model_on_meta"] = time.perf_counter() - t
    t = time.perf_counter()
    ids = torch.empty(args.batch, args.seq, dtype=torch.long, device="meta")
    captured = capture(model, (), {"input_ids": ids, "labels": ids}, device=torch.device("cpu"),
                       compute_dtype=torch.bfloat16)
    seconds["capture"] = time.perf_counter() - t
    t = time.perf_counter()
    captured = fuse(captured)
    seconds["fuse"] = time.perf_counter() - t
    t = time.perf_counter()
    try:
        plan = make_plan(captured, int(args.hbm_budget * 2**30), backend=f"planned for {args.hardware}",
                         host_bytes=host_costs(captured, torch.bfloat16)[0].ram_bytes, hardware=get_profile(args.hardware))
        print(plan.summary())
    except BudgetTooSmallError as e:
        print(f"does not fit: {e}")
    seconds["solver_and_plan"] = time.perf_counter() - t
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--hbm-budget", type=float, required=True)
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--global-batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--csv", default=os.path.join(os.path.dirname(__file__), "results", "plan_time.csv"))
    args = ap.parse_args()
    if args.global_batch is None:
        seconds = one_micro_batch(args)
    else:
        t = time.perf_counter()
        plan, accumulate = plan_global_batch(args.config, args.hbm_budget, args.global_batch,
                                             hardware=args.hardware, seq=args.seq)
        seconds = {"imports": IMPORTS_S, "plan_global_batch": time.perf_counter() - t}
        print(plan.summary())
        print(f"micro-batch {args.global_batch // accumulate} x {accumulate} accumulated")
    seconds["total"] = sum(seconds.values())
    for part, s in seconds.items():
        print(f"{part:<20} {s:8.2f} s")
    facts = machine_facts()
    rows = [{"config": os.path.basename(args.config), "hardware": args.hardware, "batch": args.batch,
             "global_batch": args.global_batch or "", "seq": args.seq, "part": part, "seconds": round(s, 3), **facts}
            for part, s in seconds.items()]
    write_rows(args.csv, rows)

if __name__ == "__main__":
    main()
