"""The main job: `megacompile train` plans, prints the summary, trains, and writes its run directory."""
from __future__ import annotations

import importlib.util
import json

from megacompile.cli import main
from megacompile.train import log

TINY = ["bundled_model.dim=64", "bundled_model.layers=2", "bundled_model.heads=4", "bundled_model.kv_heads=2",
        "bundled_model.ffn=128", "device=cpu"]


def test_train_command_runs_and_writes_its_run_directory(tmp_path, capsys):
    run = tmp_path / "run"
    code = main(["train", "steps=3", "batch=2", "seq=32", *TINY, f"run_dir={run}", "log_every=1"])
    assert code == 0
    out = capsys.readouterr().out
    assert "device peak" in out and "host memory" in out and "moved per step" in out
    assert out.index("megacompile plan") < out.index("step     1/3")       # the plan comes first
    assert "tok/s" in out
    rows = log.read(str(run / "log.csv"))
    assert [r["step"] for r in rows] == ["1", "2", "3"]
    # engine.last_step's figures: the embedded default warms up over 20 steps to 3e-3
    assert [float(r["lr"]) for r in rows] == [3e-3 * s / 20 for s in (1, 2, 3)]
    assert all(int(r["tokens"]) == 2 * 32 and float(r["seconds"]) > 0 for r in rows)
    assert all(int(r["device_peak_bytes"]) <= int(r["predicted_device_peak_bytes"]) for r in rows)
    plan = json.loads((run / "plan" / "plan.json").read_text())
    assert plan["device_peak_bytes"] == int(rows[0]["predicted_device_peak_bytes"])
    assert plan["measured_device_peak_bytes"] == int(rows[0]["device_peak_bytes"])   # added after the first step
    assert (run / "plan" / "plan.txt").read_text().count("prefetch") >= 4
    assert (run / "checkpoints" / "step-000003" / "COMMITTED").exists()
    # the last step's pictures: its Chrome trace, and device and host memory against the budget
    if importlib.util.find_spec("matplotlib") is None:
        assert "memory picture not written" in out and "pip install 'megacompile[plot]'" in out
    else:
        assert (run / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {e["pid"] for e in json.loads((run / "step.json").read_text())["traceEvents"]} == {1, 2}


def test_train_command_reports_a_budget_that_cannot_fit(tmp_path, capsys):
    code = main(["train", "steps=1", *TINY, "hbm_budget=0.00001", f"run_dir={tmp_path / 'run'}"])
    assert code == 2
    assert "smallest budget that fits" in capsys.readouterr().err
