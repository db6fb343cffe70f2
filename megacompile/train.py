"""The main job: train the bundled small Llama on the bundled corpus, under a device budget.

Prints the plan summary first (predicted device peak against the budget, host bytes, bytes moved
per step), then one progress line per step with loss, tokens/s and the measured device peak,
and writes the plan dump and a loss log into the run directory.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from types import SimpleNamespace

import torch

from . import arguments
from .corpus import batches, load_corpus
from .engine import Engine
from .errors import ArgumentError
from .ir.printer import fmt_bytes
from .models import LlamaConfig, TinyLlama
from .optim import AdamW
from .planning import check_attention_shape

GiB = 2 ** 30


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = int(width * done / total)
    return "#" * filled + "." * (width - filled)


def _check(*, steps: int, batch: int, seq: int, config: LlamaConfig, hbm_budget: float | None,
           budget_fraction: float, lr: float, run_dir: str, log_every: int) -> None:
    """Every argument, before a model is built or a file written."""
    arguments.count("steps", steps)
    arguments.count("batch", batch)
    longest = len(load_corpus()) - 2
    arguments.count("seq", seq, maximum=longest, what=" (tokens per sequence; the bundled corpus bounds it)")
    arguments.count("log_every", log_every)
    arguments.budget_bytes("hbm_budget", hbm_budget, optional=True)
    arguments.number("budget_fraction", budget_fraction, strict=True)
    arguments.number("lr", lr)
    for name in ("dim", "layers", "heads", "kv_heads", "ffn"):
        arguments.count(name, getattr(config, name))
    check_attention_shape(SimpleNamespace(hidden_size=config.dim, num_attention_heads=config.heads,
                                          num_key_value_heads=config.kv_heads, head_dim=None))
    if config.head_dim % 2:
        raise ArgumentError(f"dim / heads = {config.head_dim} is the head size, which rotary embeddings need even")
    arguments.folder("run_dir", run_dir, optional=False)


def train(*, steps: int, batch: int, seq: int, config: LlamaConfig, hbm_budget: float | None,
          budget_fraction: float, lr: float, device: str | None, compute_dtype: torch.dtype,
          run_dir: str, seed: int, log_every: int, trace: str | None = None) -> dict:
    _check(steps=steps, batch=batch, seq=seq, config=config, hbm_budget=hbm_budget,
           budget_fraction=budget_fraction, lr=lr, run_dir=run_dir, log_every=log_every)
    torch.manual_seed(seed)
    model = TinyLlama(config)
    weight_bytes = sum(p.numel() * compute_dtype.itemsize for p in model.parameters())
    data = batches(load_corpus(), batch, seq, seed)
    ids, labels = next(data)
    optimizer = AdamW(lr=lambda step: lr * min(1.0, step / 20), betas=(0.9, 0.95), weight_decay=0.1)
    if hbm_budget is None:
        # A fraction of the weights, so the run really streams; never less than the smallest plan.
        probe = Engine(model, 1e6, compute_dtype=compute_dtype, device=device)
        smallest = probe.prepare(input_ids=ids, labels=labels).minimum_budget_bytes
        probe.close()
        hbm_budget = max(weight_bytes * budget_fraction, smallest * 1.02) / GiB
    engine = Engine(model, hbm_budget, optimizer=optimizer, compute_dtype=compute_dtype, device=device)
    plan = engine.prepare(input_ids=ids, labels=labels)
    os.makedirs(run_dir, exist_ok=True)
    print(plan.summary(), flush=True)
    print(f"  weights        {fmt_bytes(weight_bytes)} in {str(compute_dtype).replace('torch.', '')}; "
          f"budget is {100 * plan.budget_bytes / weight_bytes:.0f}% of them", flush=True)
    plan.dump(os.path.join(run_dir, "plan"))
    print(f"  plan dump      {os.path.join(run_dir, 'plan')}/plan.txt, plan.json", flush=True)

    tty = sys.stdout.isatty()
    log, start, tokens = [], time.perf_counter(), 0
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        loss = engine.step(input_ids=ids, labels=labels)
        dt = time.perf_counter() - t0
        tokens += ids.numel()
        peak = engine.memory_stats()["device_peak_bytes"]
        record = engine.last_step
        log.append({"step": step, "loss": loss, "seconds": dt, "device_peak_bytes": peak,
                    "skipped": record.skipped, "grad_norm": record.grad_norm})
        line = (f"step {step:>5}/{steps} |{_bar(step, steps)}| loss {loss:.4f} | "
                f"{ids.numel() / dt:,.0f} tok/s | device peak {fmt_bytes(peak)} / {fmt_bytes(plan.budget_bytes)}"
                + (f" | skipped: {record.reason}" if record.skipped else ""))
        if tty:
            print("\r" + line, end="", flush=True)
        elif step % log_every == 0 or step in (1, steps) or record.skipped:
            print(line, flush=True)
        ids, labels = next(data)
    if tty:
        print()
    elapsed = time.perf_counter() - start
    result = {"steps": steps, "skipped_steps": engine.skipped_steps,
              "final_loss": log[-1]["loss"], "first_loss": log[0]["loss"],
              "tokens_per_s": tokens / elapsed, "predicted_device_peak_bytes": plan.predicted_peak_bytes,
              "measured_device_peak_bytes": max(r["device_peak_bytes"] for r in log),
              "budget_bytes": plan.budget_bytes, "config": asdict(config)}
    with open(os.path.join(run_dir, "train_log.json"), "w") as f:
        json.dump({"result": result, "steps": log}, f, indent=1)
    print(f"done: loss {result['first_loss']:.3f} -> {result['final_loss']:.3f}, "
          f"{result['tokens_per_s']:,.0f} tok/s, measured device peak {fmt_bytes(result['measured_device_peak_bytes'])} "
          f"(predicted {fmt_bytes(result['predicted_device_peak_bytes'])}); log in {run_dir}/train_log.json")
    from .view.files import write_run_views     # the last step: step.json (or `trace`) and memory.png
    write_run_views(engine, run_dir, trace)
    engine.close()
    return result
