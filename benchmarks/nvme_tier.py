"""The disk tier: owner-state read + host AdamW + write, against the disk's raw O_DIRECT bandwidth
measured in the same run, on the same folder.

For each placement (moments on disk: 8 B/param each way; masters too: 12 B/param) and I/O thread
count, `steps` optimizer steps stream every owner's state through megacompile.disk.DiskTier
and the host AdamW (bf16 gradient in RAM, bf16 copy written), as the engine does. Reported:
params/s, disk GB/s (bytes read + written per second), and the share of the raw bound, which is
the time the same bytes take to read and to write sequentially with O_DIRECT (measured first,
with the same thread count). Prints a table and writes a long CSV (benchmarks/results/nvme_tier.csv).

    python benchmarks/nvme_tier.py --dir /path/on/nvme --params 200000000
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import provenance

ROOT = Path(__file__).resolve().parents[1]
try:
    import megacompile  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT))
from megacompile.cost.host_memory import DEPTH, PIECE_NUMEL, Placement
from megacompile.optim.fused_adamw import adamw_update_
from megacompile.disk import DiskTier
from megacompile.disk.bandwidth import measure_disk

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def tier_steps(folder: str, owners: dict[int, int], placement: Placement, steps: int, threads: int,
               piece: int, depth: int) -> tuple[list[float], int]:
    """Seconds of each optimizer step over every owner, and the disk bytes one step moves."""
    tier = DiskTier(folder, owners, placement.kinds, piece_numel=piece, depth=depth, threads=threads, verify=False)
    gen = torch.Generator().manual_seed(0)
    ram = {o: {"grad": torch.randn(n, generator=gen).to(torch.bfloat16),
               "copy": torch.empty(n, dtype=torch.bfloat16),
               "master": None if placement.masters_on_disk else torch.randn(n, generator=gen)}
           for o, n in owners.items()}
    times = []
    try:
        for step in range(1, steps + 1):
            start = time.perf_counter()
            tier.schedule(list(owners))
            for o in owners:
                for a, b in tier.pieces_of(o):
                    p = tier.next_piece(o)
                    master = p.views["master"] if placement.masters_on_disk else ram[o]["master"][a:b]
                    adamw_update_(master, ram[o]["grad"][a:b], p.views["exp_avg"], p.views["exp_avg_sq"],
                                  step=step, out=ram[o]["copy"][a:b], **HYPER)
                    tier.write_behind(p)
            tier.flush()
            times.append(time.perf_counter() - start)
    finally:
        tier.close()
    return times, 4 * len(placement.kinds) * sum(owners.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="folder on the disk to measure (default: a temp dir under /tmp)")
    ap.add_argument("--params", type=int, default=100_000_000, help="trainable parameters in all")
    ap.add_argument("--owners", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--piece", type=int, default=PIECE_NUMEL)
    ap.add_argument("--depth", type=int, default=DEPTH)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "nvme_tier.csv"))
    args = ap.parse_args()
    folder = args.dir or tempfile.mkdtemp(prefix="megacompile-nvme-bench-")
    per = args.params // args.owners // 1024 * 1024
    owners = {o: per for o in range(args.owners)}
    facts = provenance.machine_facts()
    rows, table = [], []
    for threads in args.threads:
        placements = (Placement(moments_on_disk=True), Placement(moments_on_disk=True, masters_on_disk=True))
        biggest = 4 * 3 * sum(owners.values())
        raw = measure_disk(folder, nbytes=biggest, threads=threads)
        base = {**facts, "folder": folder, "direct": raw["direct"], "threads": threads, "params": sum(owners.values()),
                "owners": args.owners, "piece": args.piece, "depth": args.depth}
        rows.append({**base, "what": "raw", "placement": "", "step": "", "metric": "read_GBps", "value": raw["read_bw"] / 1e9})
        rows.append({**base, "what": "raw", "placement": "", "step": "", "metric": "write_GBps", "value": raw["write_bw"] / 1e9})
        for placement in placements:
            times, moved = tier_steps(folder, owners, placement, args.steps, threads, args.piece, args.depth)
            raw_s = moved / raw["read_bw"] + moved / raw["write_bw"]
            for i, t in enumerate(times):
                point = {**base, "what": "tier", "placement": placement.describe(), "step": i + 1}
                rows += [{**point, "metric": "step_s", "value": t},
                         {**point, "metric": "params_per_s", "value": sum(owners.values()) / t},
                         {**point, "metric": "disk_GBps", "value": 2 * moved / t / 1e9},
                         {**point, "metric": "share_of_raw", "value": raw_s / t}]
            best = min(times[1:] or times)
            table.append((threads, placement.describe(), raw["read_bw"] / 1e9, raw["write_bw"] / 1e9,
                          sum(owners.values()) / best / 1e6, 2 * moved / best / 1e9, raw_s / best,
                          statistics.median(raw_s / t for t in times)))
    print(f"disk tier on {folder} (O_DIRECT: {raw['direct']}), {sum(owners.values()):,} params in "
          f"{args.owners} owners, pieces of {args.piece:,}, {args.depth} in flight")
    print(f"{'threads':>7} {'placement':<46} {'raw rd GB/s':>11} {'raw wr GB/s':>11} {'M params/s':>10} "
          f"{'disk GB/s':>9} {'of raw (best)':>13} {'(median)':>8}")
    for t, p, r, w, pps, gbps, share, med in table:
        print(f"{t:>7} {p:<46} {r:>11.2f} {w:>11.2f} {pps:>10.1f} {gbps:>9.2f} {share:>12.0%} {med:>8.0%}")
    provenance.write_rows(args.out, rows)
    print(json.dumps({"rows": len(rows), "best_share_of_raw": max(r[6] for r in table)}))


if __name__ == "__main__":
    main()
