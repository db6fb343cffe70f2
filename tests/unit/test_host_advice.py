"""A plan refused for host RAM names the changes that fit, in numbers passed straight back: the
disk budget for a disk tier, and LoRA's frozen base in the compute dtype (planner/host_advice.py)."""
from __future__ import annotations

import json
import re

from megacompile.cli import main

SMALL_LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 4096,
               "max_position_embeddings": 256, "tie_word_embeddings": False}


def _args(tmp_path) -> list[str]:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMALL_LLAMA))
    return ["plan", "--config", str(config), "--hbm-budget", "1", "--batch", "2", "--seq", "64",
            "--host-budget", "0.03", "--json"]


def test_the_refusal_names_a_disk_budget_that_fits_and_it_does(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MEGACOMPILE_TIER_PIECE", str(1 << 16))     # a pool of 2 MiB for this small model
    args = _args(tmp_path)
    assert main(args) == 3
    refusal = capsys.readouterr().err
    advised = re.search(r"--nvme-budget (\d+) puts exp_avg and exp_avg_sq on disk", refusal)
    assert advised, refusal
    assert re.search(r"which take \d+\.\d\d MiB; raise", refusal), refusal      # one figure, not two
    assert main(args + ["--nvme-budget", advised.group(1)]) == 0
    assert json.loads(capsys.readouterr().out)["host_placement"] == "exp_avg and exp_avg_sq on disk"


def test_the_refusal_names_lora_and_what_its_base_takes_and_it_fits(tmp_path, capsys):
    args = _args(tmp_path)
    assert main(args) == 3
    refusal = capsys.readouterr().err
    base = re.search(r"--lora-rank R; a PEFT model in compile\(\)\): the base in bfloat16 takes ([0-9.]+) MiB "
                     r"of RAM, within the host budget", refusal)
    assert base, refusal
    params = json.loads(json.dumps(SMALL_LLAMA))
    n = 2 * params["vocab_size"] * params["hidden_size"] + params["num_hidden_layers"] * (
        4 * params["hidden_size"] ** 2 + 3 * params["hidden_size"] * params["intermediate_size"]
        + 2 * params["hidden_size"]) + params["hidden_size"]
    assert abs(float(base.group(1)) - 2 * n / 2**20) < 0.01
    assert main(args + ["--lora-rank", "4"]) == 0
    capsys.readouterr()


def test_a_lora_plan_refused_is_not_told_to_take_lora(tmp_path, capsys):
    args = _args(tmp_path)
    args[args.index("--host-budget") + 1] = "0.001"
    assert main(args + ["--lora-rank", "4"]) == 3
    assert "--lora-rank" not in capsys.readouterr().err


def test_the_refusal_shows_the_plan_at_the_budgets_it_advises(tmp_path, capsys, monkeypatch):
    """Refused for host RAM, the reader still learns whether the device fits and how fast a step
    runs: the plan at the disk budget advised beside the host given (`with room`, JSON with_room)."""
    monkeypatch.setenv("MEGACOMPILE_TIER_PIECE", str(1 << 16))
    args = _args(tmp_path)
    assert main(args) == 3
    captured = capsys.readouterr()
    room = json.loads(captured.out)["with_room"]
    line = next(x for x in captured.err.splitlines() if x.startswith("  with room"))
    assert room["fits"] and room["host_budget_gib"] == 0.03 and room["nvme_budget_gib"] >= 1
    assert f"--host-budget 0.03 --nvme-budget {room['nvme_budget_gib']}: device peak" in line and "tok/s" in line
    assert main(args + ["--nvme-budget", str(room["nvme_budget_gib"])]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["predicted_step_s"] == room["predicted_step_s"]
    assert planned["device_peak_bytes"] == room["device_peak_bytes"]
