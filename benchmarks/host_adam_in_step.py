"""Host AdamW inside a training step against the same kernel called on its own, in one run.

Trains a small Llama on the cpu backend with global-norm clipping (every update then runs after
the whole backward, so the compute thread is idle while the host stream updates) and reads, from
the step's timeline, how long each owner's update took on the host stream; between steps it
times `adamw_update_` on buffers of the same sizes (one set per owner, as the engine has), called
directly on this thread with torch's thread count. Both paths read an fp32 accumulated gradient
and write no compute copy (fp32 compute), as the engine does on this backend. In-engine should
reach the standalone rate: a stream thread that ran the kernel on fewer cores would show here.

Each OpenMP wait policy runs in its own process, in turns (`--rounds`). On the cpu backend the
compute thread's ops run on an OpenMP team whose workers, under libgomp's default policy, spin
for up to 300,000 pauses (~15 ms here) after every parallel op, and so take cores from the first
updates after the backward. On a GPU the compute thread runs no OpenMP team, so the PASSIVE row
(workers sleep at once) is the one that stands for the engine there; the default row shows what
the simulation costs.

    python benchmarks/host_adam_in_step.py [--dim 512] [--layers 4] [--steps 6] [--rounds 2]

Prints a table, writes benchmarks/results/host_adam_in_step.csv (long format) and, as the last
line, one JSON object.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
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
    for owner, numel in enumerate(sizes):
        # One set of buffers per owner, kept across steps, as the engine keeps its owners' buffers: no
        # page faults timed, and no owner finds the previous one's buffers still in the last-level cache.
        if owner not in _BUFFERS:
            _BUFFERS[owner] = tuple(torch.randn(numel).abs_() * 1e-3 for _ in range(4))
        master, grad, m, v = _BUFFERS[owner]
        start = time.perf_counter()
        fused_adamw.adamw_update_(master, grad, m, v, step=step, **HYPER)
        seconds.append(time.perf_counter() - start)
    return seconds


def measure(dim: int, layers: int, steps: int) -> dict:
    """One process's figures: the median rate of each path over steps 2.. and the kernel's threads."""
    torch.manual_seed(0)
    model = TinyLlama(LlamaConfig(vocab=256, dim=dim, layers=layers, heads=8, kv_heads=4, ffn=int(2.75 * dim)))
    engine = megacompile.compile(model, hbm_budget=64.0, device="cpu",
                                 optimizer=megacompile.AdamW(lr=HYPER["lr"], weight_decay=HYPER["weight_decay"],
                                                             max_grad_norm=1e9))
    ids = torch.randint(0, 256, (2, 64))
    rates = {"in_engine": [], "standalone": []}
    threads_used = None
    try:
        for step in range(1, steps + 1):
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
    return {"in_engine": statistics.median(rates["in_engine"]), "standalone": statistics.median(rates["standalone"]),
            "kernel_threads": threads_used, "torch_threads": torch.get_num_threads()}


POLICIES = {"default": None, "PASSIVE": "PASSIVE"}     # libgomp reads OMP_WAIT_POLICY once, at load


def run_child(policy: str | None, args) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    out = subprocess.run([sys.executable, __file__, "--child", "--dim", str(args.dim), "--layers", str(args.layers),
                          "--steps", str(args.steps)], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2, help="processes per policy, taken in turns")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--csv", type=Path, default=ROOT / "benchmarks" / "results" / "host_adam_in_step.csv")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.dim, args.layers, args.steps)))
        return
    facts = {**provenance.machine_facts(), "host_adam_backend": fused_adamw.backend()}
    runs = {name: [] for name in POLICIES}
    for _ in range(args.rounds):
        for name, policy in POLICIES.items():
            runs[name].append(run_child(policy, args))
    rows = []
    for name, results in runs.items():
        engine_rate = statistics.median(r["in_engine"] for r in results)
        alone_rate = statistics.median(r["standalone"] for r in results)
        rows.append({"omp_wait_policy": name, "in_engine_params_per_s": engine_rate,
                     "standalone_params_per_s": alone_rate, "ratio": engine_rate / alone_rate,
                     "ratio_min": min(r["in_engine"] / r["standalone"] for r in results),
                     "ratio_max": max(r["in_engine"] / r["standalone"] for r in results),
                     "kernel_threads": results[-1]["kernel_threads"]})
    print(f"host AdamW in a training step vs standalone: TinyLlama dim {args.dim} x {args.layers} layers, "
          f"{args.rounds} processes per policy, torch threads {runs['default'][-1]['torch_threads']}, "
          f"kernel threads in the step {rows[0]['kernel_threads']}, {facts['cpu_model']}, "
          f"load average {facts['load_average_1min']}")
    print(f"{'OMP_WAIT_POLICY':<16}{'in-engine G/s':>14}{'standalone G/s':>16}{'ratio':>7}{'min':>6}{'max':>6}")
    for r in rows:
        print(f"{r['omp_wait_policy']:<16}{r['in_engine_params_per_s'] / 1e9:>14.3f}"
              f"{r['standalone_params_per_s'] / 1e9:>16.3f}{r['ratio']:>7.0%}{r['ratio_min']:>6.0%}{r['ratio_max']:>6.0%}")
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    with args.csv.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["omp_wait_policy", "metric", "value", "dim", "layers", "rounds", *facts])
        writer.writeheader()
        for r in rows:
            for metric in ("in_engine_params_per_s", "standalone_params_per_s", "ratio", "ratio_min", "ratio_max",
                           "kernel_threads"):
                writer.writerow({"omp_wait_policy": r["omp_wait_policy"], "metric": metric, "value": r[metric],
                                 "dim": args.dim, "layers": args.layers, "rounds": args.rounds, **facts})
    print(f"wrote {args.csv}")
    print(json.dumps({r["omp_wait_policy"]: {"ratio": r["ratio"], "in_engine_params_per_s": r["in_engine_params_per_s"],
                                             "standalone_params_per_s": r["standalone_params_per_s"]} for r in rows}))


if __name__ == "__main__":
    main()
