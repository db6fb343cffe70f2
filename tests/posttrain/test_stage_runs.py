"""`megacompile train --config run.yaml` with stage: grpo and stage: dpo on a tiny Hugging Face
model: the log's figures are those of the rollouts and pairs the run saw, TensorBoard holds the same
figures, and the export is the trained policy, loadable by transformers."""
from __future__ import annotations

import json
import math
import os
import re

import pytest
import torch

from megacompile.cost.hardware import HardwareProfile
from megacompile.errors import ArgumentError
from megacompile.train import load, log, run
from tests.posttrain import stage_files
from tests.train import files
from tests.train.killed import TIMED


def _weights(folder: str) -> dict:
    import safetensors.torch
    return safetensors.torch.load_file(os.path.join(folder, "model.safetensors"))


def _export_is_the_trained_policy(export: str, model: str) -> None:
    from transformers import AutoModelForCausalLM
    loaded = AutoModelForCausalLM.from_pretrained(export)
    before = _weights(model)
    state = loaded.state_dict()
    trained = _weights(export)
    assert set(trained) == set(before)                                  # the policy's names, no `policy.`
    assert all(torch.equal(state[k], trained[k]) for k in trained)
    assert not all(torch.equal(before[k], trained[k]) for k in trained)     # it trained


def _board_holds_the_log(run_dir: str, rows: list[dict], columns: tuple) -> None:
    """Each of the stage's columns is a TensorBoard scalar (train/<column>, eval/<column less eval_>)
    at every step the CSV gives it a value, with that value."""
    board = files.board_scalars(run_dir)
    for column in columns:
        tag = f"eval/{column[5:]}" if column.startswith("eval_") else f"train/{column}"
        want = [(int(r["step"]), float(r[column])) for r in rows if r.get(column)]
        assert want and board[tag] == [(s, pytest.approx(v, rel=1e-6)) for s, v in want], (tag, board.get(tag))


# The cpu profile of an idle 2-core machine. Whether a copy with a cache would be quicker on a tiny
# model turns on the measured costs per call and per node, which a loaded machine measures otherwise:
# the run's advice is planned on these figures, not on whatever this machine measured.
IDLE_CPU = HardwareProfile("cpu (simulated device, measured)", 2**40, 6.5e10, 2.66e11, 2.66e11, 1.08e10, 1.08e10,
                           6.5e10, 1.2e9, 7.2e-6, matmul_efficiency=1.0, memory_efficiency=1.0, node_overhead_s=2.7e-4,
                           workspace_bytes=0, fragmentation=0.0, hidden_scratch=False)


def test_grpo_run_logs_the_rewards_of_its_rollouts_and_exports_the_policy(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("megacompile.cost.backend_profile.cached_cpu_profile", lambda: IDLE_CPU)
    work = stage_files.workspace(tmp_path)
    stage_files.CALLS.clear()
    config = files.run_yaml(str(tmp_path / "grpo.yaml"),
                            **stage_files.grpo(work, str(tmp_path / "run"), export=str(tmp_path / "export"),
                                               log=["csv", "tensorboard"]))
    result = run(load(config, []))
    assert result["steps"] == 2
    # The engine generator (the default): the run's start says what a copy with a cache would take.
    said = re.search(r"generator +hf \(a bfloat16 copy of the policy with a key-value cache\) would generate a "
                     r"rollout batch in about [0-9.]+ [mµu]?s, ([0-9.]+)x less than the engine generator's",
                     capsys.readouterr().out)
    assert said and float(said.group(1)) > 1.25
    rows = log.read(str(tmp_path / "run" / "log.csv"))
    assert len(stage_files.CALLS) == 2 == len(rows)                 # one rollout batch per step
    for row, call in zip(rows, stage_files.CALLS):
        assert len(call["completions"]) == 8
        # the record's other columns arrive beside each of its prompt's num_generations completions
        assert call["answer"] == [p.split()[-1] for p in call["prompts"]]
        assert call["prompts"][0::4] == call["prompts"][3::4] and call["prompts"][0] != call["prompts"][4]
        mine = torch.tensor(call["rewards"])
        assert float(row["rewards/starts_like_prompt/mean"]) == pytest.approx(mine.mean().item())
        fmt = float(row["rewards/format_check/mean"])
        assert float(row["reward"]) == pytest.approx(mine.mean().item() + 0.5 * fmt)
        assert float(row["clip_ratio"]) == 0.0          # one step per rollout: the ratio is 1
        assert 1 <= float(row["completions/min_length"]) <= float(row["completions/mean_length"]) \
            <= float(row["completions/max_length"]) <= 3
        assert "kl" not in row                          # beta 0: no KL term
    assert float(rows[0]["grad_norm"]) > 0
    _board_holds_the_log(str(tmp_path / "run"), rows, ("reward", "rewards/format_check/mean", "clip_ratio",
                                                       "completions/mean_length"))
    _export_is_the_trained_policy(str(tmp_path / "export"), work["model"])


def test_dpo_run_logs_margins_and_accuracy_and_evaluates_the_held_out_pairs(tmp_path):
    work = stage_files.workspace(tmp_path)
    config = files.run_yaml(str(tmp_path / "dpo.yaml"),
                            **stage_files.dpo(work, str(tmp_path / "run"), export=str(tmp_path / "export"),
                                              log=["csv", "tensorboard"]))
    run(load(config, []))
    rows = log.read(str(tmp_path / "run" / "log.csv"))
    assert [r["step"] for r in rows] == ["1", "2", "3"]
    first = rows[0]
    # step 1 starts from the reference: every implicit reward 0, the loss log 2
    assert float(first["reward_margin"]) == 0.0 and float(first["loss"]) == pytest.approx(0.693147, abs=1e-6)
    for r in rows:
        assert float(r["reward_margin"]) == pytest.approx(float(r["rewards_chosen"]) - float(r["rewards_rejected"]),
                                                          abs=1e-6)
        assert float(r["preference_accuracy"]) in (0.0, 0.5, 1.0)
        assert float(r["logps_chosen"]) < 0 and float(r["logps_rejected"]) < 0      # summed over each completion
    assert [bool(r["eval_loss"]) for r in rows] == [False, True, True]      # eval_every 2, and the last step
    assert all(float(r["eval_logps_chosen"]) < 0 for r in rows if r["eval_loss"])
    assert float(first["grad_norm"]) > 0
    assert os.path.isfile(str(tmp_path / "run" / "reference_logps.pt"))
    _board_holds_the_log(str(tmp_path / "run"), rows, ("reward_margin", "preference_accuracy", "eval_reward_margin"))
    _export_is_the_trained_policy(str(tmp_path / "export"), work["model"])


def test_simpo_and_orpo_train_the_policy_alone_named_as_llamafactory_names_them(tmp_path, capsys):
    work = stage_files.workspace(tmp_path)
    settings = {k: v for k, v in stage_files.dpo(work, "").items() if k != "beta"}
    first = {}
    for loss, own in (("simpo", "simpo"), ("orpo", "orpo_per_pair")):    # LlamaFactory's orpo: NLL per pair
        runs = {}
        for name, keys in (("lf", {"pref_loss": loss, "pref_beta": 2.0}), ("own", {"loss_type": own, "beta": 2.0})):
            run_dir = str(tmp_path / f"{loss}_{name}")
            run(load(files.run_yaml(str(tmp_path / f"{name}.yaml"), **{**settings, "run_dir": run_dir, **keys}), []))
            runs[name] = [{k: v for k, v in r.items() if k not in TIMED}
                          for r in log.read(os.path.join(run_dir, "log.csv"))]
            assert not os.path.exists(os.path.join(run_dir, "reference_logps.pt"))      # no reference pass
        assert "no reference (the loss reads the policy alone)" in capsys.readouterr().out
        assert runs["lf"] == runs["own"] and len(runs["lf"]) == 3
        first[loss] = float(runs["own"][0]["loss"])
        # rewards are beta x log-probability per token: an untrained model's is about -log(vocabulary)
        vocab = len(json.load(open(os.path.join(work["model"], "tokenizer.json")))["model"]["vocab"])
        assert -2.0 * 2 * math.log(vocab) < float(runs["own"][0]["rewards_chosen"]) < 0
        for row in runs["own"]:     # TRL's logps/chosen and /rejected: per token here, the rewards over beta
            for side in ("chosen", "rejected"):
                assert float(row[f"logps_{side}"]) == pytest.approx(float(row[f"rewards_{side}"]) / 2.0, rel=1e-5)
        if loss == "orpo":      # LlamaFactory's two terms, logged by its names: the loss is their sum
            for row in runs["own"]:
                assert float(row["loss"]) == pytest.approx(float(row["sft_loss"]) + 2.0 * float(row["odds_ratio_loss"]),
                                                           rel=1e-5)
    assert first["orpo"] > first["simpo"] > 0        # orpo adds the chosen tokens' NLL


def _runs_with_and_without_evaluation(tmp_path, **more) -> tuple[list, tuple, tuple]:
    """Three held-out prompts; a GRPO run without evaluation and one evaluating every step with
    `more`: (held, (plain log, its reward calls), (evaluated log, its reward calls))."""
    work = stage_files.workspace(tmp_path)
    held = [s for s in files.SENTENCES[:3]]
    with open(tmp_path / "held.jsonl", "w") as f:
        for s in held:
            f.write(json.dumps({"prompt": s, "answer": s.split()[-1]}) + "\n")
    runs = {}
    for name, keys in (("plain", {}), ("evaluated", {"eval": str(tmp_path / "held.jsonl"), "eval_every": 1, **more})):
        stage_files.CALLS.clear()
        config = files.run_yaml(str(tmp_path / f"{name}.yaml"), **stage_files.grpo(work, str(tmp_path / name), **keys))
        run(load(config, []))
        runs[name] = (log.read(str(tmp_path / name / "log.csv")), list(stage_files.CALLS))
    return held, runs["plain"], runs["evaluated"]


def test_grpo_evaluates_held_out_prompts_greedily_and_leaves_the_rollouts_as_they_were(tmp_path):
    held, (plain, plain_calls), (evaluated, calls) = _runs_with_and_without_evaluation(tmp_path)
    # each step: its rollout, then the evaluation of the three held-out prompts (batch 8: one call)
    rollouts, evals = calls[0::2], calls[1::2]
    assert len(rollouts) == len(evals) == 2 and [r["prompts"] for r in evals] == [held, held]
    assert rollouts == plain_calls            # evaluating drew nothing from the sampler
    for row, plain_row, call in zip(evaluated, plain, evals):
        assert row["reward"] == plain_row["reward"] and row["loss"] == plain_row["loss"]
        mine = torch.tensor(call["rewards"])
        assert float(row["eval_rewards/starts_like_prompt/mean"]) == pytest.approx(mine.mean().item())
        fmt = float(row["eval_rewards/format_check/mean"])
        assert float(row["eval_reward"]) == pytest.approx(mine.mean().item() + 0.5 * fmt)
        assert 1 <= float(row["eval_completions/mean_length"]) <= 3
        assert "eval_reward" not in plain_row


@pytest.mark.parametrize("merge", [False, True], ids=["adapter", "merged"])
def test_a_lora_dpo_run_starts_from_its_reference_and_exports_the_trained_adapter(tmp_path, merge):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    work = stage_files.workspace(tmp_path)
    export = str(tmp_path / "export")
    config = files.run_yaml(str(tmp_path / "dpo.yaml"), **stage_files.dpo(
        work, str(tmp_path / "run"), export=export, finetuning_type="lora", lora_rank=4, lora_target="all",
        merge_adapter=merge))
    run(load(config, []))
    rows = log.read(str(tmp_path / "run" / "log.csv"))
    # the adapters start at zero: the policy is the reference, every implicit reward 0, the loss log 2
    assert float(rows[0]["reward_margin"]) == 0.0 and float(rows[0]["loss"]) == pytest.approx(0.693147, abs=1e-6)
    assert float(rows[-1]["loss"]) != float(rows[0]["loss"])
    base = AutoModelForCausalLM.from_pretrained(work["model"])
    ids = torch.tensor([[5, 9, 12, 7, 3]])
    before = base(input_ids=ids).logits
    if merge:
        assert not os.path.isfile(os.path.join(export, "adapter_config.json"))
        trained = AutoModelForCausalLM.from_pretrained(export)
    else:
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(export))
        assert not os.path.isfile(os.path.join(export, "model.safetensors"))
        trained = PeftModel.from_pretrained(base, export)
        # the base under the adapter is the model as loaded: the adapter alone moved
        assert torch.equal(trained.get_base_model().model.embed_tokens.weight,
                           _weights(work["model"])["model.embed_tokens.weight"])
    assert not torch.allclose(trained(input_ids=ids).logits, before)


def test_a_lora_grpo_run_with_a_kl_term_trains_the_adapter_alone(tmp_path):
    work = stage_files.workspace(tmp_path)
    export = str(tmp_path / "export")
    config = files.run_yaml(str(tmp_path / "grpo.yaml"), **stage_files.grpo(
        work, str(tmp_path / "run"), export=export, finetuning_type="lora", lora_rank=4, beta=0.1))
    run(load(config, []))
    rows = log.read(str(tmp_path / "run" / "log.csv"))
    # the reference is the model as loaded, and so is the policy at the first rollout: no divergence
    assert float(rows[0]["kl"]) == 0.0 and float(rows[0]["grad_norm"]) > 0
    assert float(rows[1]["kl"]) > 0.0         # after one step the adapter moved the policy
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(export))


def test_lora_dropout_is_refused_for_a_post_training_stage_that_keeps_dropout(tmp_path):
    from megacompile.errors import ArgumentError
    work = stage_files.workspace(tmp_path)
    config = files.run_yaml(str(tmp_path / "dpo.yaml"), **stage_files.dpo(
        work, str(tmp_path / "run"), finetuning_type="lora", lora_rank=4, lora_dropout=0.1, disable_dropout=False))
    with pytest.raises(ArgumentError, match="stage dpo with finetuning_type lora takes lora_dropout 0.*or "
                                            "disable_dropout: true"):
        load(config, [])
    assert not os.path.exists(tmp_path / "run")
    # stage dpo's default, as TRL's: the adapters' dropout goes with the model's
    config = files.run_yaml(str(tmp_path / "dpo.yaml"), **stage_files.dpo(
        work, str(tmp_path / "run"), finetuning_type="lora", lora_rank=4, lora_dropout=0.1))
    assert load(config, []).disable_dropout is True


def test_a_resumed_dpo_run_refuses_a_reference_made_for_other_tokens(tmp_path):
    """Reference row i is pair i's: a resume whose pairs tokenise otherwise (a tokenizer or chat template
    changed with the data files untouched) would give every pair another's reference, so it is refused;
    the same pairs resume."""
    from megacompile.errors import ArgumentError
    work = stage_files.workspace(tmp_path)
    settings = stage_files.dpo(work, str(tmp_path / "run"), steps=1, save_every=1, resume="auto")
    run(load(files.run_yaml(str(tmp_path / "a.yaml"), **settings), []))
    path = str(tmp_path / "run" / "reference_logps.pt")
    kept = torch.load(path)
    assert set(kept["tokens"]) == {"train", "eval"}
    run(load(files.run_yaml(str(tmp_path / "b.yaml"), **{**settings, "steps": 2}), []))    # the same pairs
    assert [r["step"] for r in log.read(str(tmp_path / "run" / "log.csv"))] == ["1", "2"]
    torch.save({**kept, "tokens": {**kept["tokens"], "train": "0" * 64}}, path)
    with pytest.raises(ArgumentError, match="reference log-probabilities of other tokens than this run's train pairs"):
        run(load(files.run_yaml(str(tmp_path / "c.yaml"), **{**settings, "steps": 3}), []))


def test_grpo_samples_num_generations_eval_of_each_held_out_prompt_and_leaves_the_rollouts_as_they_were(tmp_path):
    held, (plain, plain_calls), (evaluated, calls) = _runs_with_and_without_evaluation(tmp_path,
                                                                                    num_generations_eval=4)
    # batch 8 rows a call, 4 completions of each prompt: two calls of two prompts, the second's
    # second prompt the first again, left out
    rollouts, evals = calls[0::2], calls[1::2]
    assert len(rollouts) == len(evals) == 2
    assert rollouts == plain_calls            # the sampler's state was put back after evaluating
    for row, plain_row, call in zip(evaluated, plain, evals):
        assert call["prompts"] == [p for p in held for _ in range(4)]
        groups = [call["completions"][i:i + 4] for i in range(0, 12, 4)]
        assert any(len(set(g)) > 1 for g in groups)         # sampled, not greedy
        assert row["reward"] == plain_row["reward"] and row["loss"] == plain_row["loss"]
        mine = torch.tensor(call["rewards"])
        assert float(row["eval_rewards/starts_like_prompt/mean"]) == pytest.approx(mine.mean().item())
        assert float(row["eval_rewards/starts_like_prompt/std"]) == pytest.approx(mine.std().item())
        fmt = float(row["eval_rewards/format_check/mean"])
        assert float(row["eval_reward"]) == pytest.approx(mine.mean().item() + 0.5 * fmt)
        assert 0.0 <= float(row["eval_frac_reward_zero_std"]) <= 1.0 and "eval_reward_std" in row


@pytest.mark.parametrize("value, message", [(3, "must divide batch 8"), (0, "whole number >= 1"),
                                            (True, "whole number >= 1")])
def test_num_generations_eval_that_cannot_fill_whole_calls_is_refused(tmp_path, value, message):
    work = stage_files.workspace(tmp_path)
    config = files.run_yaml(str(tmp_path / "bad.yaml"), **stage_files.grpo(work, str(tmp_path / "run"),
                                                                          num_generations_eval=value))
    with pytest.raises(ArgumentError, match=message):
        load(config, [])
    assert not os.path.exists(tmp_path / "run")


def test_a_mixture_of_experts_folder_in_the_hubs_layout_trains_under_a_stage_objective(tmp_path):
    """A Mixtral folder stores one tensor per expert, which transformers 5 fuses on load; under stage
    dpo the engine trains the objective around the model, and the files are placed into the fused
    experts by the model's own conversion all the same: at a step of almost nothing the export is the
    folder's weights, written back per expert."""
    from safetensors.torch import load_file
    from tests.train.test_router_loss import _mixtral_dir
    work = {"model": _mixtral_dir(str(tmp_path / "mixtral")), "pairs": stage_files.pairs(str(tmp_path / "p.jsonl"))}
    c = load(files.run_yaml(str(tmp_path / "r.yaml"), **stage_files.dpo(work, str(tmp_path / "run"), steps=1,
                                                                         lr=1e-12, export=str(tmp_path / "out"),
                                                                         export_dtype="float32")), [])
    run(c)
    folder = load_file(os.path.join(work["model"], "model.safetensors"))
    exported = load_file(os.path.join(str(tmp_path / "out"), "model.safetensors"))
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in folder and set(exported) == set(folder)
    for key, w in folder.items():
        torch.testing.assert_close(exported[key], w.float(), rtol=1e-6, atol=1e-9)
