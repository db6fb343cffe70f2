"""TRL's log_completions under stage grpo: each rollout's completions in run_dir/completions.jsonl
with their step, prompt, text, rewards and advantage, the ones asked for printed; a resumed run keeps
the lines up to its checkpoint (a line a kill cut short goes too), so each rollout is there once."""
from __future__ import annotations

import json
import math

import pytest

from megacompile.train import load, run
from megacompile.train.stages.completions_log import FILE, CompletionsLog
from megacompile.train import log
from tests.posttrain import stage_files
from tests.train import files


def test_a_grpo_run_writes_every_completion_with_its_rewards_and_prints_those_asked_for(tmp_path, capsys):
    work = stage_files.workspace(tmp_path)
    stage_files.CALLS.clear()
    config = files.run_yaml(str(tmp_path / "run.yaml"), **stage_files.grpo(
        work, str(tmp_path / "run"), log_completions=True, num_completions_to_print=3))
    run(load(config, []))
    rows = [json.loads(line) for line in open(tmp_path / "run" / FILE)]
    assert [r["step"] for r in rows] == [1] * 8 + [2] * 8          # a rollout of 8 completions a step
    for call, step in zip(stage_files.CALLS, (1, 2)):
        mine = [r for r in rows if r["step"] == step]
        assert [r["completion"] for r in mine] == call["completions"]
        assert [r["prompt"] for r in mine] == call["prompts"]
        assert [r["rewards"]["starts_like_prompt"] for r in mine] == call["rewards"]
        # the weighted sum of the two functions (weights 1 and 0.5), and advantages within each group of 4
        assert all(r["reward"] == pytest.approx(r["rewards"]["starts_like_prompt"] + 0.5 * r["rewards"]["format_check"])
                   for r in mine)
        for g in range(0, 8, 4):
            assert sum(r["advantage"] for r in mine[g:g + 4]) == pytest.approx(0, abs=1e-5)
    printed = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("completion ")]
    assert len(printed) == 6 and "step 1 | reward " in printed[0]


def test_a_resume_keeps_the_lines_up_to_its_checkpoint(tmp_path):
    log = CompletionsLog(str(tmp_path), 0, shown=0)
    for step in (1, 2, 3):
        log.write(step, ["p", [{"role": "user", "content": "q"}]], ["a", "b"], [1.0, math.nan], {"f": [1.0, math.nan]},
                  [0.5, -0.5])
    with open(tmp_path / FILE, "a") as f:
        f.write('{"step": 4, "prom')                               # a kill in the middle of a write
    CompletionsLog(str(tmp_path), 2, shown=0)
    rows = [json.loads(line) for line in open(tmp_path / FILE)]
    assert [r["step"] for r in rows] == [1, 1, 2, 2]
    assert rows[1]["reward"] is None and rows[1]["rewards"] == {"f": None}       # not scored: null, not NaN
    assert rows[1]["prompt"] == [{"role": "user", "content": "q"}]
    CompletionsLog(str(tmp_path), 0, shown=0)                         # a new run starts the file empty
    assert open(tmp_path / FILE).read() == ""


def test_a_gdpo_run_trains_the_decoupled_advantages_of_the_logged_rewards(tmp_path):
    import torch
    from megacompile.posttrain import decoupled_advantages
    work = stage_files.workspace(tmp_path)
    config = files.run_yaml(str(tmp_path / "run.yaml"), **stage_files.grpo(
        work, str(tmp_path / "run"), steps=1, log_completions=True, num_completions_to_print=0,
        multi_objective_aggregation="normalize_then_sum"))
    run(load(config, []))
    rows = [json.loads(line) for line in open(tmp_path / "run" / FILE)]
    nan = float("nan")
    per = torch.tensor([[nan if r["rewards"][f] is None else r["rewards"][f]
                         for f in ("starts_like_prompt", "format_check")] for r in rows])
    want = decoupled_advantages(per, [1.0, 0.5], 4)
    assert [r["advantage"] for r in rows] == pytest.approx(want.tolist(), abs=1e-6)


def test_trl_116_log_metric_goes_to_log_csv_and_log_extra_to_the_completions(tmp_path, capsys):
    work = stage_files.workspace(tmp_path)
    config = files.run_yaml(str(tmp_path / "run.yaml"), **stage_files.grpo(
        work, str(tmp_path / "run"), steps=1, log_completions=True, num_completions_to_print=1,
        reward_funcs=["tests.posttrain.trl_rewards:with_metric"], reward_weights=[1.0],
        eval_fraction=0.2, eval_every=1))
    run(load(config, []))
    rows = [json.loads(line) for line in open(tmp_path / "run" / FILE)]
    chars = [r["rewards"]["with_metric"] for r in rows]
    assert [r["extra"] for r in rows] == [{"chars": str(x)} for x in chars]
    [row] = log.read(str(tmp_path / "run" / "log.csv"))
    assert float(row["mean_chars"]) == pytest.approx(sum(chars) / len(chars))      # under the name TRL logs
    assert float(row["eval_mean_chars"]) == pytest.approx(float(row["eval_reward"]))   # an evaluation's: eval_
    printed = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("completion ")]
    assert f"| chars {chars[0]} |" in printed[0]
