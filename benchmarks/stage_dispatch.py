"""Python cost per op of running stage graphs: the interpreter against the generated code.

Records every stage graph one training step runs (a small Llama on the cpu backend, at tiny
shapes so the ops themselves cost little), then replays each graph with the runtime's memory
hooks, both ways, and with no hooks at all: a floor of what calling the ops costs.

    python benchmarks/stage_dispatch.py [--layers 4] [--repeat 50] [--csv benchmarks/results/stage_dispatch.csv]
"""
from __future__ import annotations

import argparse
import csv
import statistics
import time
from pathlib import Path

import torch

import megacompile
from megacompile.ir.stage_program import StageProgram
from megacompile.models.llama import LlamaConfig, TinyLlama
from megacompile.runtime.memory import DeviceMemory


def record_graphs(layers: int) -> list[tuple[StageProgram, list]]:
    torch.manual_seed(0)
    model = TinyLlama(LlamaConfig(vocab=64, dim=32, layers=layers, heads=4, kv_heads=2, ffn=64))
    engine = megacompile.compile(model, hbm_budget=1.0, device="cpu")
    ids = torch.randint(0, 64, (2, 8))
    engine.step(input_ids=ids, labels=ids)
    seen: list[tuple[StageProgram, list]] = []
    real = StageProgram.run

    def spy(self, inputs, on_alloc, on_free):
        seen.append((self, list(inputs)))
        return real(self, inputs, on_alloc, on_free)
    StageProgram.run = spy
    try:
        engine.step(input_ids=ids, labels=ids)
        engine.synchronize()
    finally:
        StageProgram.run = real
    engine.close()
    return seen


MODES = ("interpreted", "generated", "floor")


def per_op_us(graphs, repeat: int) -> dict[str, float]:
    """Median microseconds per op of each mode; the modes take turns, so a busy moment of the
    machine falls on all of them alike."""
    ops = sum(len(p.body) for p, _ in graphs)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(repeat):
        for mode in MODES:
            memory = DeviceMemory(2 ** 40)
            hold = (lambda n, v: memory.hold(n, v, "bench")) if mode != "floor" else (lambda n, v: None)
            drop = memory.drop if mode != "floor" else (lambda n, v: None)
            run = StageProgram.interpret if mode == "interpreted" else StageProgram.run
            start = time.perf_counter()
            for program, inputs in graphs:
                run(program, inputs, hold, drop)
            times[mode].append(time.perf_counter() - start)
    return {m: statistics.median(t) / ops * 1e6 for m, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeat", type=int, default=50)
    p.add_argument("--csv", type=Path, default=Path(__file__).parent / "results" / "stage_dispatch.csv")
    args = p.parse_args()
    torch.set_num_threads(1)     # tiny ops: intra-op threads would only add their wake-ups
    graphs = record_graphs(args.layers)
    ops = sum(len(prog.body) for prog, _ in graphs)
    rows = list(per_op_us(graphs, args.repeat).items())
    print(f"{len(graphs)} stage graphs, {ops} ops per step; microseconds of Python per op (median of {args.repeat})")
    print(f"{'mode':<12} {'us/op':>8} {'vs interpreted':>15}")
    for mode, us in rows:
        print(f"{mode:<12} {us:8.2f} {rows[0][1] / us:14.2f}x")
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    with args.csv.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["benchmark", "mode", "metric", "value", "ops", "torch"])
        for mode, us in rows:
            w.writerow(["stage_dispatch", mode, "us_per_op", f"{us:.3f}", ops, torch.__version__])
    print(f"wrote {args.csv}")


if __name__ == "__main__":
    main()
