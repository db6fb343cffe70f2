"""One megacompile row per budget actually used: two requested budgets below the smallest the plan
fits in are both raised to it and would train the same plan twice (at 3B the first lease's "0.5x"
and "0.34x" rows were one 0.53x run, twice)."""
from megacompile.bench import peers
from megacompile.bench.workload import Workload

from .stub_runs import StubRuns

GPU_3B = Workload(shape="llama-3b", device="cuda", steps=9, warmup=1)


def _call(monkeypatch, tmp_path, minimum_gib):
    runs = StubRuns(minimum_gib=minimum_gib, use_all_time=False).install(monkeypatch, peers)
    args = peers._arguments(["--out", str(tmp_path), "--no-calibrate", "--systems", "megacompile",
                             "--budgets", "0.34,0.5,resident"])
    results, _ = peers.run(args, GPU_3B)
    return [options["budget"] for _, options, _ in runs.calls], results


def test_budgets_raised_to_the_same_minimum_run_once_and_the_row_names_both(monkeypatch, tmp_path):
    ran, results = _call(monkeypatch, tmp_path, minimum_gib=3.55)     # 0.5x of 3.61 B params is 3.36 GiB
    assert ran == ["0.34", "resident"]
    assert [r["setting"] for r in results] == ["budget 0.34,0.5", "budget resident"]
    assert results[0]["requested_budgets"] == "0.34,0.5" and results[0]["hbm_budget_gib"] == 3.55


def test_a_budget_above_the_minimum_gets_its_own_row(monkeypatch, tmp_path):
    ran, results = _call(monkeypatch, tmp_path, minimum_gib=3.0)
    assert ran == ["0.34", "0.5", "resident"]
    assert [r["setting"] for r in results] == ["budget 0.34", "budget 0.5", "budget resident"]


def test_each_placement_of_the_updates_gets_its_own_row_per_budget_used(monkeypatch, tmp_path):
    runs = StubRuns(minimum_gib=3.55, use_all_time=False).install(monkeypatch, peers)
    args = peers._arguments(["--out", str(tmp_path), "--no-calibrate", "--systems", "megacompile",
                             "--budgets", "0.34,0.5", "--updates", "at_commit,as_gradients_land"])
    results, _ = peers.run(args, GPU_3B)
    assert [(o["budget"], o["updates"]) for _, o, _ in runs.calls] == [("0.34", "at_commit"),
                                                                      ("0.34", "as_gradients_land")]
    assert [r["setting"] for r in results] == ["budget 0.34,0.5", "budget 0.34,0.5, updates as_gradients_land"]
    assert peers._jobs(args)[1].alone() == "--systems megacompile --budgets 0.34 --updates as_gradients_land"


def test_an_unknown_placement_is_refused(tmp_path):
    import pytest
    from megacompile.errors import ArgumentError
    with pytest.raises(ArgumentError, match="--updates: eager is not one of at_commit, as_gradients_land"):
        peers._jobs(peers._arguments(["--out", str(tmp_path), "--updates", "eager"]))
