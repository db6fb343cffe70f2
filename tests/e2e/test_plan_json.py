"""`megacompile plan --json`: stdout holds exactly one JSON document, so `| jq` reads it; the
human text (the summary, the verdict) goes to stderr. Fits, does not fit, and --stage alike."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megacompile.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 500}


def _config(tmp_path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    return str(path)


@pytest.mark.slow      # a process of its own: ~15 s on 2 busy cores
def test_stdout_is_one_json_document_for_a_pipe(tmp_path):
    """A real process and pipe, as `megacompile plan ... --json | jq .fits` runs it."""
    done = subprocess.run([sys.executable, "-m", "megacompile", "plan", "--config", _config(tmp_path),
                           "--hbm-budget", "1", "--batch", "2", "--seq", "64", "--host-budget", "4", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    plan = json.loads(done.stdout)
    assert plan["fits"] is True and plan["budget_bytes"] == 2 ** 30
    assert "verdict        fits" in done.stderr


def test_a_plan_that_fits_one_that_does_not_and_a_stage_plan(tmp_path, capsys):
    config = _config(tmp_path)
    base = ["plan", "--config", config, "--batch", "2", "--seq", "64", "--json"]
    assert main([*base, "--hbm-budget", "1", "--host-budget", "4"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["fits"] is True and "verdict        fits" in captured.err
    assert main([*base, "--hbm-budget", "1", "--host-budget", "0.000001"]) == 3     # the host check's own path
    captured = capsys.readouterr()
    assert json.loads(captured.out)["fits"] is False and "does NOT fit: the host RAM budget" in captured.err
    assert main(["plan", "--config", config, "--hbm-budget", "1", "--host-budget", "4", "--stage", "dpo",
                 "--seq", "64", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["fits"] is True and "megacompile plan --stage dpo" in captured.err


def test_a_host_refusal_holds_the_numbers_a_script_needs(tmp_path, capsys):
    """Refused for host RAM: the smallest host budget that fits, the parameters and each placement's
    tiers as fields, not only in the prose error; planning at that smallest budget fits."""
    config = _config(tmp_path)
    base = ["plan", "--config", config, "--hbm-budget", "1", "--batch", "2", "--seq", "64", "--json"]
    assert main([*base, "--host-budget", "0.000001", "--nvme-budget", "1"]) == 3
    refused = json.loads(capsys.readouterr().out)
    placements = refused["host_placements"]
    assert placements[0]["placement"] == "all in host RAM" and len(placements) == 3
    assert refused["smallest_host_budget_bytes"] == min(p["ram_bytes"] for p in placements)
    assert refused["trainable_params"] > 0
    assert all(sum(t["bytes"] for t in p["tiers"].values() if t["where"] == "disk") == p["disk_bytes"]
               for p in placements)
    smallest = refused["smallest_host_budget_bytes"] / 2 ** 30
    assert main([*base, "--host-budget", repr(smallest), "--nvme-budget", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["trainable_params"] == refused["trainable_params"]
