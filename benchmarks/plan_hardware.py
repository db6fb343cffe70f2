"""What fits, and how fast, on the cards people own: 7B, 14B, 32B and 70B full fine-tunes (fp32 masters,
AdamW, bf16 compute) on each datasheet profile with a typical host for that card, from `megacompile plan`.

Each card gets 90% of its memory (the plan's default), its profile's own host side (a desktop for the
GeForce cards, a workstation for the RTX 6000 Ada and RTX A6000, a server for the rest: megacompile/cost/host.py),
the host RAM of a typical machine with it, and one 2 TB NVMe drive as the disk tier where RAM does not
hold the state. One micro-batch of 4 x 2048 tokens.

    python benchmarks/plan_hardware.py [--cards rtx4090,l40s] [--models 7b,70b] [--jobs 2] [--markdown FILE]

Writes benchmarks/results/plan_hardware.csv (long format) and prints a markdown table. Each plan is one
`megacompile plan --json` process (about 30-60 s each on 2 busy cores; --jobs runs several at once).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from provenance import machine_facts, write_table

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = {"7b": "llama-2-7b.json", "14b": "qwen2.5-14b.json", "32b": "qwen2.5-32b.json", "70b": "llama-70b.json"}
# card: GiB of host RAM in a typical machine with it
HOSTS = {"rtx3090": 64, "rtx4090": 128, "rtx5090": 192, "rtx6000-ada": 256, "rtx-a6000": 256, "l4": 128, "a10": 128,
         "l40s": 512, "a100-40gb": 512, "h200": 1536, "b200": 2048}
NVME_GB = 2000
BATCH, SEQ = 4, 2048


def plan_one(card: str, model: str) -> dict:
    cmd = [sys.executable, "-m", "megacompile", "plan", "--config", os.path.join(HERE, "configs", CONFIGS[model]),
           "--hardware", card, "--host-budget", str(HOSTS[card]), "--nvme-budget", str(NVME_GB),
           "--batch", str(BATCH), "--seq", str(SEQ), "--json"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode not in (0, 3):
        raise RuntimeError(f"{' '.join(cmd)} failed (rc {proc.returncode}):\n{proc.stderr[-2000:]}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"card": card, "model": model, "host_gib": HOSTS[card], "nvme_gb": NVME_GB, "batch": BATCH, "seq": SEQ,
            "plan_seconds": seconds, **{k: v for k, v in summary.items() if not isinstance(v, (dict, list))},
            **machine_facts()}


def verdict(r: dict) -> str:
    if r["fits"]:
        return "fits" + (" (disk tier)" if r.get("disk_bytes") else "")
    if "error" in r:        # the host budget: the refusal names the smallest one that fits
        smallest = r["error"].split("The smallest host budget that fits is ")[-1].split(" ")[0]
        return f"no: host RAM, needs {smallest} GiB" if "smallest host budget" in r["error"] else "no: host RAM"
    return f"no: needs {r['minimum_budget_bytes'] / 2**30:.1f} GiB of device memory"


def markdown(rows: list[dict]) -> str:
    lines = ["| card | host RAM GiB | model | verdict | tokens/s | TFLOPS (6ND) | step s | device peak GiB (budget) | "
             "host RAM used GiB | on disk GiB |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if not r["fits"]:
            lines.append(f"| {r['card']} | {r['host_gib']} | {r['model']} | {verdict(r)} | - | - | - | - | - | - |")
            continue
        lines.append(f"| {r['card']} | {r['host_gib']} | {r['model']} | {verdict(r)} | "
                     f"{r['predicted_tokens_per_s']:,.0f} | {r['predicted_tflops_6nd']:.0f} | {r['predicted_step_s']:.2f} | "
                     f"{r['device_peak_bytes'] / 2**30:.1f} ({r['budget_bytes'] / 2**30:.1f}) | "
                     f"{r['host_bytes'] / 2**30:.0f} | {r.get('disk_bytes', 0) / 2**30:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cards", default=",".join(HOSTS))
    ap.add_argument("--models", default=",".join(CONFIGS))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--csv", default=os.path.join(HERE, "results", "plan_hardware.csv"))
    ap.add_argument("--markdown", default=None, help="also write the table to this file")
    args = ap.parse_args()
    work = [(card, model) for card in args.cards.split(",") for model in args.models.split(",")]

    def run(item):
        row = plan_one(*item)
        print(f"planned {item[1]} on {item[0]} in {row['plan_seconds']:.0f} s: {verdict(row)}", flush=True)
        return row

    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(run, work))
    write_table(rows, args.csv, markdown(rows), args.markdown)


if __name__ == "__main__":
    main()
