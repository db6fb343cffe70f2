"""Predicted training throughput of Llama/Qwen-architecture models on one GPU, planned without weights.

For each model and GPU: megacompile's plan, and the same graphs under a MegaTrain-style and a
ZeRO-3-offload-style schedule (passes/baselines.py), all timed by one cost model. The batch is
16 x 4096 tokens per optimizer step, split for each system into the micro-batch with the highest
predicted throughput that fits the budget (megacompile.planner.from_config.plan_global_batch), accumulated.

    python benchmarks/plan_table.py [--models 7b,14b] [--hardware h100,h200,gh200] [--markdown docs/table.md]

Writes benchmarks/results/plan_table.csv (long format) and prints a markdown table.
"""
from __future__ import annotations

import argparse
import os
import time

import megacompile
from megacompile.errors import BudgetTooSmallError
from megacompile.planner.from_config import plan_global_batch
from provenance import machine_facts, write_table

MODELS = {
    "7b": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000},
    "14b": {"model_type": "qwen2", "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 48,
            "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 152064},
    "32b": {"model_type": "qwen2", "hidden_size": 5120, "intermediate_size": 27648, "num_hidden_layers": 64,
            "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 152064},
    "70b": {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
            "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256},
    "100b": {"model_type": "llama", "hidden_size": 10240, "intermediate_size": 28672, "num_hidden_layers": 88,
             "num_attention_heads": 80, "num_key_value_heads": 8, "vocab_size": 128256},
}
# GiB the plan may use: the card's memory less headroom for the CUDA context and fragmentation.
BUDGETS = {"h100": 72, "h200": 128, "gh200": 86}
SEQ = 4096
GLOBAL_BATCH = 16


def best_baseline(config: dict, budget: float, hardware: str, style: str, fuse: bool) -> tuple:
    """Another system's schedule at its own fastest micro-batch that fits the budget (the smallest
    micro-batch if none does), as plan_global_batch chooses megacompile's."""
    best = None
    micro = GLOBAL_BATCH
    while micro >= 1:
        plan = megacompile.plan(config, budget, hardware=hardware, batch=micro, seq=SEQ, style=style, fuse=fuse)
        if plan.fits and (best is None or plan.prediction.tokens_per_s > best[0].prediction.tokens_per_s):
            best = (plan, GLOBAL_BATCH // micro)
        micro //= 2
    return best or (plan, GLOBAL_BATCH)


def plan_row(name: str, hardware: str, fuse: bool) -> list[dict]:
    config = {**MODELS[name], "max_position_embeddings": SEQ}
    budget = BUDGETS[hardware]
    start = time.perf_counter()
    try:   # the fastest micro-batch for a global batch of 16, accumulated
        ours, accumulate = plan_global_batch(config, budget, GLOBAL_BATCH, hardware=hardware,
                                             seq=SEQ, fuse=fuse)
    except BudgetTooSmallError:
        return [{"model": name, "hardware": hardware, "system": "megacompile", "fits": False}]
    seconds = time.perf_counter() - start
    rows = []
    for system, (plan, accumulate) in (("megacompile", (ours, accumulate)),
                                       ("megatrain-style", best_baseline(config, budget, hardware, "megatrain", fuse)),
                                       ("zero3-style", best_baseline(config, budget, hardware, "zero3", fuse))):
        p = plan.prediction
        rows.append({"model": name, "hardware": hardware, "system": system, "batch": GLOBAL_BATCH // accumulate,
                     "seq": SEQ, "grad_accum": accumulate, "fits": plan.fits, "params": sum(e.numel for e in plan.captured.state.values() if e.trainable),
                     "budget_gib": budget, "device_peak_gib": plan.predicted_peak_bytes / 2**30,
                     "host_gib": (plan.host_bytes + plan.stash_bytes) / 2**30,
                     "host_activation_gib": plan.stash_bytes / 2**30, "h2d_gib_per_step": plan.h2d_bytes_per_step / 2**30,
                     "d2h_gib_per_step": plan.d2h_bytes_per_step / 2**30, "step_s": p.step_s,
                     "tokens_per_s": p.tokens_per_s, "tflops_6nd": p.tflops_6nd,
                     "hw_flops_per_model_flop": p.hardware_flops_per_model_flop,
                     "recomputed_blocks": len(plan.recomputed),
                     "offloaded_blocks": len(plan.program.facts["choice"].offload),
                     "selective_blocks": len(plan.program.facts["choice"].selective), "plan_seconds": seconds if system == "megacompile" else None,
                     "fuse": fuse, **machine_facts()})
    return rows


def other(r: dict) -> str:
    """A baseline's cell: TFLOPS and its micro-batch; * where it fits the budget at none."""
    return f"{r['tflops_6nd']:.0f} ({r['batch']}{'' if r['fits'] else '*'})"


def markdown(rows: list[dict]) -> str:
    by = {(r["model"], r["hardware"], r["system"]): r for r in rows}
    lines = ["| model | GPU | micro-batch x accumulated x seq | megacompile TFLOPS (6ND) | tokens/s | HW/model FLOPs | blocks recomputed / offloaded / selective | "
             "link GiB/step (in/out) | host RAM GiB (of it activations) | MegaTrain-style TFLOPS (micro-batch) | ZeRO-3-style TFLOPS (micro-batch) | vs MegaTrain-style |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (model, hw, system), r in by.items():
        if system != "megacompile":
            continue
        if not r.get("fits", True) or "tflops_6nd" not in r:
            lines.append(f"| {model} | {hw} | - | does not fit | | | | | | | | |")
            continue
        mt, z3 = by[(model, hw, "megatrain-style")], by[(model, hw, "zero3-style")]
        lines.append(
            f"| {model} | {hw} | {r['batch']} x {r['grad_accum']} x {r['seq']} | {r['tflops_6nd']:.0f} | {r['tokens_per_s']:,.0f} | "
            f"{r['hw_flops_per_model_flop']:.2f} | {r['recomputed_blocks']} / {r['offloaded_blocks']} / "
            f"{r['selective_blocks']} | {r['h2d_gib_per_step']:.0f} / "
            f"{r['d2h_gib_per_step']:.0f} | {r['host_gib']:.0f} ({r['host_activation_gib']:.0f}) | {other(mt)} | {other(z3)} | "
            f"{r['tflops_6nd'] / mt['tflops_6nd']:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--hardware", default=",".join(BUDGETS))
    ap.add_argument("--no-fuse", dest="fuse", action="store_false",
                    help="plan without the fused kernels (compile() uses them on a GPU)")
    ap.add_argument("--csv", default=os.path.join(os.path.dirname(__file__), "results", "plan_table.csv"))
    ap.add_argument("--markdown", default=None, help="also write the table to this file")
    args = ap.parse_args()
    rows = []
    for name in args.models.split(","):
        for hw in args.hardware.split(","):
            rows += plan_row(name, hw, args.fuse)
            print(f"planned {name} on {hw}", flush=True)
    write_table(rows, args.csv, markdown(rows), args.markdown)


if __name__ == "__main__":
    main()
