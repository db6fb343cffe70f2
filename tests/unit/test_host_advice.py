"""A plan refused for host RAM names the changes that fit, in numbers passed straight back: the
disk budget for a disk tier, and LoRA's frozen base in the compute dtype (planner/host_advice.py),
with LoRA planned whole in a `with LoRA` line (the adapters' state on top of the base)."""
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


def _base_bytes() -> int:
    """SMALL_LLAMA's weights in bf16: the base a LoRA run holds."""
    p = SMALL_LLAMA
    n = 2 * p["vocab_size"] * p["hidden_size"] + p["num_hidden_layers"] * (
        4 * p["hidden_size"] ** 2 + 3 * p["hidden_size"] * p["intermediate_size"] + 2 * p["hidden_size"])
    n += p["hidden_size"]
    return 2 * n


def test_the_refusal_names_lora_with_what_its_base_takes_and_plans_it(tmp_path, capsys):
    args = _args(tmp_path)
    assert main(args) == 3
    captured = capsys.readouterr()
    base = re.search(r"--lora-rank R; a PEFT model in compile\(\)\): the base alone in bfloat16 takes ([0-9.]+) MiB "
                     r"of RAM, leaving [0-9.]+ MiB of the host budget for the adapters' AdamW state", captured.err)
    assert base, captured.err
    assert 0 <= float(base.group(1)) * 2**20 - _base_bytes() < 0.01 * 2**20      # rounded up
    lora = json.loads(captured.out)["with_lora"]
    line = next(x for x in captured.err.splitlines() if x.startswith("  with LoRA"))
    assert lora["fits"] and lora["lora_rank"] == 8 and line.startswith("  with LoRA      --lora-rank 8: device peak")
    assert main(args + ["--lora-rank", "8"]) == 0
    assert json.loads(capsys.readouterr().out)["predicted_step_s"] == lora["predicted_step_s"]


def test_lora_named_beside_a_base_that_leaves_too_little_is_planned_where_it_fits(tmp_path, capsys):
    """A base within the host budget is no promise: the adapters' state comes on top. The refusal
    does not say LoRA fits; its `with LoRA` line plans it at the host budget its own refusal names,
    and that budget, given back, fits."""
    args = _args(tmp_path)
    args[args.index("--host-budget") + 1] = f"{(_base_bytes() + 2**16) / 2**30:.6f}"
    assert main(args) == 3
    captured = capsys.readouterr()
    assert "within the host budget" not in captured.err
    assert re.search(r"the base alone in bfloat16 takes [0-9.]+ MiB of RAM, leaving [0-9.]+ KiB of the host budget",
                     captured.err), captured.err
    assert main(args + ["--lora-rank", "8"]) == 3      # the base fits, the adapters' state beside it does not
    capsys.readouterr()
    lora = json.loads(captured.out)["with_lora"]
    line = next(x for x in captured.err.splitlines() if x.startswith("  with LoRA"))
    assert lora["fits"] and f"--lora-rank 8 --host-budget {lora['host_budget_gib']:.10g}: device peak" in line
    args[args.index("--host-budget") + 1] = f"{lora['host_budget_gib']:.10g}"
    assert main(args + ["--lora-rank", "8"]) == 0


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


def test_with_a_disk_tier_the_refusal_names_first_the_ram_it_leaves(tmp_path, capsys, monkeypatch):
    """Refused with --nvme-budget given, the first figure is the host budget that fits beside the
    disk tier, not the RAM the state would take with no disk at all."""
    monkeypatch.setenv("MEGACOMPILE_TIER_PIECE", str(1 << 16))
    args = _args(tmp_path)
    args[args.index("--host-budget") + 1] = "0.001"
    assert main(args + ["--nvme-budget", "1"]) == 3
    captured = capsys.readouterr()
    refusal = json.loads(captured.out)
    first = re.search(r"cannot hold the host state even with the disk tier: the smallest host budget that fits is "
                      r"([0-9.]+) GiB \(exp_avg, exp_avg_sq and fp32 masters on disk\), [0-9.]+ MiB with all of it "
                      r"in RAM; raise", captured.err)
    assert first, captured.err
    assert 0 <= float(first.group(1)) * 2**30 - refusal["smallest_host_budget_bytes"] < 0.01 * 2**30


def test_under_updates_as_gradients_land_the_disk_tier_is_advised_with_updates_at_commit(tmp_path, capsys,
                                                                                          monkeypatch):
    """Updates started as gradients land take no disk tier (compile() refuses nvme_dir with them, and
    plan() nvme_budget): the refusal names the disk budget with updates at commit, the `with room` line
    plans it so, and that plan is what the flags it names give."""
    monkeypatch.setenv("MEGACOMPILE_TIER_PIECE", str(1 << 16))
    args = _args(tmp_path) + ["--updates", "as_gradients_land"]
    assert main(args) == 3
    captured = capsys.readouterr()
    assert re.search(r"--nvme-budget \d+ puts exp_avg and exp_avg_sq on disk, .* \(with updates='at_commit'",
                     captured.err), captured.err
    line = next(x for x in captured.err.splitlines() if x.startswith("  with room"))
    room = json.loads(captured.out)["with_room"]
    assert f"--nvme-budget {room['nvme_budget_gib']} --updates at_commit: device peak" in line
    assert main(args + ["--nvme-budget", str(room["nvme_budget_gib"])]) == 2
    assert "not built for the disk tier (nvme_budget)" in capsys.readouterr().err
    args[args.index("as_gradients_land")] = "at_commit"
    assert main(args + ["--nvme-budget", str(room["nvme_budget_gib"])]) == 0
    assert json.loads(capsys.readouterr().out)["predicted_step_s"] == room["predicted_step_s"]
