"""Host RAM per rank and per node when R ranks train data-parallel, L of them on each node
(distributed/shard.py and node.py allocate it so):

    per node, once:      the compute copy (bf16: 2 B/param, fp32: 4 B), in shared memory
    per rank:            its 1/R of the fp32 gradient sums (4 B/param / R; + the landing buffer
                         with grad_accum > 1), of the fp32 masters and of the AdamW moments
                         (12 B/param / R), frozen weights and buffers

The host budget under data parallelism is the node's (its RAM); each rank plans within 1/L of it,
and a rank's figure counts 1/L of the shared copy, so the ranks' figures add up to the node's.
Everything stays in RAM: the disk tier is not sharded (docs/distributed.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .host_memory import HostCost, Placement, owner_layout, owner_sizes


@dataclass(frozen=True)
class ShardedHostCost(HostCost):
    ranks: int = 1
    per_node: int = 1
    node_bytes: int = 0          # all the node's ranks together: one compute copy

    def describe(self) -> str:
        from ..ir.printer import fmt_bytes
        return (f"{self.ranks} ranks, {self.per_node} per node: {fmt_bytes(self.ram_bytes)} per rank, "
                f"{fmt_bytes(self.node_bytes)} per node (one {fmt_bytes(self.tiers['compute copies'][1])} compute "
                f"copy, {self.per_node}/{self.ranks} of the gradients, masters and moments)")


def sharded_host_cost(captured, compute_dtype: torch.dtype, grad_accum: int, ranks: int,
                      per_node: int, module: int = 0) -> ShardedHostCost:
    """`module`: bytes each rank's own module keeps (a rank's masters are a share, so a module built
    with weights keeps all of them: runtime/host.py lends nothing under data parallelism)."""
    # every trainable parameter, as each rank lays them out (distributed/shard.py), also those the
    # first program does not reach (a tower, when the first micro-batch holds no image)
    sizes, summed, frozen = owner_sizes(captured, every_trainable=True)
    params = sum(sizes.values())
    grads = 0
    for owner, numel in sizes.items():
        layout = owner_layout(compute_dtype, grad_accum, owner in summed, Placement())
        grads += numel * (4 + layout.landing_dtype.itemsize * layout.landing) // ranks
    copy = compute_dtype.itemsize * params
    state = 12 * params
    node = copy + per_node * (grads + frozen + module) + state * per_node // ranks
    tiers = {"fp32 masters": ("ram", 4 * params // ranks), "exp_avg+exp_avg_sq": ("ram", 8 * params // ranks),
             "compute copies": ("ram", copy), "grads": ("ram", grads)}
    if module:
        tiers["the model's own weights"] = ("ram", module)
    return ShardedHostCost(Placement(), params, -(-node // per_node), 0, 0, tiers, frozen, module,
                           ranks=ranks, per_node=per_node, node_bytes=node)
