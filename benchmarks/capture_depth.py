"""Capture time against depth: one template per distinct block, so only the top-level trace grows.

    python benchmarks/capture_depth.py [--layers 8,16,32,64] [--repeats 3]

For a Hugging Face Llama (width 64, every layer alike: one block template) and a stack whose
every fourth layer turns rotary off (two templates), captures at each depth and records the
median capture seconds (CPU time of this process), the block templates traced and, for the
Llama, the capture time with the per-block fingerprint replaced by the plain forward it wraps
(what the fingerprint costs per block). Prints a table; writes benchmarks/results/capture_depth.csv
(long format).
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from contextlib import contextmanager

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import megacompile.capture.top as top  # noqa: E402
from megacompile.capture import capture  # noqa: E402
from provenance import machine_facts  # noqa: E402
from tests import models  # noqa: E402
from tests.e2e.test_heterogeneous_blocks import Block, Stack  # noqa: E402


@contextmanager
def without_fingerprint():
    """The top-level trace as it runs each block without recording what it computes."""
    real = top.record

    def plain(block, run, tensors, train):
        with torch.no_grad():
            return run(tensors), ()
    top.record = plain
    try:
        yield
    finally:
        top.record = real


def measure(build, layers: int, repeats: int) -> tuple[float, int]:
    ids = models.batch(96, 2, 16)
    seconds, templates = [], 0
    for _ in range(repeats):
        torch.manual_seed(0)
        model = build(layers)
        start = time.process_time()
        captured = capture(model, (), {"input_ids": ids, "labels": ids}, device=torch.device("cpu"),
                           compute_dtype=torch.float32)
        seconds.append(time.process_time() - start)
        templates = len(captured.block_templates)
    return statistics.median(seconds), templates


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", default="8,16,32,64")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    builders = {"llama": lambda n: models.hf_llama(layers=n, d=64),
                "rope_off_every_4th": lambda n: Stack([Block(rope=i % 4 != 3) for i in range(n)])}
    measure(builders["llama"], 2, 1)     # warm up: imports and the fake-tensor caches
    rows = []
    for name, build in builders.items():
        for layers in [int(x) for x in args.layers.split(",")]:
            seconds, templates = measure(build, layers, args.repeats)
            row = {"model": name, "layers": layers, "capture_s": seconds, "block_templates": templates}
            if name == "llama":
                with without_fingerprint():
                    row["capture_s_without_fingerprint"] = measure(build, layers, args.repeats)[0]
            rows.append({**row, **machine_facts()})
    print("| model | layers | block templates | capture s (CPU) | without fingerprint s | fingerprint ms/block |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        plain = r.get("capture_s_without_fingerprint")
        extra = f"{(r['capture_s'] - plain) / r['layers'] * 1e3:.1f}" if plain is not None else ""
        print(f"| {r['model']} | {r['layers']} | {r['block_templates']} | {r['capture_s']:.2f} | "
              f"{'' if plain is None else f'{plain:.2f}'} | {extra} |")
    out = os.path.join(os.path.dirname(__file__), "results", "capture_depth.csv")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    fields = sorted({k for r in rows for k in r})
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
