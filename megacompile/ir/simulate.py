"""The memory simulator: device bytes live after every node of a schedule, and the peak.

It applies the runtime's rule (ir/ledger.py) to the values' storages: a compute node peaks at
what is live before it plus its graph's transient bytes; writes hold their storages; FREE drops
them. This is the contract the runtime is measured against.
"""
from __future__ import annotations

from dataclasses import dataclass

from .program import Op, Program


@dataclass
class MemoryCurve:
    live_after: list[int]     # device bytes held after each node
    peak_during: list[int]    # the most held while each node runs
    peak: int
    peak_index: int


def simulate(program: Program) -> MemoryCurve:
    # The ledger's rule (StorageLedger.hold and drop) inlined: the solver simulates thousands of
    # schedules, and the method calls were a third of its time. tests/unit/test_simulate_ledger.py
    # holds it to the ledger's curves.
    holders: dict = {}
    sizes: dict = {}
    live, values = 0, program.values
    live_after, peak_during = [], []
    free = Op.FREE
    for n in program.nodes:
        if n.op is free:
            for v in n.frees:
                for key, _ in values[v].parts:
                    held = holders.get(key)
                    if held is None or v not in held:
                        continue
                    held.discard(v)
                    if not held:
                        del holders[key]
                        live -= sizes.pop(key)
            peak_during.append(live)
        else:
            during = live + n.transient
            for v in n.writes:
                for key, nbytes in values[v].parts:
                    held = holders.get(key)
                    if held is not None:
                        held.add(v)
                    else:
                        holders[key] = {v}
                        sizes[key] = nbytes
                        live += nbytes
            peak_during.append(during if during > live else live)
        live_after.append(live)
    peak = max(peak_during, default=0)
    return MemoryCurve(live_after, peak_during, peak, peak_during.index(peak) if peak_during else 0)

