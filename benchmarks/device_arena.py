"""The device arena, measured: for each model of tests/e2e/test_device_arena.py at twice its weights
and at its smallest budget, the arena's size, the measured device peak, the packing, the device
allocations made outside the arena and the op results still copied into it, in the second step
(cpu backend: the simulated device holds exactly what it allocates).

    python benchmarks/device_arena.py [--out benchmarks/results/device_arena.csv]

Prints a table and writes a long-format CSV.
"""
from __future__ import annotations

import argparse
import os
import sys

import provenance

sys.path.insert(0, str(provenance.ROOT))       # the tests package: the cases of tests/e2e/test_device_arena.py

GiB, MiB = 2 ** 30, 2 ** 20
METRICS = ("device_arena_bytes", "device_peak_bytes", "fragmentation", "device_allocations_last_step",
           "device_copies_into_arena_last_step")


def measure(family: str, twice_the_weights: bool) -> dict:
    import megacompile
    from megacompile.acceptance.parity import clone, weight_bytes
    from tests.e2e.test_device_arena import CASES

    model, inputs = CASES[family]()
    if twice_the_weights:
        budget = 2 * weight_bytes(model) / GiB
    else:
        probe = megacompile.compile(clone(model), 64.0, device="cpu")
        budget = probe.prepare(**inputs[0]).minimum_budget_bytes / GiB
        probe.close()
    engine = megacompile.compile(model, budget, device="cpu")
    for x in inputs[:2]:
        engine.step(**x)
    stats = engine.memory_stats()
    engine.close()
    return {"budget_bytes": int(budget * GiB), **{m: stats[m] for m in METRICS}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(str(provenance.ROOT), "benchmarks", "results", "device_arena.csv"))
    args = parser.parse_args()
    from tests.e2e.test_device_arena import CASES
    facts, rows = provenance.machine_facts(), []
    print("| model | budget | arena MiB | measured peak MiB | packing KiB | outside allocations | ops copied in / step |")
    print("|---|---|---|---|---|---|---|")
    for family in sorted(CASES):
        for twice in (True, False):
            r = measure(family, twice)
            budget = "2x weights" if twice else "smallest"
            print(f"| {family} | {budget} | {r['device_arena_bytes'] / MiB:.3f} | {r['device_peak_bytes'] / MiB:.3f} | "
                  f"{r['fragmentation'] / 1024:.1f} | {r['device_allocations_last_step']} | "
                  f"{r['device_copies_into_arena_last_step']} |")
            rows += [{**facts, "benchmark": "device_arena", "model": family, "budget": budget, "metric": m, "value": v}
                     for m, v in r.items()]
    provenance.write_rows(args.out, rows)


if __name__ == "__main__":
    main()
