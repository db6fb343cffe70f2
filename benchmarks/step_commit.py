"""What it costs that no update starts before its step is known sound.

    python benchmarks/step_commit.py [--predict] [--measure] [--steps 12]

By default host AdamW updates start when a step commits (after its whole backward, loss and
gradients finite) and overlap the next step's forward; with updates="as_gradients_land" each
owner's update starts as soon as its gradients have landed and overlaps the rest of the backward,
and a step that fails after its first update cannot be undone. This compares the two placements:

--predict  the cost model's step time for both placements of the same plan, for Llama shapes
           from 8B to 140B on the published GPU profiles (planned on meta, no weights).
--measure  step time on the cpu backend, both placements in one process, interleaved, for a
           nanoGPT whose host AdamW is a small or a large share of the step, one engine for each.

The other placement is compile(..., updates="as_gradients_land"): each OPTIMIZER_STEP right after
the WAIT on the last gradient its owner needs, started there (Plan.step_s_updates_as_gradients_land
times a plan's schedule that way). Writes benchmarks/results/step_commit.csv (long format).
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import megacompile  # noqa: E402
from provenance import machine_facts, write_rows  # noqa: E402
from tests import models  # noqa: E402

LLAMAS = {  # hidden, layers, intermediate, heads, kv heads
    "8B": (4096, 32, 14336, 32, 8), "70B": (8192, 80, 28672, 64, 8), "140B": (12288, 80, 32768, 96, 8)}


def predicted(args) -> list[dict]:
    rows = []
    print(f"{'model':>6} {'hardware':>10} {'tokens':>7} {'landing ms':>11} {'commit ms':>10} {'cost':>7} "
          f"{'host AdamW ms':>14} {'compute ms':>11}")
    for name in args.models.split(","):
        d, layers, inter, heads, kv = LLAMAS[name]
        config = {"model_type": "llama", "vocab_size": 128256, "hidden_size": d, "intermediate_size": inter,
                  "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
                  "max_position_embeddings": 8192}
        for hardware in args.hardware.split(","):
            for batch in (1, 8):
                plan = megacompile.plan(config, hbm_budget=70, hardware=hardware, batch=batch, seq=2048)
                ours, theirs = plan.prediction, plan.step_s_updates_as_gradients_land
                cost = ours.step_s / theirs - 1
                print(f"{name:>6} {hardware:>10} {ours.tokens:>7} {theirs * 1e3:>11.0f} "
                      f"{ours.step_s * 1e3:>10.0f} {cost:>+7.1%} {ours.host_s * 1e3:>14.0f} "
                      f"{ours.compute_s * 1e3:>11.0f}", flush=True)
                base = {"part": "predicted", "model": f"llama-{name}", "hardware": hardware, "tokens": ours.tokens,
                        **machine_facts()}
                for metric, value in (("step_s_updates_at_commit", ours.step_s),
                                      ("step_s_updates_as_gradients_land", theirs),
                                      ("host_adamw_s", ours.host_s), ("compute_s", ours.compute_s)):
                    rows.append({**base, "metric": metric, "value": value})
    return rows


def measured(args) -> list[dict]:
    torch.set_num_threads(1)   # one compute thread beside the copy and host threads (DESIGN.md)
    rows = []
    print(f"{'model':>14} {'tokens':>7} {'landing ms':>11} {'commit ms':>10} {'cost':>7}   (median of {args.steps})")
    for d, layers, b, t in ((384, 8, 1, 8), (384, 8, 4, 64), (256, 6, 8, 128)):
        torch.manual_seed(0)
        model = models.NanoGPT(vocab=96, d=d, layers=layers, heads=4, block=max(t, 32))
        ids = models.batch(96, b, t)
        engines = {which: megacompile.compile(copy.deepcopy(model), hbm_budget=64, device="cpu", updates=updates)
                   for which, updates in (("commit", "at_commit"), ("landing", "as_gradients_land"))}
        times = {"commit": [], "landing": []}
        for i in range(2 * args.steps + 2):
            which = "commit" if i % 2 else "landing"
            engine = engines[which]
            engine.synchronize()
            start = time.perf_counter()
            for _ in range(3):        # three steps back to back: updates overlap the next forward
                engine.step(idx=ids, targets=ids)
            engine.synchronize()
            if i >= 2:
                times[which].append((time.perf_counter() - start) / 3)
        commit, landing = statistics.median(times["commit"]), statistics.median(times["landing"])
        label = f"nanogpt d{d} L{layers}"
        print(f"{label:>14} {b * t:>7} {landing * 1e3:>11.1f} {commit * 1e3:>10.1f} {commit / landing - 1:>+7.1%}",
              flush=True)
        base = {"part": "measured", "model": label, "hardware": "cpu backend", "tokens": b * t, **machine_facts()}
        for metric, value in (("step_s_updates_at_commit", commit), ("step_s_updates_as_gradients_land", landing)):
            rows.append({**base, "metric": metric, "value": value})
        for engine in engines.values():
            engine.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--predict", action="store_true")
    ap.add_argument("--measure", action="store_true")
    ap.add_argument("--models", default="8B,70B,140B")
    ap.add_argument("--hardware", default="h100,gh200")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--csv", default=os.path.join(os.path.dirname(__file__), "results", "step_commit.csv"))
    args = ap.parse_args()
    if not (args.predict or args.measure):
        args.predict = args.measure = True
    rows = (predicted(args) if args.predict else []) + (measured(args) if args.measure else [])
    write_rows(args.csv, rows)


if __name__ == "__main__":
    main()
