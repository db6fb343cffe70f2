"""Where planning time goes: imports, the model on the meta device, capture, the solver, the verifier.

    python benchmarks/plan_time.py                      # 118B on an 80 GiB H100: 16x4096, and --global-batch 16
    python benchmarks/plan_time.py --config benchmarks/configs/llama-70b.json --batch 4 --global-batch 8

Each case runs in a fresh Python (so its imports are timed too) and plans as `megacompile plan`
does (planner/from_config.py). Planning functions are wrapped with timers that count their own
seconds, without those of the wrapped functions they call, so the parts add up to the whole.
Prints one table, a column per case, and appends to benchmarks/results/plan_time.csv (long
format, with the machine and its load average). No model weights. No timed asserts: the figures
move with the machine's load, and the load is printed beside them.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# (module, attribute, part): the functions timed, each part counting only its own seconds.
PARTS = [
    ("megacompile.planner.from_config", "model_from_config", "model on meta (with transformers' imports)"),
    ("megacompile.planner.from_config", "capture", "capture: top graph and stage graphs"),
    ("megacompile.capture.top", "record", "capture: block fingerprints"),
    ("megacompile.fusion", "fuse", "fusion"),
    ("megacompile.planner.from_config", "place_host_state", "host placement"),
    ("megacompile.planner.search", "judges", "solver"),
    ("megacompile.planner.search", "shorten", "solver: cut stacks short"),
    ("megacompile.planner.search", "solve", "solver"),
    ("megacompile.planner.search", "pick_accumulation", "solver"),
    ("megacompile.planner.search", "search_space", "solver"),
    ("megacompile.planner.search", "build_schedule", "build schedules"),
    ("megacompile.planner.search", "verify", "verify"),
    ("megacompile.planner.search", "predict", "cost model (predict)"),
    ("megacompile.planner.search", "device_reserve", "device reserve"),
    ("megacompile.planner.search", "smallest_budget", "device reserve"),
    ("megacompile.planner.search", "make_plan", "make_plan, rest"),
    ("megacompile.planner.from_config", "plan", "plan(), rest"),
]


class Parts:
    """Exclusive seconds per part: a wrapped call's time less that of wrapped calls inside it."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._stack: list[float] = []     # seconds spent in wrapped callees, per open call

    def wrap(self, module, attr: str, part: str) -> None:
        """Time `module.attr` under `part`, wherever a loaded megacompile module holds it by name."""
        inner = getattr(module, attr)

        def timed(*args, **kwargs):
            self._stack.append(0.0)
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                total = time.perf_counter() - t
                nested = self._stack.pop()
                self.seconds[part] = self.seconds.get(part, 0.0) + total - nested
                self.calls[part] = self.calls.get(part, 0) + 1
                if self._stack:
                    self._stack[-1] += total
        for m in list(sys.modules.values()):
            if getattr(m, "__name__", "").startswith("megacompile"):
                for name, value in list(vars(m).items()):
                    if value is inner:
                        setattr(m, name, timed)


def one_case(args) -> dict:
    """Plan once in this process, as `megacompile plan` would; return the parts' seconds."""
    start = time.perf_counter()
    import importlib

    import torch
    import megacompile  # noqa: F401
    imports = time.perf_counter() - start
    parts = Parts()
    for module, attr, part in PARTS:
        parts.wrap(importlib.import_module(module), attr, part)
    from megacompile.planner import from_config
    t = time.perf_counter()
    kwargs = dict(hardware=args.hardware, seq=args.seq, compute_dtype=torch.bfloat16)
    if args.global_batch:
        result, k = from_config.plan_global_batch(args.config, args.hbm_budget, args.global_batch, **kwargs)
    else:
        result, k = from_config.plan(args.config, args.hbm_budget, batch=args.batch, **kwargs), 1
    planning = time.perf_counter() - t
    seconds = {"imports (torch, megacompile)": imports, **parts.seconds}
    seconds["other"] = planning - sum(parts.seconds.values())
    seconds["total"] = imports + planning
    summary = result.to_json()
    figures = {k: summary[k] for k in ("device_peak_bytes", "minimum_budget_bytes", "predicted_step_s",
                                       "weight_h2d_bytes_per_optimizer_step")}
    figures["micro_batch"] = args.global_batch // k if args.global_batch else args.batch
    figures["grad_accum"] = k
    return {"seconds": seconds, "calls": parts.calls, "figures": figures}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.path.join(HERE, "configs", "llama-118b.json"))
    ap.add_argument("--hbm-budget", type=float, default=80)
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--batch", type=int, default=16, help="the one-micro-batch case's batch")
    ap.add_argument("--global-batch", type=int, default=16, help="the second case's global batch (0: none)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=1, help="runs of each case (each in a fresh Python)")
    ap.add_argument("--csv", default=os.path.join(HERE, "results", "plan_time.csv"))
    ap.add_argument("--case", choices=["micro", "global"], default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case is not None:     # the child: plan and report
        if args.case == "micro":
            args.global_batch = 0
        print(json.dumps(one_case(args)))
        return

    sys.path.insert(0, HERE)
    from provenance import machine_facts
    cases = [("micro", f"--batch {args.batch}")]
    if args.global_batch:
        cases.append(("global", f"--global-batch {args.global_batch}"))
    results: dict[str, list[dict]] = {}
    for case, label in cases:
        for _ in range(args.repeat):
            load = os.getloadavg()[0]
            cmd = [sys.executable, __file__, "--case", case, "--config", args.config, "--hbm-budget",
                   str(args.hbm_budget), "--hardware", args.hardware, "--batch", str(args.batch),
                   "--global-batch", str(args.global_batch), "--seq", str(args.seq)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            results.setdefault(label, []).append({**json.loads(out), "load_before": load,
                                                  "load_after": os.getloadavg()[0]})

    labels = list(results)
    parts = list(dict.fromkeys(p for runs in results.values() for r in runs for p in r["seconds"]))
    width = max(len(p) for p in parts) + 2
    print(f"{os.path.basename(args.config)}, {args.hbm_budget:g} GiB {args.hardware}, seq {args.seq}; "
          f"seconds (median of {args.repeat}, each in a fresh Python)")
    print(f"{'part':<{width}}" + "".join(f"{label:>22}" for label in labels))
    for p in parts:
        cells = []
        for label in labels:
            values = sorted(r["seconds"].get(p, 0.0) for r in results[label])
            cells.append(f"{values[len(values) // 2]:>22.2f}")
        print(f"{p:<{width}}" + "".join(cells))
    for label in labels:
        r = results[label][-1]
        loads = ", ".join(f"{x['load_before']:.2f}->{x['load_after']:.2f}" for x in results[label])
        print(f"{label}: load average (1 min) before->after each run: {loads}; plan: {json.dumps(r['figures'])}")

    facts = machine_facts()
    rows = []
    for label, runs in results.items():
        for i, r in enumerate(runs):
            for p, s in r["seconds"].items():
                rows.append({"config": os.path.basename(args.config), "hardware": args.hardware, "case": label,
                             "seq": args.seq, "run": i, "part": p, "seconds": round(s, 3),
                             "calls": r["calls"].get(p, ""), "load_before": r["load_before"], **facts})
    append_rows(args.csv, rows)


def append_rows(path: str, rows: list[dict]) -> None:
    """Long-format CSV, appended to: one row per case, run and part."""
    import csv
    os.makedirs(os.path.dirname(path), exist_ok=True)
    new = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        if new:
            writer.writeheader()
        writer.writerows(rows)
    print(f"appended {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
