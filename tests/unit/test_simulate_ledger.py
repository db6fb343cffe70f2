"""The simulator counts device bytes by the runtime's rule (ir/ledger.py), inlined for speed: on
every kind of schedule the solver builds (each way to hold a block, layer-major micro-batches,
weights resident), its curve is the one StorageLedger itself gives, node by node."""
from __future__ import annotations

import dataclasses


from megacompile.cost import get_profile
from megacompile.ir.ledger import StorageLedger
from megacompile.ir.program import Op
from megacompile.ir.simulate import simulate
from megacompile.passes import build_schedule
from megacompile.planner.search import search_space
from megacompile.planner.solve import candidates
from tests import models


def _by_ledger(program) -> tuple[list[int], list[int]]:
    ledger = StorageLedger()
    live_after, peak_during = [], []
    for n in program.nodes:
        if n.op is Op.FREE:
            for v in n.frees:
                for key, _ in program.values[v].parts:
                    ledger.drop(v, key)
            peak_during.append(ledger.live_bytes)
        else:
            during = ledger.live_bytes + n.transient
            for v in n.writes:
                for key, nbytes in program.values[v].parts:
                    ledger.hold(v, key, nbytes)
            peak_during.append(max(during, ledger.live_bytes))
        live_after.append(ledger.live_bytes)
    return live_after, peak_during


def test_the_simulators_curve_is_the_ledgers_on_every_kind_of_schedule():
    captured = models.captured_llama(layers=6, d=32, rows=8, seq=32)
    blocks = [s for s, st in enumerate(captured.stages) if st.template.kind == "block"]
    space = search_space(captured, blocks, get_profile("h100"), device_room=2 ** 40)
    checked, shared = 0, 0
    for family in space[::7]:
        for choice in candidates(blocks, family)[::3]:
            for c in (choice, dataclasses.replace(choice, micro_batches=3)):
                program = build_schedule(captured, c, check=False)
                curve = simulate(program)
                live_after, peak_during = _by_ledger(program)
                assert (curve.live_after, curve.peak_during) == (live_after, peak_during), c
                assert curve.peak == max(peak_during) and peak_during[curve.peak_index] == curve.peak
                checked += 1
                keys = [key for v in program.values.values() for key, _ in v.parts]
                shared += len(keys) > len(set(keys))     # storages several values hold: the ledger's rule
    assert checked >= 20 and shared >= checked // 4
