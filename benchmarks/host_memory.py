"""Host RAM as planned, measured: for each way a model comes in, the process's resident set growth
from before the model exists to after two steps (less the cpu backend's device arena, the simulated
device's memory), beside the plan's host figure, in B/param.

    python benchmarks/host_memory.py [--size medium] [--out benchmarks/results/host_memory.csv]

Each path runs in a fresh process (tests/e2e/host_rss_child.py: a 134M Llama at --size medium, a
58M one at small; bf16 compute, cpu backend). Prints a table and writes a long-format CSV.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import provenance

PATHS = ("compile", "compile_bf16", "from_pretrained", "disk", "accum", "moe", "reference")
CHILD = os.path.join(provenance.ROOT, "tests", "e2e", "host_rss_child.py")


def measure(path: str, size: str) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out = subprocess.run([sys.executable, CHILD, path, size, folder], capture_output=True, text=True,
                             cwd=provenance.ROOT, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="medium", choices=("small", "medium"))
    parser.add_argument("--out", default=os.path.join(provenance.ROOT, "benchmarks", "results", "host_memory.csv"))
    args = parser.parse_args()
    facts = provenance.machine_facts()
    rows = []
    print(f"{'path':16} {'params':>11} {'measured B/param':>17} {'plan B/param':>13} {'off by':>7}  placement")
    for path in PATHS:
        r = measure(path, args.size)
        n = r["params"]
        measured, planned = r["growth_bytes"] / n, r["predicted_host_bytes"] / n
        print(f"{path:16} {n:>11,} {measured:>17.2f} {planned:>13.2f} {measured / planned - 1:>+7.1%}  {r['placement']}")
        for metric, value in (("resident_growth_bytes_per_param", measured), ("planned_host_bytes_per_param", planned)):
            rows.append({**facts, "benchmark": "host_memory", "path": path, "size": args.size, "params": n,
                         "metric": metric, "value": value})
    provenance.write_rows(args.out, rows)


if __name__ == "__main__":
    main()
