"""Which family of schedules the solver's choice comes from, per config and budget, and by how much
it beats the others: the prefix/suffix families alone (the first j blocks offloaded, the next k
recomputed), then with the families that recompute every m-th block of the offloaded stretch
(planner/solve.py, `stride`) for each m in turn. Planned without weights, timed by the cost model.

    python benchmarks/plan_families.py                      # the cases below, on an H100 profile
    python benchmarks/plan_families.py --cases 7b-4x4096 --hardware h200 --markdown out.md

A companion to plan_diff.py: that one says whether a planner change moved a plan, this one which
family a plan comes from. Prints a markdown table; appends to benchmarks/results/plan_families.csv.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _config(name: str) -> dict:
    with open(os.path.join(HERE, "configs", name)) as f:
        return json.load(f)


QWEN_14B = {"model_type": "qwen2", "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 48,
            "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 152064}
# name -> (config, batch, seq, budgets: a float is GiB, "0.34x" that share of the bf16 weights)
CASES = {
    "7b-4x4096": (_config("llama-2-7b.json"), 4, 4096, ("0.34x", 72.0)),
    "7b-8x4096": (_config("llama-2-7b.json"), 8, 4096, ("0.34x", 72.0)),
    "14b-4x4096": (QWEN_14B, 4, 4096, ("0.34x", 72.0)),
    "70b-4x4096": (_config("llama-70b.json"), 4, 4096, ("0.34x", 72.0)),
}


def budget_gib(budget, config: dict) -> float:
    if isinstance(budget, float):
        return budget
    from megacompile.planner.from_config import model_from_config
    params = sum(p.numel() for p in model_from_config(config).parameters())
    return float(budget.rstrip("x")) * 2 * params / 2 ** 30


def pattern(choice) -> str:
    """The chosen holds as counts: offloaded, recomputed (and how many of them sit among the
    offloaded ones), selective, inputs sent to host."""
    off, rec = sorted(choice.offload), sorted(choice.recompute)
    spread = sum(1 for s in rec if off and s < off[-1])
    return (f"off {len(off)}, rec {len(rec)}" + (f" ({spread} spread)" if spread else "")
            + (f", sel {len(choice.selective)}" if choice.selective else "")
            + (f", bnd {len(choice.boundary)}" if choice.boundary else ""))


def plan_with(strides: tuple[int, ...], config: dict, budget: float, batch: int, seq: int, hardware: str):
    """The plan with the solver's strided families limited to `strides` (none: prefix/suffix only)."""
    import megacompile
    import megacompile.planner.search as search
    from megacompile.errors import BudgetTooSmallError
    kept = search.STRIDES
    search.STRIDES = strides
    try:
        return megacompile.plan(config, budget, hardware=hardware, batch=batch, seq=seq, host_budget=4096)
    except BudgetTooSmallError:
        return None
    finally:
        search.STRIDES = kept


def rows_for(name: str, hardware: str) -> list[dict]:
    import megacompile.planner.search as search
    config, batch, seq, budgets = CASES[name]
    rows = []
    for b in budgets:
        gib = budget_gib(b, config)
        variants = {"prefix/suffix": ()} | {f"m={m}": (m,) for m in search.STRIDES}
        timed = {}
        for label, strides in variants.items():
            start = time.perf_counter()
            plan = plan_with(strides, config, gib, batch, seq, hardware)
            timed[label] = (plan, time.perf_counter() - start)
        base = timed["prefix/suffix"][0]
        for label, (plan, seconds) in timed.items():
            step = plan.prediction.step_s if plan is not None else None
            gain = (base.prediction.step_s - step) / base.prediction.step_s if base is not None and step else None
            rows.append({"case": name, "hardware": hardware, "budget": b if isinstance(b, str) else f"{b:g} GiB",
                         "budget_gib": round(gib, 3), "families": label, "fits": plan is not None,
                         "step_s": step, "gain_vs_prefix": gain,
                         "chosen": pattern(plan.program.facts["choice"]) if plan is not None else "",
                         "plan_seconds": round(seconds, 2)})
    return rows


def markdown(rows: list[dict]) -> str:
    out = ["| case | budget | families searched | predicted step (s) | step vs prefix/suffix only | chosen |",
           "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        step = f"{r['step_s']:.3f}" if r["fits"] else "does not fit"
        gain = "" if r["gain_vs_prefix"] is None else "same" if r["gain_vs_prefix"] == 0 else \
            f"{-100 * r['gain_vs_prefix']:+.1f}%"
        out.append(f"| {r['case']} | {r['budget']} ({r['budget_gib']:.2f} GiB) | {r['families']} | {step} | {gain} "
                   f"| {r['chosen']} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--markdown", default=None, help="also write the table to this file")
    ap.add_argument("--csv", default=os.path.join(HERE, "results", "plan_families.csv"))
    args = ap.parse_args()
    sys.path.insert(0, HERE)
    from provenance import machine_facts
    rows = [r for name in args.cases.split(",") for r in rows_for(name, args.hardware)]
    table = markdown(rows)
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    facts = machine_facts()
    os.makedirs(os.path.dirname(args.csv), exist_ok=True)
    new = not os.path.exists(args.csv)
    with open(args.csv, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*rows[0], *facts])
        if new:
            writer.writeheader()
        writer.writerows({**r, **facts} for r in rows)


if __name__ == "__main__":
    main()
