"""passes/boundary.py: which values count as a block's boundary, and where the copies go."""
from __future__ import annotations

import functools

from megacompile.ir.program import COMPUTE_OPS, Op, restored_of
from megacompile.ir.verify import verify
from megacompile.passes import ScheduleChoice, build_schedule
from megacompile.passes.boundary import boundary_values
from megacompile.passes.lower import lower
from tests.unit import test_passes


# One capture for both tests: the plainest one test_passes uses.
_captured = functools.cache(test_passes._captured)


def test_only_inputs_no_other_forward_reads_are_boundaries():
    captured = _captured()
    program = lower(captured)
    bounds = boundary_values(program)
    blocks = [s for s, st in enumerate(captured.stages) if st.template.kind == "block"]
    for s in blocks:
        # The hidden state from the stage before; never the rotary tables every block reads.
        assert bounds[s] == [f"x{s - 1}.0"], bounds[s]


def test_copies_leave_after_the_forward_and_return_before_the_first_reader():
    captured = _captured()
    blocks = [s for s, st in enumerate(captured.stages) if st.template.kind == "block"]
    lag = 2
    choice = ScheduleChoice(1, frozenset(blocks), boundary=frozenset(blocks), offload_lag=lag)
    program = build_schedule(captured, choice)      # verified after every pass
    verify(program)
    nodes = program.nodes
    compute = [i for i, n in enumerate(nodes) if n.op in COMPUTE_OPS]
    sent = program.facts["boundary_values"]
    # The last blocks' copies could not leave and come back in time: they stay on the device.
    assert 0 < len(sent) < len(blocks)
    for v in sent:
        back = restored_of(v)
        out = next(i for i, n in enumerate(nodes) if n.op is Op.OFFLOAD and n.reads == (v,))
        issue = next(i for i, n in enumerate(nodes) if n.op is Op.PREFETCH and n.writes == (back,))
        first = next(i for i, n in enumerate(nodes) if back in n.reads and n.op in COMPUTE_OPS)
        assert nodes[first].op is Op.RECOMPUTE        # a recomputed block's forward reads it first
        # Issued `lag` compute nodes before its reader, so the copy runs beside them.
        assert sum(1 for i in compute if issue < i < first) == lag
        assert not any(v in n.reads for n in nodes[out + 1:] if n.op in COMPUTE_OPS)
