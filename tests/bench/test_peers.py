"""The peers bench (megacompile/bench): its CSV schema, the loss-agreement check, and its cpu half."""
import csv
import json
import subprocess
import sys

import pytest
import torch

from megacompile.bench import peers, systems, weights
from megacompile.bench.agreement import BF16_LOSS_RTOL, FP32_LOSS_RTOL, agree, loss_deviation, loss_fall
from megacompile.bench.table import COLUMNS, markdown, read_csv, write_csv
from megacompile.bench.workload import Workload
from megacompile.errors import ArgumentError

FACTS = {"gpu": "none", "torch": torch.__version__, "deepspeed": "not installed"}


def _results():
    return [{"system": "megacompile", "setting": "budget 0.5", "ok": True, "losses": [5.5, 5.4, 5.3],
             "step_s": 0.1, "tokens_per_s": 640.0, "tflops_6nd": 0.0, "hbm_budget_gib": 0.01,
             "budget_raised_to_minimum": True, "peak_host_rss_bytes": 2**30},
            {"system": "fsdp2", "setting": "offload", "ok": True, "losses": [5.5, 5.4, 5.3], "step_s": 0.2,
             "tokens_per_s": 320.0, "tflops_6nd": 0.0, "peak_host_rss_bytes": 2**30},
            {"system": "deepspeed", "setting": "offload", "ok": False, "reason": "needs a GPU", "traceback": "..."}]


def test_csv_is_long_one_row_per_metric_with_the_machine_on_each(tmp_path):
    path = tmp_path / "peers.csv"
    write_csv(path, _results(), FACTS)
    with open(path, newline="") as f:
        assert next(csv.reader(f)) == [*COLUMNS, *FACTS]
    rows = read_csv(path)
    assert all(r["torch"] == torch.__version__ and r["deepspeed"] == "not installed" for r in rows)
    losses = [r for r in rows if r["system"] == "fsdp2" and r["metric"] == "loss"]
    assert [(r["value"], r["note"]) for r in losses] == [("5.5", "step 0"), ("5.4", "step 1"), ("5.3", "step 2")]
    skipped = [r for r in rows if r["system"] == "deepspeed"]
    assert [(r["metric"], r["note"]) for r in skipped] == [("skipped", "needs a GPU")]   # no traceback in the CSV
    assert {"tokens_per_s", "step_s", "budget_raised_to_minimum"} <= {r["metric"] for r in rows if r["system"] == "megacompile"}


def test_agreement_fails_on_one_perturbed_loss_and_the_table_says_so():
    results = _results()
    assert peers.check_agreement(results, FP32_LOSS_RTOL)
    results[1]["losses"][2] *= 1 + 10 * FP32_LOSS_RTOL
    assert not peers.check_agreement(results, FP32_LOSS_RTOL)
    assert results[1]["loss_deviation"] == pytest.approx(10 * FP32_LOSS_RTOL)
    table = markdown(results, FACTS, {**Workload(shape="tiny").to_dict(), "parameters": 1, "compute_dtype": "fp32"},
                     "megacompile budget 0.5", FP32_LOSS_RTOL)
    assert "| fsdp2 | offload |" in table and table.count("| NO |") == 1
    assert "skipped: needs a GPU" in table


def test_loss_deviation_refuses_runs_of_other_lengths_and_non_finite_losses():
    assert loss_deviation([1.0, 2.0], [1.0]) == float("inf")
    assert loss_deviation([1.0, float("nan")], [1.0, 2.0]) == float("inf")
    assert agree([1.0, 2.0], [1.0, 2.0 * (1 + 1e-5)], 1e-4)[0]


def test_the_table_says_when_the_losses_fell_too_little_for_their_agreement_to_say_much():
    results = _results()        # 5.5 -> 5.3: 3.6%, less than 5 bf16 tolerances (2e-2)
    described = {**Workload(shape="tiny").to_dict(), "parameters": 1, "compute_dtype": "bf16"}
    fall = loss_fall(results[0]["losses"])
    assert abs(fall - 0.2 / 5.5) < 1e-12
    assert "too little for the agreement" in markdown(results, FACTS, described, "x", BF16_LOSS_RTOL, fall)
    assert "too little" not in markdown(results, FACTS, described, "x", FP32_LOSS_RTOL, fall)


def test_a_call_of_its_own_is_compared_with_an_earlier_calls_first_row(tmp_path):
    write_csv(tmp_path / "peers.csv", _results(), FACTS)
    earlier = peers.earlier_reference(tmp_path / "peers.csv")
    assert earlier["losses"] == [5.5, 5.4, 5.3] and earlier["setting"].startswith("budget 0.5 (")
    theirs = [{"system": "deepspeed", "setting": "ZeRO-3 offload", "ok": True, "losses": [5.5, 5.4, 5.4]}]
    assert not peers.check_agreement(theirs, BF16_LOSS_RTOL / 10, earlier)
    assert peers.check_agreement(theirs, BF16_LOSS_RTOL, earlier)


def test_the_batches_hold_something_to_learn():
    """Zipf-distributed tokens: a model lowers its loss by learning their frequencies in a few
    steps; uniform ones leave the loss at ln(vocab)."""
    ids = torch.cat([x.flatten() for x, _ in Workload(shape="llama-3b", batch=2, seq=1024, steps=1).batches()])
    counts = torch.bincount(ids, minlength=128256).double()
    assert counts[:10].sum() > 0.2 * len(ids) and counts[:100].mean() > 30 * counts[10000:].mean()


def test_workload_counts_the_model_it_builds_and_draws_the_same_batches():
    w = Workload(shape="tiny", device="cpu", steps=2, warmup=1)
    assert w.parameters == sum(p.numel() for p in w.model().parameters())
    a, b = w.batches(), w.batches()
    assert len(a) == 3 and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))
    assert torch.equal(a[0][0][:, 1:], a[0][1][:, :-1])       # labels are the next tokens
    assert not torch.equal(Workload(shape="tiny", data_seed=7).batches()[0][0], a[0][0])


def test_a_system_that_cannot_run_here_is_named_with_its_reason():
    why = peers._unavailable("deepspeed", Workload(shape="tiny", device="cpu"))
    assert "needs a GPU" in why
    assert peers._unavailable("megacompile", Workload(shape="tiny", device="cpu")) is None


@pytest.mark.slow
def test_perturbed_data_in_one_system_fails_the_agreement(monkeypatch, tmp_path):
    """Real runs: megacompile (its meta model's weights streamed from the weights folder) and FSDP2
    on the same data agree; FSDP2 on other batches does not."""
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.setenv(key, "")     # recorded as it was, so what the one-rank group sets goes with the test
        monkeypatch.delenv(key)
    same = Workload(shape="tiny", device="cpu", batch=2, seq=32, steps=2, warmup=1, lr=3e-3, lr_warmup=3)
    trace = tmp_path / "megacompile.trace.json"
    mine = {"ok": True, **systems.run_megacompile(same, "resident", str(weights.write(same, tmp_path)),
                                                  trace=str(trace))}
    # The last timed step, measured beside predicted (where the time went), and beside it the step
    # run alone for the host optimizer's time.
    for path in (trace, tmp_path / "megacompile.alone.trace.json"):
        events = json.loads(path.read_text())["traceEvents"]
        measured = {e["pid"] for e in events
                    if e["name"] == "process_name" and e["args"]["name"].startswith("measured")}
        assert measured and any(e["ph"] == "X" and e["pid"] in measured for e in events), path
    # The plan the row ran, as `megacompile plan` prints one (its reserve on a GPU): beside the CLI's.
    summary = (tmp_path / "megacompile.plan.txt").read_text()
    assert summary.startswith("megacompile plan (training step") and "  device peak " in summary
    # The arena's figures travel with the row: what escaped it on the device is what the lease reads.
    assert mine["device_arena_bytes"] > 0 and mine["device_allocations_last_step"] == 0
    assert mine["ledger_device_peak_bytes"] <= mine["device_arena_bytes"]
    assert mine["host_bytes"] > 0 and mine["predicted_host_bytes"] > 0
    assert all(mine[f"setup_{phase}_s"] > 0 for phase in ("capture", "host_state", "plan"))
    theirs = {"ok": True, **systems.run_fsdp2(same)}
    other = {"ok": True, **systems.run_fsdp2(Workload(shape="tiny", device="cpu", batch=2, seq=32, steps=2, warmup=1,
                                                      lr=3e-3, lr_warmup=3, data_seed=99))}
    assert peers.check_agreement([mine, theirs], FP32_LOSS_RTOL), theirs["loss_deviation"]
    assert not peers.check_agreement([mine, theirs, other], FP32_LOSS_RTOL)
    assert theirs["losses_agree"] and not other["losses_agree"]


@pytest.mark.slow
def test_the_cpu_half_runs_end_to_end(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, "-m", "megacompile.bench", "peers", "--tiny", "--out", str(out),
                           "--steps", "2", "--warmup", "1"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = read_csv(out / "peers.csv")
    by = {}
    for r in rows:
        by.setdefault((r["system"], r["setting"]), {}).setdefault(r["metric"], []).append(r)
    # 0.34x and 0.5x of the toy's weights are both below the smallest budget it fits in: one row for both.
    assert list(by) == [("megacompile", "budget 0.34,0.5"), ("deepspeed", "ZeRO-3 offload"),
                        ("fsdp2", "offload, fused AdamW"), ("megacompile", "budget resident")]
    assert "needs a GPU" in by[("deepspeed", "ZeRO-3 offload")]["skipped"][0]["note"]
    for key in [k for k in by if k[0] != "deepspeed"]:
        assert "skipped" not in by[key], (key, by[key]["skipped"][0]["note"], proc.stdout)
        assert len(by[key]["loss"]) == 3 and by[key]["losses_agree"][0]["value"] == "True", key
        assert float(by[key]["tokens_per_s"][0]["value"]) > 0
    # The budgets below the smallest that fits are raised to it, and the table says how far.
    small = by[("megacompile", "budget 0.34,0.5")]
    assert small["budget_raised_to_minimum"][0]["value"] == "True"
    assert small["requested_budgets"][0]["value"] == "0.34,0.5"
    assert float(small["hbm_budget_gib"][0]["value"]) > float(small["asked_budget_gib"][0]["value"])
    assert "| deepspeed | ZeRO-3 offload | skipped:" in (out / "peers.md").read_text()
    assert (out / "logs" / "fsdp2-offload-fused-AdamW.log").exists()
    assert list((out / "weights").iterdir()) == [out / "weights" / "tiny-seed0"]


def test_the_table_says_a_loss_that_rose_diverged_rather_than_that_it_fell_too_little():
    """On the H100 the 7B row's loss went 11.19 -> 28.75 -> ... -> 16.0 at lr 1e-4."""
    described = {**Workload(shape="tiny").to_dict(), "parameters": 1, "compute_dtype": "bf16"}
    fall = loss_fall([11.1875, 28.75, 14.6875, 17.875, 16.0])
    text = markdown(_results(), FACTS, described, "x", BF16_LOSS_RTOL, fall)
    assert "rose by 43.0%" in text and "a smaller --lr" in text
    assert "fell by" not in text and "too little" not in text


def test_the_gpu_rows_learning_rate_shrinks_with_the_width(monkeypatch):
    """lr 1e-4 diverged on the H100 at 4096 wide (11.19 -> 28.75 in one step); the GPU rows train at
    1e-4 x 1024 / width, the toy at 3e-3, and --lr still wins."""
    from megacompile.bench.workload import width_lr
    assert width_lr(1024) == width_lr(64) == 1e-4
    assert width_lr(4096) == 2.5e-5 and abs(width_lr(3072) - 1e-4 / 3) < 1e-12
    assert peers._workload(peers._arguments(["--tiny"])).lr == 3e-3
    monkeypatch.setattr(peers.torch.cuda, "is_available", lambda: True)
    assert peers._workload(peers._arguments(["--shape", "llama-7b"])).lr == 2.5e-5
    assert peers._workload(peers._arguments([])).lr == width_lr(3072)
    assert peers._workload(peers._arguments(["--shape", "llama-7b", "--lr", "2e-4"])).lr == 2e-4


def test_every_system_warms_its_rate_up_over_the_run_unless_told_otherwise(monkeypatch):
    """At lr 3.3e-5 from the first step the 3B shape's loss rose from 12.44 to 14.6 in every system on
    the H200, and FSDP2's and DeepSpeed's losses left megacompile's (docs/gpu.md)."""
    warm = Workload(shape="tiny", lr=1e-3, lr_warmup=4)
    assert [warm.lr_at(k) for k in (1, 2, 3, 4, 5, 100)] == [2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3]
    assert Workload(shape="tiny", lr=1e-3).lr_at(1) == 1e-3
    monkeypatch.setattr(peers.torch.cuda, "is_available", lambda: True)
    assert peers._workload(peers._arguments([])).lr_warmup == 1 + 9
    assert peers._workload(peers._arguments(["--steps", "4", "--warmup", "2"])).lr_warmup == 6
    assert peers._workload(peers._arguments(["--lr-warmup", "0"])).lr_warmup == 0
    with pytest.raises(ArgumentError, match="--lr-warmup must be 0"):
        peers._workload(peers._arguments(["--lr-warmup", "-1"]))
    described = {**warm.to_dict(), "parameters": 1, "compute_dtype": "bf16"}
    text = markdown(_results(), FACTS, described, "x", BF16_LOSS_RTOL)
    assert "AdamW lr 0.001, rising linearly over the first 4 steps." in text
