"""The memory picture: device bytes by kind over the schedule (adding up to the simulator's curve),
host bytes by kind, the PNG with the measured curve after a step, and plan.json's tables."""
from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest

from megacompile.errors import MegacompileError
from megacompile.ir.program import Node, Op, Program, Value
from megacompile.ir.simulate import simulate
from megacompile.report import device_by_kind, host_by_kind
from tests import models


@pytest.fixture(scope="module")
def engine(planned_engine):
    return planned_engine


def _offloading() -> Program:
    """A block whose saved values go to host memory after its forward and come back before its backward."""
    values = {"w1": Value("w1", (("w1", 100),), "weights"), "x0.0": Value("x0.0", (("x0.0", 8),), "input"),
              "x1.0": Value("x1.0", (("x1.0", 8),), "activation"), "saved1": Value("saved1", (("s1", 40),), "saved"),
              "hsaved1": Value("hsaved1", (("h1", 40),), "saved"), "g1": Value("g1", (("g1", 100),), "grads")}
    nodes = [Node(Op.INPUT, writes=("x0.0",)), Node(Op.PREFETCH, 1, writes=("w1",)), Node(Op.WAIT, 1, reads=("w1",)),
             Node(Op.FORWARD, 1, reads=("w1", "x0.0"), writes=("x1.0", "saved1"), transient=100),
             Node(Op.OFFLOAD, 1, reads=("saved1",)), Node(Op.WAIT, 1, reads=("saved1",)),
             Node(Op.FREE, 1, frees=("saved1",)), Node(Op.PREFETCH, 1, writes=("hsaved1",)),
             Node(Op.WAIT, 1, reads=("hsaved1",)),
             Node(Op.BACKWARD, 1, reads=("w1", "hsaved1"), writes=("g1",), transient=150),
             Node(Op.FREE, 1, frees=("w1", "hsaved1", "x0.0", "x1.0", "g1"))]
    return Program(nodes, values, ["prologue", "block.0"], ["hand"])


def test_device_bytes_by_kind_add_up_to_the_simulated_curve():
    program = _offloading()
    kinds = device_by_kind(program)
    assert kinds["weights"] == [0, 100, 100, 100, 100, 100, 100, 100, 100, 100, 0]
    assert kinds["saved activations"] == [0, 0, 0, 40, 40, 40, 0, 40, 40, 40, 0]
    assert kinds["block boundaries"] == [8, 8, 8, 16, 16, 16, 16, 16, 16, 16, 0]
    assert kinds["gradients"] == [0] * 9 + [100, 0]
    # what a stage needs above what it leaves live: 108 + 100 - 156 in the forward, 156 + 150 - 256 in the backward
    assert kinds["transient"] == [0, 0, 0, 52, 0, 0, 0, 0, 0, 50, 0]
    curve = simulate(program)
    assert [sum(k[i] for k in kinds.values()) for i in range(len(program.nodes))] == curve.peak_during


def test_offloaded_activations_wait_in_host_memory_between_offload_and_prefetch():
    plan = SimpleNamespace(program=_offloading(), host_cost=None, host_bytes=1000)
    ram, disk = host_by_kind(plan)
    assert ram["host state"] == [1000] * 11 and disk == {}
    assert ram["offloaded activations"] == [0, 0, 0, 0, 40, 40, 40, 0, 0, 0, 0]


def test_a_compiled_plan_by_kind_matches_its_curve(engine):
    plan = engine.plan
    kinds = device_by_kind(plan.program)
    assert [sum(k[i] for k in kinds.values()) for i in range(len(plan.program.nodes))] == plan.curve.peak_during
    ram, _ = host_by_kind(plan)
    assert sum(v[0] for v in ram.values()) == plan.host_bytes


def test_plan_json_has_a_values_table_and_predicted_times_per_node(engine):
    data = json.loads(json.dumps(engine.plan.to_json()))
    table = {v["name"]: v for v in data["values"]}
    for entry in data["schedule"]:
        for name in entry["reads"] + entry["writes"] + entry["frees"]:
            assert name in table
        (own,) = [p for p in entry["predicted"] if p["stream"] == entry["stream"]]
        assert 0 <= own["start_s"] <= own["end_s"]
    program = engine.plan.program
    assert all(table[v]["bytes"] == program.values[v].nbytes and table[v]["kind"] == program.values[v].kind
               for v in program.values)
    assert {v["home"] for v in data["values"]} == {"device", "host"}
    compute_end = max(p["end_s"] for e in data["schedule"] for p in e["predicted"] if p["stream"] == "compute")
    assert compute_end == pytest.approx(data["predicted_step_s"])


def test_the_memory_picture_is_a_png_with_the_measured_step(engine, tmp_path):
    pytest.importorskip("matplotlib")
    plan = engine.plan
    assert plan.measured_memory() is None
    plan.plot_memory(str(tmp_path / "before.png"))
    ids = models.batch(96, 2, 16)
    engine.step(idx=ids, targets=ids)
    measured = plan.measured_memory()
    assert [m.peak for m in measured] == plan.curve.peak_during      # the runtime keeps the plan's bytes
    plan.plot_memory(str(tmp_path / "after.png"))
    for name in ("before.png", "after.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 200_000


def test_without_matplotlib_the_picture_says_how_to_get_it(engine, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MegacompileError, match=r"pip install 'megacompile\[plot\]'"):
        engine.plan.plot_memory(str(tmp_path / "memory.png"))
    assert not (tmp_path / "memory.png").exists()
