"""The memory simulator: device bytes live after every node of a schedule, and the peak.

It applies the runtime's rule (ir/ledger.py) to the values' storages: a compute node peaks at
what is live before it plus its graph's transient bytes; writes hold their storages; FREE drops
them. This is the contract the runtime is measured against.
"""
from __future__ import annotations

from dataclasses import dataclass

from .ledger import StorageLedger
from .program import Op, Program


@dataclass
class MemoryCurve:
    live_after: list[int]     # device bytes held after each node
    peak_during: list[int]    # the most held while each node runs
    peak: int
    peak_index: int


def simulate(program: Program) -> MemoryCurve:
    ledger = StorageLedger()
    hold, drop, values = ledger.hold, ledger.drop, program.values    # the solver simulates thousands
    live_after, peak_during = [], []
    for n in program.nodes:
        if n.op is Op.FREE:
            for v in n.frees:
                for key, _ in values[v].parts:
                    drop(v, key)
            peak_during.append(ledger.live_bytes)
        else:
            during = ledger.live_bytes + n.transient
            for v in n.writes:
                for key, nbytes in values[v].parts:
                    hold(v, key, nbytes)
            peak_during.append(max(during, ledger.live_bytes))
        live_after.append(ledger.live_bytes)
    peak = max(peak_during, default=0)
    return MemoryCurve(live_after, peak_during, peak, peak_during.index(peak) if peak_during else 0)
