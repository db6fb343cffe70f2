"""Host RAM per rank and per node under data parallelism, measured: the node's shared compute
copy, each rank's share of the fp32 masters and AdamW moments, and its gradient buffer.

    python benchmarks/dp_host_memory.py

Ranks are spawned on this machine (gloo, cpu backend) for a 2-layer nanoGPT (dim 64, 107k
parameters), in fp32 and bf16 compute, on 1, 2 and 4 ranks (1 node; 4 ranks also as 2 nodes of
2). The host state is built (prepare), not trained. One process is the one-process engine.
Writes benchmarks/results/dp_host_memory.csv (long format).
"""
from __future__ import annotations

import csv
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.distributed import ranks  # noqa: E402


def one_process(dtype: str) -> dict:
    engine = ranks.compiled(None, compute_dtype=getattr(torch, dtype))
    engine.prepare(**ranks._inputs(ranks.batches(1)[0], 0, 1))
    host = engine.host
    state = sum(getattr(b, k).nbytes for b in host.owners.values() for k in ("master", "exp_avg", "exp_avg_sq"))
    copy = sum(b.compute.nbytes for b in host.owners.values() if b.compute is not b.master)
    return {"copy": copy, "state": state, "grads": host.nbytes - state - copy, "rank": host.nbytes,
            "node": host.nbytes}


def spawned(dtype: str, size: int, nodes: int) -> dict:
    folder = tempfile.mkdtemp()
    ranks.spawn("measure", size, folder, dtype=dtype, nodes=nodes)
    results = [json.load(open(os.path.join(folder, f"rank{r}.json"))) for r in range(size)]
    node = [r for r in results if r["local"] == results[0]["local"]]
    return {"copy": node[0]["shared_bytes"], "state": max(r["state_bytes"] for r in results),
            "grads": max(r["grad_bytes"] for r in results), "rank": max(r["nbytes"] for r in results),
            "node": sum(r["nbytes"] for r in node)}


def main() -> None:
    params = sum(p.numel() for p in ranks.model().parameters())
    rows = []
    print(f"nanoGPT, {params:,} parameters; bytes per parameter (B/param)")
    print("dtype    ranks x nodes  node copy  masters+moments (largest rank)  grads (largest)  per rank  per node")
    for dtype in ("float32", "bfloat16"):
        for size, nodes in ((1, 1), (2, 1), (4, 1), (4, 2)):
            f = one_process(dtype) if size == 1 else spawned(dtype, size, nodes)
            print(f"{dtype:8s} {size} x {nodes:<11d} {f['copy'] / params:9.2f}  {f['state'] / params:30.2f}  "
                  f"{f['grads'] / params:15.2f}  {f['rank'] / params:8.2f}  {f['node'] / params:8.2f}")
            rows += [{"dtype": dtype, "ranks": size, "nodes": nodes, "params": params, "figure": k, "bytes": v}
                     for k, v in f.items()]
    out = os.path.join(os.path.dirname(__file__), "results", "dp_host_memory.csv")
    with open(out, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
