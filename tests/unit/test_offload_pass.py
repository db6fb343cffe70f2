"""passes/offload.py: where a block's saved values leave and come back, and which stay."""
from __future__ import annotations

import functools

from megacompile.ir.program import COMPUTE_OPS, Op, restored, saved
from megacompile.passes import ScheduleChoice, build_schedule
from tests.unit import test_passes

_captured = functools.cache(test_passes._captured)


def test_blocks_too_close_to_their_backward_keep_their_saved_values():
    """Every other block recomputed, the rest offloaded with a lag of 3 compute nodes (the strided
    family the solver picked for a Qwen3-235B-A22B shape): the last offloaded block's backward
    comes 3 compute nodes after its forward, so its copy out could not be waited for before the
    backward reads it. It keeps its saved values on the device; the program verifies."""
    captured = _captured(layers=6)
    blocks = [s for s, st in enumerate(captured.stages) if st.template.kind == "block"]
    lag = 3
    choice = ScheduleChoice(2, recompute=frozenset(blocks[0::2]), offload=frozenset(blocks[1::2]), offload_lag=lag)
    program = build_schedule(captured, choice)      # verified after every pass
    nodes = program.nodes
    rank = {i: r for r, i in enumerate(i for i, n in enumerate(nodes) if n.op in COMPUTE_OPS)}
    at = {(n.op, n.stage): i for i, n in enumerate(nodes) if n.op in (Op.FORWARD, Op.BACKWARD)}
    sent = program.facts["offload"]
    assert blocks[-1] not in sent and rank[at[(Op.BACKWARD, blocks[-1])]] - rank[at[(Op.FORWARD, blocks[-1])]] <= lag
    assert sorted(sent) == blocks[1:-1:2]
    for s in sent:
        out_wait = next(i for i, n in enumerate(nodes) if n.op is Op.WAIT and n.reads == (saved(s),))
        back = next(i for i, n in enumerate(nodes) if n.op is Op.PREFETCH and n.writes == (restored(s),))
        assert at[(Op.FORWARD, s)] < out_wait < back < at[(Op.BACKWARD, s)]
        assert restored(s) in nodes[at[(Op.BACKWARD, s)]].reads
