"""A step as a Chrome trace: the predicted and the measured timeline of a cpu-backend step, one
slice per schedule node on its stream's track, with device-byte counters and the budget."""
from __future__ import annotations

import json
from collections import Counter

import pytest

import megacompile
from tests import models

TRACKS = {"compute", "h2d", "d2h", "host"}


@pytest.fixture(scope="module")
def engine():
    """Weights prefetched two stages ahead: the copy thread fills the next stages while one computes."""
    model = models.NanoGPT(vocab=96, d=128, layers=4, heads=4)
    engine = megacompile.compile(model, hbm_budget=1.0, device="cpu")
    yield engine
    engine.close()


def _slices(trace: dict, pid: int) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == pid]


def _tracks(trace: dict, pid: int) -> dict[int, str]:
    return {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
            if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == pid}


def test_a_cpu_step_traces_every_node_once_per_timeline_with_prefetches_beside_compute(engine, tmp_path):
    overlapped = 0
    for seed in range(3):
        ids = models.batch(96, 4, 32, seed=seed)
        engine.step(idx=ids, targets=ids)
        path = tmp_path / f"step{seed}.json"
        engine.trace(str(path))
        trace = json.loads(path.read_text())       # Chrome's trace-event JSON: an object with traceEvents
        program = engine.plan.program
        assert program.facts["choice"].prefetch_depth >= 1
        names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
        assert names[1].startswith("predicted") and names[2].startswith("measured")
        for pid in (1, 2):
            tracks = _tracks(trace, pid)
            assert TRACKS <= set(tracks.values())
            slices = _slices(trace, pid)
            for e in slices:
                assert {"name", "ts", "dur", "tid"} <= set(e) and e["dur"] >= 0
            per_node = Counter(e["args"]["node"] for e in slices if "node" in e["args"])
            assert per_node == Counter(range(len(program.nodes))), f"pid {pid}: each node once"
            for e in slices:
                if "node" in e["args"]:
                    node = program.nodes[e["args"]["node"]]
                    assert tracks[e["tid"]] == node.stream
                    assert e["args"]["op"] == node.op.value and "bytes" in e["args"] and "origin" in e["args"]
            counters = {e["name"] for e in trace["traceEvents"] if e["ph"] == "C" and e["pid"] == pid}
            assert counters == {"device bytes", "device budget"}
        measured = _slices(trace, 2)
        tracks = _tracks(trace, 2)
        compute = [e for e in measured if tracks[e["tid"]] == "compute" and e["args"].get("op") in
                   ("forward", "backward", "recompute")]
        prefetches = [e for e in measured if tracks[e["tid"]] == "h2d" and e["args"].get("op") == "prefetch"]
        assert len(prefetches) >= 4
        overlapped += sum(1 for p in prefetches for c in compute
                          if c["ts"] < p["ts"] + p["dur"] and p["ts"] < c["ts"] + c["dur"])
        # the measured device bytes never pass the budget, and peak where the plan said
        live = [e["args"]["bytes"] for e in trace["traceEvents"] if e["ph"] == "C" and e["pid"] == 2
                and e["name"] == "device bytes"]
        assert max(live) == engine.memory_stats()["device_peak_bytes"] == engine.plan.predicted_peak_bytes
    assert overlapped > 0, "no measured prefetch ran while a stage computed"


def test_the_trace_before_a_step_is_the_prediction_alone(tmp_path):
    model = models.NanoGPT(vocab=96, d=64, layers=2, heads=4)
    engine = megacompile.compile(model, hbm_budget=1.0, device="cpu")
    try:
        ids = models.batch(96, 2, 16)
        engine.prepare(idx=ids, targets=ids)
        engine.trace(str(tmp_path / "plan.json"))
    finally:
        engine.close()
    trace = json.loads((tmp_path / "plan.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {1}
    starts = {e["args"]["node"]: e["ts"] for e in _slices(trace, 1)}
    assert len(starts) == len(engine.plan.program.nodes)


def test_the_disk_tier_reads_and_writes_each_piece_on_the_measured_disk_track(tmp_path, monkeypatch):
    """With the moments on disk, every piece an update reads back and writes out is one slice on
    the measured disk track, for every owner the step updated."""
    import torch
    from megacompile.cost.host_memory import host_costs
    monkeypatch.setenv("MEGACOMPILE_TIER_PIECE", "4096")    # several pieces per owner
    model = models.NanoGPT(vocab=96, d=32, layers=2, heads=2)
    ids = models.batch(96, 2, 16)
    probe = megacompile.compile(models.NanoGPT(vocab=96, d=32, layers=2, heads=2), 1.0, device="cpu")
    probe.prepare(idx=ids, targets=ids)
    ram = host_costs(probe.plan.captured, torch.float32)[1].ram_bytes     # the moments' level
    probe.close()
    engine = megacompile.compile(model, 1.0, device="cpu", nvme_dir=str(tmp_path / "tier"), host_budget=ram / 2**30)
    try:
        engine.step(idx=ids, targets=ids)
        engine.synchronize()
        engine.host.disk.tier.flush()       # the last pieces' writes run behind the updates
        tier = engine.host.disk.tier
        engine.trace(str(tmp_path / "step.json"))
    finally:
        engine.close()
    trace = json.loads((tmp_path / "step.json").read_text())
    disk = {tid for tid, name in _tracks(trace, 2).items() if name == "disk"}
    slices = [e["name"] for e in _slices(trace, 2) if e["tid"] in disk]
    pieces = {(o, i) for o in tier.owners for i in range(len(tier.pieces_of(o)))}
    assert len(pieces) > len(tier.owners)
    for what in ("read", "write"):
        seen = {tuple(int(x) for x in s.split()[2:5:2]) for s in slices if s.startswith(what)}
        assert seen == pieces, what
