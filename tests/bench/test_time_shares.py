"""The peers bench's time shares: a call starts each system with the time it needs or leaves it
for a call of its own. The first lease gave each of five systems ~105 s of 9.5 minutes; DeepSpeed
needed more than 370 s and FSDP2 about 200 s, and DeepSpeed's row was lost."""
from megacompile.bench import peers
from megacompile.bench.shares import need_s
from megacompile.bench.workload import Workload

from .stub_runs import StubRuns

GPU_3B = Workload(shape="llama-3b", device="cuda", steps=9, warmup=1)


def _call(monkeypatch, tmp_path, *argv):
    runs = StubRuns().install(monkeypatch, peers)
    results, _ = peers.run(peers._arguments(["--out", str(tmp_path), "--no-calibrate", *argv]), GPU_3B)
    return runs, results


def test_the_needs_are_what_the_leases_measured():
    """On the H200 the 3B processes took 74 s (DeepSpeed), 103 s (FSDP2) and 102 s (megacompile,
    writing the weights too) for their set-up and 10 steps."""
    assert 74 < need_s("deepspeed", GPU_3B) < 120
    assert 103 < need_s("fsdp2", GPU_3B) < 150
    assert 93 < need_s("megacompile", GPU_3B) < 150
    assert need_s("megacompile", Workload(shape="llama-7b", device="cuda", batch=4, seq=4096, steps=4)) < 9 * 60


def test_the_default_call_starts_every_system_with_what_it_needs(monkeypatch, tmp_path):
    runs, results = _call(monkeypatch, tmp_path)
    started = {(system, options.get("budget")): timeout for system, options, timeout in runs.calls}
    for (system, _), timeout in started.items():
        assert timeout >= need_s(system, GPU_3B), (system, timeout)
    assert {system for system, _ in started} == {"megacompile", "deepspeed", "fsdp2"}
    assert all(r["ok"] for r in results), [r.get("reason") for r in results]


def test_a_system_whose_need_is_not_left_is_named_with_the_call_to_run_it_in(monkeypatch, tmp_path):
    runs, results = _call(monkeypatch, tmp_path, "--minutes", "3")
    started = {system for system, _, _ in runs.calls}
    skipped = [r for r in results if not r["ok"]]
    assert skipped and len(started) < 3, "3 minutes cannot hold every system's need at 3B"
    for r in skipped:
        assert "a call of its own (--systems" in r["reason"], r["reason"]


def test_a_system_alone_gets_the_whole_call(monkeypatch, tmp_path):
    runs, results = _call(monkeypatch, tmp_path, "--systems", "deepspeed", "--minutes", "9.5")
    [(system, _, timeout)] = runs.calls
    assert system == "deepspeed" and timeout == 9.5 * 60 and results[0]["ok"]


def test_spare_time_is_shared_in_proportion_to_the_needs(monkeypatch, tmp_path):
    runs, _ = _call(monkeypatch, tmp_path, "--systems", "fsdp2,megacompile", "--budgets", "resident", "--minutes", "30")
    timeouts = {system: timeout for system, _, timeout in runs.calls}
    needs = {s: need_s(s, GPU_3B) for s in timeouts}
    assert abs(sum(timeouts.values()) - 30 * 60) < 1
    assert abs(timeouts["fsdp2"] / timeouts["megacompile"] - needs["fsdp2"] / needs["megacompile"]) < 1e-6


def test_a_call_without_megacompile_spends_no_time_calibrating(monkeypatch, tmp_path):
    # The calibration (up to 120 s on a GPU) feeds megacompile's predicted column alone; the first
    # runbook's DeepSpeed call would have spent it before its model set-up.
    calibrations = []
    monkeypatch.setattr(peers, "_calibrate", lambda scratch, timeout: calibrations.append(timeout))
    runs = StubRuns(use_all_time=False).install(monkeypatch, peers)
    peers.run(peers._arguments(["--out", str(tmp_path), "--systems", "deepspeed,fsdp2", "--minutes", "30"]), GPU_3B)
    assert calibrations == [] and len(runs.calls) == 2
    peers.run(peers._arguments(["--out", str(tmp_path), "--systems", "megacompile", "--budgets", "0.34"]), GPU_3B)
    assert calibrations == [120]
