"""Device and host bytes over the schedule, by kind: what the memory picture stacks.

The device side follows the simulator's rule (ir/ledger.py): a storage counts once, under the
kind of the value that first held it, until its last holder lets go; the transient band of a node
is what its stage graph needs above what stays live after it (peak during minus live after), so
the stack's top is the simulator's `peak_during` curve. The host side is the host state per
buffer (RAM or the disk tier, constant over the step) plus the offloaded activations waiting in
host memory, which rise at each OFFLOAD and fall at the PREFETCH that brings them back.
"""
from __future__ import annotations

from ..ir.ledger import StorageLedger
from ..ir.program import Op, Program, restored_of
from ..ir.simulate import simulate

DEVICE_KINDS = ("weights", "saved activations", "block boundaries", "gradients", "transient")
# Value kinds (ir/program.py) as the picture groups them.
GROUP = {"weights": "weights", "saved": "saved activations", "activation": "block boundaries",
         "input": "block boundaries", "output": "block boundaries", "grads": "gradients"}


def device_by_kind(program: Program) -> dict[str, list[int]]:
    """Per kind, device bytes after each node (transient: during it); the kinds add up to the
    simulator's peak_during."""
    ledger = StorageLedger()
    kind_of: dict = {}
    live = dict.fromkeys(DEVICE_KINDS, 0)
    curves: dict[str, list[int]] = {k: [] for k in DEVICE_KINDS}
    curve = simulate(program)
    for i, n in enumerate(program.nodes):
        if n.op is Op.FREE:
            for v in n.frees:
                for key, _ in program.values[v].parts:
                    live[kind_of.get(key, "block boundaries")] -= ledger.drop(v, key)
        else:
            for v in n.writes:
                group = GROUP.get(program.values[v].kind, "block boundaries")
                for key, nbytes in program.values[v].parts:
                    if ledger.hold(v, key, nbytes):
                        kind_of[key] = group
                        live[group] += nbytes
        live["transient"] = curve.peak_during[i] - curve.live_after[i]
        for k in DEVICE_KINDS:
            curves[k].append(live[k])
    return curves


def host_by_kind(plan) -> tuple[dict[str, list[int]], dict[str, int]]:
    """(RAM per kind after each node, disk-tier bytes per kind). The host state is constant over
    the step; offloaded activations vary."""
    program = plan.program
    n = len(program.nodes)
    ram: dict[str, list[int]] = {}
    disk: dict[str, int] = {}
    cost = plan.host_cost
    if cost is not None:
        for kind, (where, nbytes) in cost.tiers.items():
            if where == "disk":
                disk[kind] = nbytes
            else:
                ram[kind] = [nbytes] * n
        rest = cost.ram_bytes - sum(b for w, b in cost.tiers.values() if w == "ram")
        if rest > 0:
            ram[("disk tier pool, " if cost.pool_bytes else "") + "frozen weights, buffers"] = [rest] * n
    else:
        ram["host state"] = [plan.host_bytes] * n
    stash, waiting = [], 0
    sizes: dict[str, int] = {}
    for node in program.nodes:
        if node.op is Op.OFFLOAD and program.values[node.reads[0]].kind in ("saved", "activation"):
            v = node.reads[0]
            sizes[restored_of(v)] = program.values[v].nbytes
            waiting += sizes[restored_of(v)]
        elif node.op is Op.PREFETCH and node.writes[0] in sizes:
            waiting -= sizes.pop(node.writes[0])
        stash.append(waiting)
    if any(stash):
        ram["offloaded activations"] = stash
    return ram, disk
