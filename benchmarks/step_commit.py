"""What it costs that no update starts before its step is known sound.

    python benchmarks/step_commit.py [--predict] [--measure] [--steps 12]

Host AdamW updates start when a step commits (after its whole backward, loss and gradients
finite) and overlap the next step's forward; before, each owner's update started as soon as its
gradients landed and overlapped the rest of the backward, which left no way to skip a step with
a NaN gradient or to undo a step that failed midway. This compares the two placements:

--predict  the cost model's step time for both placements of the same plan, for Llama shapes
           from 8B to 140B on the published GPU profiles (planned on meta, no weights).
--measure  step time on the cpu backend, both placements in one process, interleaved, for a
           nanoGPT whose host AdamW is a small or a large share of the step.

The earlier placement is rebuilt here only as the counterfactual: each OPTIMIZER_STEP moved to
just after the WAIT on the last gradient its owner needs, and started at that node. Writes
benchmarks/results/step_commit.csv (long format).
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
from megacompile.capture.model_graph import owners  # noqa: E402
from megacompile.cost.predict import predict  # noqa: E402
from megacompile.ir.program import Op, grads  # noqa: E402
from megacompile.runtime import Executor  # noqa: E402
from provenance import machine_facts, write_rows  # noqa: E402
from tests import models  # noqa: E402

LLAMAS = {  # hidden, layers, intermediate, heads, kv heads
    "8B": (4096, 32, 14336, 32, 8), "70B": (8192, 80, 28672, 64, 8), "140B": (12288, 80, 32768, 96, 8)}


def as_gradients_land(program, captured):
    """The counterfactual schedule: each update right after its last gradient's WAIT."""
    contributors = owners(captured)[1]
    steps = {n.stage: n for n in program.nodes if n.op is Op.OPTIMIZER_STEP}
    nodes = [n for n in program.nodes if n.op is not Op.OPTIMIZER_STEP]
    waited = {n.stage: i for i, n in enumerate(nodes) if n.op is Op.WAIT and grads(n.stage) in n.reads}
    after: dict[int, list] = {}
    for s, node in sorted(steps.items()):
        after.setdefault(max(waited[c] for c in contributors[s]), []).append(node)
    out = []
    for i, n in enumerate(nodes):
        out.append(n)
        out += after.get(i, [])
    return program.copy(out)


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
                ours = plan.prediction
                theirs = predict(as_gradients_land(plan.program, plan.captured), plan.captured, plan.hardware)
                cost = ours.step_s / theirs.step_s - 1
                print(f"{name:>6} {hardware:>10} {ours.tokens:>7} {theirs.step_s * 1e3:>11.0f} "
                      f"{ours.step_s * 1e3:>10.0f} {cost:>+7.1%} {ours.host_s * 1e3:>14.0f} "
                      f"{ours.compute_s * 1e3:>11.0f}", flush=True)
                base = {"part": "predicted", "model": f"llama-{name}", "hardware": hardware, "tokens": ours.tokens,
                        **machine_facts()}
                for metric, value in (("step_s_updates_at_commit", ours.step_s),
                                      ("step_s_updates_as_gradients_land", theirs.step_s),
                                      ("host_adamw_s", ours.host_s), ("compute_s", ours.compute_s)):
                    rows.append({**base, "metric": metric, "value": value})
    return rows


class _AtNode(Executor):
    """Starts each update at its node (the counterfactual; unsafe: nothing can be undone)."""

    def _optimizer_step(self, node):
        super()._optimizer_step(node)
        self.commit()


def measured(args) -> list[dict]:
    torch.set_num_threads(1)   # one compute thread beside the copy and host threads (DESIGN.md)
    rows = []
    print(f"{'model':>14} {'tokens':>7} {'landing ms':>11} {'commit ms':>10} {'cost':>7}   (median of {args.steps})")
    for d, layers, b, t in ((384, 8, 1, 8), (384, 8, 4, 64), (256, 6, 8, 128)):
        torch.manual_seed(0)
        model = models.NanoGPT(vocab=96, d=d, layers=layers, heads=4, block=max(t, 32))
        ids = models.batch(96, b, t)
        engine = megacompile.compile(model, hbm_budget=64, device="cpu")
        engine.step(idx=ids, targets=ids)
        compiled = engine._last_train
        ours = compiled.executor
        theirs = _AtNode(compiled.captured, as_gradients_land(compiled.plan.program, compiled.captured),
                         engine.backend, engine.host, engine.state.update.adamw, engine.state.update.clip)
        times = {"commit": [], "landing": []}
        for i in range(2 * args.steps + 2):
            which = "commit" if i % 2 else "landing"
            compiled.executor = ours if which == "commit" else theirs
            engine.synchronize()
            start = time.perf_counter()
            for _ in range(3):        # three steps back to back: updates overlap the next forward
                engine.step(idx=ids, targets=ids)
            engine.synchronize()
            if i >= 2:
                times[which].append((time.perf_counter() - start) / 3)
        compiled.executor = ours
        commit, landing = statistics.median(times["commit"]), statistics.median(times["landing"])
        label = f"nanogpt d{d} L{layers}"
        print(f"{label:>14} {b * t:>7} {landing * 1e3:>11.1f} {commit * 1e3:>10.1f} {commit / landing - 1:>+7.1%}",
              flush=True)
        base = {"part": "measured", "model": label, "hardware": "cpu backend", "tokens": b * t, **machine_facts()}
        for metric, value in (("step_s_updates_at_commit", commit), ("step_s_updates_as_gradients_land", landing)):
            rows.append({**base, "metric": metric, "value": value})
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
