"""The main job: `megacompile train` plans, prints the summary, trains, and writes its run directory."""
from __future__ import annotations

import importlib.util
import json

from megacompile.cli import main


def test_train_command_runs_and_writes_its_run_directory(tmp_path, capsys):
    run = tmp_path / "run"
    code = main(["train", "--steps", "3", "--batch", "2", "--seq", "32", "--dim", "64", "--layers", "2",
                 "--heads", "4", "--kv-heads", "2", "--ffn", "128", "--device", "cpu", "--run-dir", str(run),
                 "--log-every", "1"])
    assert code == 0
    out = capsys.readouterr().out
    assert "device peak" in out and "host memory" in out and "moved per step" in out
    assert out.index("megacompile plan") < out.index("step     1/3")       # the plan comes first
    assert "tok/s" in out
    log = json.loads((run / "train_log.json").read_text())
    assert len(log["steps"]) == 3
    result = log["result"]
    assert result["measured_device_peak_bytes"] <= result["budget_bytes"]
    plan = json.loads((run / "plan" / "plan.json").read_text())
    assert plan["device_peak_bytes"] == result["predicted_device_peak_bytes"]
    assert (run / "plan" / "plan.txt").read_text().count("prefetch") >= 4
    # the last step's pictures: its Chrome trace, and device and host memory against the budget
    if importlib.util.find_spec("matplotlib") is None:
        assert "memory picture not written" in out and "pip install 'megacompile[plot]'" in out
    else:
        assert (run / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {e["pid"] for e in json.loads((run / "step.json").read_text())["traceEvents"]} == {1, 2}


def test_train_command_reports_a_budget_that_cannot_fit(capsys):
    code = main(["train", "--steps", "1", "--dim", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2",
                 "--ffn", "128", "--device", "cpu", "--hbm-budget", "0.00001"])
    assert code == 2
    assert "smallest budget that fits" in capsys.readouterr().err
