"""Host AdamW inside a training step against the same kernel called on its own, in one run.

Trains a small Llama on the cpu backend with global-norm clipping (every update then runs after
the whole backward, so the compute thread is idle while the host stream updates) and reads, from
the step's timeline, how long each owner's update took on the host stream; between steps it
times `adamw_update_` on buffers of the same sizes, called directly on this thread with torch's
thread count. Both paths read an fp32 accumulated gradient and write no compute copy (fp32
compute), as the engine does on this backend. In-engine should reach the standalone rate: a
stream thread that ran the kernel on fewer cores would show here.

On the cpu backend the compute thread's OpenMP workers spin for a few milliseconds after the
backward's last op (GOMP_SPINCOUNT) and take cores from the first updates; OMP_WAIT_POLICY=PASSIVE
removes that (on a GPU the compute thread runs no OpenMP team, so it does not arise there).

    python benchmarks/host_adam_in_step.py [--dim 512] [--layers 4] [--steps 6]

Prints a table, writes benchmarks/results/host_adam_in_step.csv (long format) and, as the last
line, one JSON object.
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
import time
from pathlib import Path

import torch

import provenance

import megacompile
from megacompile.models.llama import LlamaConfig, TinyLlama
from megacompile.optim import fused_adamw

ROOT = Path(__file__).resolve().parents[1]
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def in_engine(engine, ids) -> tuple[list[float], list[int]]:
    """(seconds, params) of every update of one step, from the host stream's spans."""
    engine.timeline.clear()
    engine.step(input_ids=ids, labels=ids)
    engine.synchronize()
    names = engine.plan.program.stage_names
    owners = {f"adamw {names[s]}": b.master.numel() for s, b in engine.host.owners.items()}
    spans = [s for s in engine.timeline.on("host") if s.what in owners]
    return [s.end - s.start for s in spans], [owners[s.what] for s in spans]


_BUFFERS: dict[int, tuple] = {}


def standalone(sizes: list[int], step: int) -> list[float]:
    seconds = []
    for numel in sizes:
        if numel not in _BUFFERS:     # kept, as the engine keeps its owners' buffers: no page faults timed
            _BUFFERS[numel] = tuple(torch.randn(numel).abs_() * 1e-3 for _ in range(4))
        master, grad, m, v = _BUFFERS[numel]
        start = time.perf_counter()
        fused_adamw.adamw_update_(master, grad, m, v, step=step, **HYPER)
        seconds.append(time.perf_counter() - start)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--csv", type=Path, default=ROOT / "benchmarks" / "results" / "host_adam_in_step.csv")
    args = parser.parse_args()
    facts = {**provenance.machine_facts(), "host_adam_backend": fused_adamw.backend()}
    torch.manual_seed(0)
    model = TinyLlama(LlamaConfig(vocab=256, dim=args.dim, layers=args.layers, heads=8, kv_heads=4,
                                  ffn=int(2.75 * args.dim)))
    engine = megacompile.compile(model, hbm_budget=64.0, device="cpu",
                                 optimizer=megacompile.AdamW(lr=HYPER["lr"], weight_decay=HYPER["weight_decay"],
                                                             max_grad_norm=1e9))
    ids = torch.randint(0, 256, (2, 64))
    rates = {"in_engine": [], "standalone": []}
    threads_used = None
    try:
        for step in range(1, args.steps + 1):
            seconds, sizes = in_engine(engine, ids)
            threads_used = fused_adamw.last_threads()
            alone = standalone(sizes, step)
            if step == 1:
                continue          # first step: page faults on fresh buffers
            big = [i for i, n in enumerate(sizes) if n >= 1 << 20]   # owners large enough to time
            rates["in_engine"].append(sum(sizes[i] for i in big) / sum(seconds[i] for i in big))
            rates["standalone"].append(sum(sizes[i] for i in big) / sum(alone[i] for i in big))
    finally:
        engine.close()
    rows = [{"path": path, "params_per_s_median": statistics.median(r), "params_per_s_min": min(r),
             "params_per_s_max": max(r)} for path, r in rates.items()]
    ratio = rows[0]["params_per_s_median"] / rows[1]["params_per_s_median"]
    print(f"host AdamW in a training step vs standalone: TinyLlama dim {args.dim} x {args.layers} layers, "
          f"torch threads {torch.get_num_threads()}, kernel threads in the step {threads_used}, "
          f"{facts['cpu_model']}, load average {facts['load_average_1min']}")
    print(f"{'path':<12}{'G params/s median':>18}{'min':>8}{'max':>8}")
    for r in rows:
        print(f"{r['path']:<12}{r['params_per_s_median'] / 1e9:>18.3f}{r['params_per_s_min'] / 1e9:>8.3f}"
              f"{r['params_per_s_max'] / 1e9:>8.3f}")
    print(f"in-engine / standalone: {ratio:.0%}")
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    with args.csv.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["path", "metric", "value", "dim", "layers", "kernel_threads", *facts])
        writer.writeheader()
        for r in rows:
            for metric in ("params_per_s_median", "params_per_s_min", "params_per_s_max"):
                writer.writerow({"path": r["path"], "metric": metric, "value": r[metric], "dim": args.dim,
                                 "layers": args.layers, "kernel_threads": threads_used, **facts})
    print(f"wrote {args.csv}")
    print(json.dumps({"in_engine_params_per_s": rows[0]["params_per_s_median"],
                      "standalone_params_per_s": rows[1]["params_per_s_median"], "ratio": ratio,
                      "kernel_threads": threads_used}))


if __name__ == "__main__":
    main()
