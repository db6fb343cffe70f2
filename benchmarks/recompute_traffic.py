"""Memory traffic of a block's recomputed region, by the cost model, without fusion, with the
recompute path left to the generated elementwise kernels, and fused.

    python benchmarks/recompute_traffic.py [--config configs/qwen2.5-14b.json] [--batch 16] [--seq 4096]
                                           [--hardware h100]

The recomputed region of a selective variant's backward is what it redoes of the forward: its
nodes that read no tangent (megacompile.cost.recomputed_region), bytes counted per node as the
roofline counts them (read + written, views free). Beside it: the whole backward of the block
that saves everything, and the seconds the selective variant adds to the backward on the given
hardware (the plan's `selective_backward_s`). Planned on fake tensors: nothing is allocated.
Prints a table; writes benchmarks/results/recompute_traffic.csv (long format).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from megacompile.capture import capture  # noqa: E402
from megacompile.capture.top import blocks_grouped_once  # noqa: E402
from megacompile.cost import get_profile, graph_cost, recomputed_bytes  # noqa: E402
from megacompile.fusion import FORWARD_PATTERNS, REWRITES, fuse  # noqa: E402
from megacompile.planner.from_config import model_from_config  # noqa: E402
from provenance import machine_facts, write_rows  # noqa: E402

GB = 1e9


def main() -> None:
    here = os.path.dirname(__file__)
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=os.path.join(here, "configs", "qwen2.5-14b.json"))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--hardware", default="h100")
    args = parser.parse_args()
    dtype = torch.bfloat16
    model = model_from_config(args.config)
    ids = torch.empty(args.batch, args.seq, dtype=torch.long, device="meta")
    with blocks_grouped_once():
        unfused = capture(model, (), {"input_ids": ids, "labels": ids}, device=torch.device("cpu"),
                          compute_dtype=dtype)
    ways = {
        "unfused": unfused,
        "recompute left to generated kernels": fuse(unfused, only={name for name, _ in REWRITES} - FORWARD_PATTERNS),
        "fused": fuse(unfused),
    }
    hw = get_profile(args.hardware)
    rows = []
    for way, captured in ways.items():
        full = next(t for t in captured.templates if t.kind == "block")
        variant = full.selective
        added = graph_cost(variant.backward, hw, dtype).seconds - graph_cost(full.backward, hw, dtype).seconds
        rows.append({"config": os.path.basename(args.config), "batch": args.batch, "seq": args.seq,
                     "hardware": args.hardware, "way": way,
                     "recomputed_region_bytes": recomputed_bytes(variant.backward, len(variant.tangent_outputs)),
                     "full_backward_bytes": graph_cost(full.backward, hw, dtype).bytes_moved,
                     "selective_backward_bytes": graph_cost(variant.backward, hw, dtype).bytes_moved,
                     "selective_backward_s": added, **machine_facts()})
    print(f"{os.path.basename(args.config)}, one block, {args.batch} x {args.seq}, bf16, {args.hardware}")
    print("| | recomputed region | selective backward | backward saving everything | selective adds |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['way']} | {r['recomputed_region_bytes'] / GB:.1f} GB | {r['selective_backward_bytes'] / GB:.1f} GB"
              f" | {r['full_backward_bytes'] / GB:.1f} GB | {r['selective_backward_s'] * 1e3:.1f} ms |")
    write_rows(os.path.join(here, "results", "recompute_traffic.csv"), rows)


if __name__ == "__main__":
    main()
