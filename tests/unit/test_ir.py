"""The schedule IR: simulator, ledger and verifier, on hand-built and compiled schedules."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from megacompile.capture import capture
from megacompile.capture.model_graph import owners
from megacompile.errors import PlanVerificationError
from megacompile.ir.ledger import StorageLedger
from megacompile.ir.program import Node, Op, Program, Value
from megacompile.ir.simulate import simulate
from megacompile.ir.verify import verify
from megacompile.passes import ScheduleChoice, build_schedule
from tests import models


def test_ledger_counts_a_shared_storage_once():
    ledger = StorageLedger()
    assert ledger.hold("a", "s1", 100) == 100
    assert ledger.hold("view_of_a", "s1", 100) == 0
    assert ledger.drop("a", "s1") == 0           # the view still holds it
    assert ledger.live_bytes == 100
    assert ledger.drop("view_of_a", "s1") == 100
    assert (ledger.live_bytes, ledger.peak_bytes) == (0, 100)


def test_simulator_curve_on_a_hand_built_schedule():
    values = {"w0": Value("w0", (("w0", 1000),), "weights"),
              "x": Value("x", (("x", 10),), "activation"),
              "y": Value("y", (("y", 20),), "activation"),
              "y_view": Value("y_view", (("y", 20),), "saved")}
    nodes = [Node(Op.INPUT, writes=("x",)),
             Node(Op.PREFETCH, 0, writes=("w0",)),
             Node(Op.WAIT, 0, reads=("w0",)),
             Node(Op.FORWARD, 0, reads=("w0", "x"), writes=("y", "y_view"), transient=500),
             Node(Op.FREE, frees=("w0", "x", "y")),
             Node(Op.OUTPUT, reads=("y_view",)),
             Node(Op.FREE, frees=("y_view",))]
    curve = simulate(Program(nodes, values, ["s0"]))
    assert curve.live_after == [10, 1010, 1010, 1030, 20, 20, 0]
    assert curve.peak == 1510 and curve.peak_index == 3      # 1010 live + 500 transient


@pytest.fixture(scope="module")
def compiled():
    torch.manual_seed(0)
    model = models.NanoGPT(vocab=96, d=32, layers=3)
    ids = models.batch(96, 2, 8)
    captured = capture(model, (ids, ids), {}, device=torch.device("cpu"), compute_dtype=torch.float32)
    blocks = frozenset(s for s, st in enumerate(captured.stages) if st.template.kind == "block")
    program = build_schedule(captured, ScheduleChoice(1, frozenset(sorted(blocks)[:1])), arena=True)
    return captured, program


def _without(program: Program, index: int) -> Program:
    return program.copy(program.nodes[:index] + program.nodes[index + 1:])


def _first(program: Program, op: Op, **match) -> int:
    return next(i for i, n in enumerate(program.nodes)
                if n.op is op and all(getattr(n, k) == v for k, v in match.items()))


def test_compiled_schedule_verifies(compiled):
    """At a budget of its arena: every tensor at a planned offset needs the arena, a little more than
    the peak (passes/arena.py)."""
    captured, program = compiled
    arena = program.facts["arena"]
    assert arena.size >= simulate(program).peak
    verify(program, budget_bytes=arena.size, owners=owners(captured)[1])
    with pytest.raises(PlanVerificationError, match="device arena"):
        verify(program, budget_bytes=arena.size - 1)


def test_verifier_catches_a_read_before_the_prefetch_is_waited_for(compiled):
    captured, program = compiled
    with pytest.raises(PlanVerificationError, match="arriving"):
        verify(_without(program, _first(program, Op.WAIT, reads=("w1",))))


def test_verifier_catches_a_read_after_eviction(compiled):
    captured, program = compiled
    i = _first(program, Op.FORWARD, stage=1)
    evict = Node(Op.FREE, 1, frees=("w1",), note="evict")
    moved = [n for n in program.nodes if not (n.op is Op.FREE and n.frees == ("w1",))]
    moved.insert(i, evict)
    with pytest.raises(PlanVerificationError, match="after it is freed"):
        verify(program.copy(moved))


def test_verifier_catches_freeing_gradients_in_flight(compiled):
    captured, program = compiled
    with pytest.raises(PlanVerificationError, match="frees g1 before the WAIT on its offload"):
        verify(_without(program, _first(program, Op.WAIT, reads=("g1",))))


def test_an_offloaded_stash_is_freed_only_after_the_wait_on_its_copy():
    """The cuda backend frees offload sources without record_stream: the WAIT on the copy is what
    orders the reuse of their memory, so a FREE moved above it must be refused."""
    torch.manual_seed(0)
    model = models.NanoGPT(vocab=96, d=32, layers=3)
    ids = models.batch(96, 2, 8)
    captured = capture(model, (ids, ids), {}, device=torch.device("cpu"), compute_dtype=torch.float32)
    blocks = frozenset(s for s, st in enumerate(captured.stages) if st.template.kind == "block")
    program = build_schedule(captured, ScheduleChoice(1, frozenset(), offload=frozenset(sorted(blocks)[:1])))
    stashed = [n.reads[0] for n in program.nodes
               if n.op is Op.OFFLOAD and program.values[n.reads[0]].kind in ("saved", "activation")]
    assert stashed, "the schedule offloads a stash"
    verify(program)
    for value in stashed:
        wait = _first(program, Op.WAIT, reads=(value,))
        free = next(i for i, n in enumerate(program.nodes) if n.op is Op.FREE and value in n.frees)
        assert wait < free
        nodes = list(program.nodes)
        nodes.insert(wait, nodes.pop(free))
        with pytest.raises(PlanVerificationError, match=f"frees {value} before the WAIT on its offload"):
            verify(program.copy(nodes))


def test_verifier_catches_an_update_before_its_gradients_arrive(compiled):
    captured, program = compiled
    step = _first(program, Op.OPTIMIZER_STEP, stage=0)
    offload = _first(program, Op.OFFLOAD, stage=0)
    nodes = list(program.nodes)
    node = nodes.pop(step)
    nodes.insert(offload, node)
    with pytest.raises(PlanVerificationError, match="before the gradients"):
        verify(program.copy(nodes), owners=owners(captured)[1])


def test_verifier_catches_a_recompute_with_no_forward_to_replay(compiled):
    captured, program = compiled
    i = _first(program, Op.RECOMPUTE)
    stage = program.nodes[i].stage
    nodes = [replace(n, op=Op.INFER) if n.op is Op.FORWARD and n.stage == stage else n for n in program.nodes]
    with pytest.raises(PlanVerificationError, match="random state"):
        verify(program.copy(nodes))


def test_verifier_catches_a_peak_over_budget(compiled):
    captured, program = compiled
    peak = simulate(program).peak
    with pytest.raises(PlanVerificationError, match="exceeds the budget"):
        verify(program, budget_bytes=peak - 1)


def test_every_value_is_freed_once_and_nothing_leaks(compiled):
    captured, program = compiled
    curve = simulate(program)
    assert curve.live_after[-1] == 0
    freed = [v for n in program.nodes if n.op is Op.FREE for v in n.frees]
    writes = [v for n in program.nodes if n.op is not Op.FREE for v in n.writes
              if program.values[v].kind != "host"]        # host masters are not device values
    assert sorted(freed) == sorted(writes)


def test_verifier_catches_a_prefetch_of_masters_still_updating(compiled):
    captured, program = compiled
    with pytest.raises(PlanVerificationError, match="updating"):
        verify(_without(program, _first(program, Op.WAIT, reads=("m1",))))
