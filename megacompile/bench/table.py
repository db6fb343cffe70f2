"""The peers bench's results: a long CSV (one row per system, setting and metric, with the machine
and every system's version on each row) and a markdown table, one line per system."""
from __future__ import annotations

import csv
import math
from pathlib import Path

COLUMNS = ["system", "setting", "metric", "value", "note"]

# The table's columns: (header, metric, scale, format)
SHOWN = [("budget GiB", "hbm_budget_gib", 1, "{:.2f}"), ("x bf16 weights", "budget_share_of_bf16_weights", 1, "{:.2f}"),
         ("tokens/s", "tokens_per_s", 1, "{:,.0f}"), ("step s", "step_s", 1, "{:.3f}"),
         ("6ND TFLOPS", "tflops_6nd", 1, "{:.1f}"),
         ("max reserved GiB", "max_memory_reserved_bytes", 2**-30, "{:.2f}"),
         ("peak host RSS GiB", "peak_host_rss_bytes", 2**-30, "{:.1f}"),
         ("alloc retries / step", "alloc_retries_per_step", 1, "{:.1f}"),
         ("predicted s (datasheet)", "predicted_step_s_datasheet", 1, "{:.3f}"),
         ("predicted s (calibrated)", "predicted_step_s_calibrated", 1, "{:.3f}"),
         ("loss deviation", "loss_deviation", 1, "{:.1e}")]


# Losses that fell by less than this many tolerances agree whatever each system computed.
WEAK_BELOW = 5


def long_rows(results: list[dict]) -> list[dict]:
    """results: {"system", "setting", "ok", "reason"?, metrics...}; lists (the losses) become one
    row per step, metric "loss" with the step in the note."""
    rows = []
    for r in results:
        base = {"system": r["system"], "setting": r["setting"]}
        if not r.get("ok"):
            rows.append({**base, "metric": "skipped", "value": "", "note": r.get("reason", "")})
            continue
        for key, value in r.items():
            if key in ("system", "setting", "ok", "reason", "traceback"):
                continue
            if isinstance(value, list):
                rows += [{**base, "metric": "loss" if key == "losses" else key, "value": v, "note": f"step {i}"}
                         for i, v in enumerate(value)]
            else:
                rows.append({**base, "metric": key, "value": value, "note": ""})
    return rows


def write_csv(path: Path, results: list[dict], facts: dict) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*COLUMNS, *facts])
        writer.writeheader()
        for row in long_rows(results):
            writer.writerow({**row, **facts})


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def thread_sweep(r: dict) -> list[str]:
    """A megacompile row's steps on other host AdamW thread counts (systems.host_thread_sweep), one
    line each beside the timed steps' count."""
    prefix = "step_s_host_threads_"
    counts = sorted((int(k[len(prefix):]) for k in r if k.startswith(prefix)), reverse=True)
    if not counts:
        return []
    lines = [f"{r.get('host_threads', '?')} host threads (the timed steps): {r['step_s']:.3f} s/step, "
             f"{r.get('measured_wait_update_s', math.nan):.3f} s of it waiting on the updates"]
    return lines + [f"{n} host thread{'' if n == 1 else 's'}: {r[prefix + str(n)]:.3f} s/step, "
                    f"{r.get(f'measured_wait_update_s_host_threads_{n}', math.nan):.3f} s of it waiting on the updates"
                    for n in counts]


def markdown(results: list[dict], facts: dict, workload: dict, reference: str, rtol: float,
             fall: float | None = None) -> str:
    """fall: how far the reference's loss fell over its run, relative (agreement.loss_fall)."""
    def cell(r, metric, scale, fmt):
        v = r.get(metric)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
            return ""
        return fmt.format(v * scale)
    lines = [f"Model: {workload['shape']} ({workload['parameters'] / 1e9:.2f} B parameters), "
             f"{workload['batch']} x {workload['seq']} tokens per step, {workload['steps']} timed steps after "
             f"{workload['warmup']} warmup, compute {workload['compute_dtype']}, fp32 masters and AdamW state on the "
             f"host; AdamW lr {workload['lr']:g}" + (f", rising linearly over the first {workload['lr_warmup']} steps."
                                                    if workload.get("lr_warmup") else "."),
             "", "| system | setting | " + " | ".join(h for h, *_ in SHOWN) + " | losses agree |",
             "|---|---|" + "---|" * (len(SHOWN) + 1)]
    for r in results:
        if not r.get("ok"):
            lines.append(f"| {r['system']} | {r['setting']} | skipped: {r.get('reason', '')} |" + " |" * len(SHOWN))
            continue
        agreed = "yes" if r.get("losses_agree") else "NO"
        lines.append(f"| {r['system']} | {r['setting']} | " + " | ".join(cell(r, *s[1:]) for s in SHOWN)
                     + f" | {agreed} |")
    sweeps = [f"{r['system']} {r['setting']}: {line}" for r in results if r.get("ok") for line in thread_sweep(r)]
    if sweeps:
        lines += ["", "The step again with the host AdamW on other thread counts (the same arithmetic):", "",
                  *(f"- {line}" for line in sweeps)]
    lines += ["", f"Losses are compared step by step with {reference}'s, relative tolerance {rtol:g}."]
    if fall is not None and not math.isnan(fall) and fall < 0:
        lines[-1] += (f" Its loss rose by {-fall:.1%} over the run: the learning rate is too large for this model "
                      f"to train (a smaller --lr), and systems that agree on a diverging run agree on little.")
    elif fall is not None and not math.isnan(fall):
        weak = fall < WEAK_BELOW * rtol
        lines[-1] += (f" Its loss fell by {fall:.1%} over the run, {fall / rtol:.1f} times the tolerance"
                      + (": too little for the agreement to say much (more steps, or a larger --lr)." if weak else "."))
    lines.append("Machine: " + ", ".join(f"{k} {v}" for k, v in facts.items()))
    return "\n".join(lines) + "\n"
