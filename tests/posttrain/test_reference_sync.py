"""TRL's sync_ref_model under stage dpo and grpo (TR-DPO's reference updates): every
ref_model_sync_steps steps the reference becomes (1 - alpha) reference + alpha policy, bit for bit
TRL's arithmetic on the float32 masters; the loss (DPO) or the KL term (GRPO) reads the updated
reference from the next step on; and a run resumed between updates writes the uninterrupted run's
log.csv, from the update kept in the run folder."""
from __future__ import annotations

import glob
import json
import os
import shutil

import pytest
from safetensors.torch import load_file

from megacompile.errors import ArgumentError
from megacompile.train import load, log, run
from tests.posttrain import stage_files
from tests.train import files
from tests.train.killed import TIMED      # the measured columns, which differ run to run



def _settings(work, name: str, stage: str = "grpo", **more) -> dict:
    keys = {"sync_ref_model": True, "ref_model_sync_steps": 2, "ref_model_mixup_alpha": 0.5, "steps": 4,
            "save_every": 2, **more}
    if stage == "dpo":
        return stage_files.dpo(work, name, **{"eval_every": 1, **keys})
    return stage_files.grpo(work, name, **{"beta": 0.05, **keys})


def _masters(checkpoint: str) -> dict:
    found = {}
    for path in glob.glob(os.path.join(checkpoint, "owner-*.safetensors")):
        found.update({k[len("master/"):]: t for k, t in load_file(path).items() if k.startswith("master/")})
    return found


def _rows(path: str) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMED} for r in log.read(path)]


@pytest.mark.parametrize("stage", [pytest.param("grpo", marks=pytest.mark.slow), "dpo"])
def test_the_reference_is_mixed_with_the_policy_every_sync_steps_as_trl_mixes_it(tmp_path, stage):
    work = stage_files.workspace(tmp_path)
    run(load(files.run_yaml(str(tmp_path / "sync.yaml"), **_settings(work, str(tmp_path / "sync"), stage)), []))
    run(load(files.run_yaml(str(tmp_path / "fixed.yaml"), **_settings(work, str(tmp_path / "fixed"), stage,
                                                                       sync_ref_model=False)), []))
    run_dir = tmp_path / "sync"
    assert sorted(os.listdir(run_dir / "reference")) == ["step-000002.safetensors", "step-000004.safetensors"]
    (loaded,) = glob.glob(os.path.join(work["model"], "*.safetensors"))
    before = {f"policy.{k}": t for k, t in load_file(loaded).items()}
    for step in (2, 4):
        reference = load_file(str(run_dir / "reference" / f"step-{step:06d}.safetensors"))
        policy = _masters(str(run_dir / "checkpoints" / f"step-{step:06d}"))
        assert set(reference) <= set(before) and len(reference) >= len(policy) > 10
        for key, mixed in reference.items():
            if key in policy:       # TRL's sync_target_model: target.mul_(1 - alpha).add_(policy, alpha=alpha)
                expected = before[key].mul(0.5).add_(policy[key], alpha=0.5)
                assert mixed.equal(expected), key
        before = reference
    # the loss reads the reference: alike until the first update (DPO's reference log-probabilities
    # are then the table computed before the first step, other rows in a forward), apart after it
    synced, fixed = log.read(str(run_dir / "log.csv")), log.read(str(tmp_path / "fixed" / "log.csv"))
    read = "kl" if stage == "grpo" else "reward_margin"
    assert [float(r[read]) for r in synced[:2]] == pytest.approx([float(r[read]) for r in fixed[:2]], rel=1e-6)
    assert float(synced[2][read]) != pytest.approx(float(fixed[2][read]), rel=1e-3)
    if stage == "dpo":      # the evaluation after step 2 reads its update (TRL's callback runs first too)
        assert float(synced[0]["eval_reward_margin"]) == pytest.approx(float(fixed[0]["eval_reward_margin"]), rel=1e-6)
        assert float(synced[1]["eval_reward_margin"]) != pytest.approx(float(fixed[1]["eval_reward_margin"]),
                                                                       rel=1e-3)
    # The policy's run is the shared device's last (an evaluation reads the reference first): the
    # trace pairs the policy's plan with its own measured run.
    trace = json.loads((run_dir / "step.json").read_text())
    assert any(e["name"] == "process_name" and e["args"]["name"].startswith("measured") for e in trace["traceEvents"])


@pytest.mark.parametrize("stage", [pytest.param("grpo", marks=pytest.mark.slow), "dpo"])
def test_a_run_resumed_between_updates_reads_the_kept_reference_and_writes_the_uninterrupted_log(tmp_path, stage):
    work = stage_files.workspace(tmp_path)
    run(load(files.run_yaml(str(tmp_path / "whole.yaml"), **_settings(work, str(tmp_path / "whole"), stage)), []))
    cut = str(tmp_path / "cut")
    run(load(files.run_yaml(str(tmp_path / "cut3.yaml"), **_settings(work, cut, stage, steps=3)), []))
    resumed = files.run_yaml(str(tmp_path / "cut.yaml"), **_settings(work, cut, stage, resume="auto"))
    # without the update of step 2 there is no reference to go on from: refused, nothing changed
    shutil.copytree(cut, str(tmp_path / "gone"))
    os.remove(tmp_path / "gone" / "reference" / "step-000002.safetensors")
    gone = files.run_yaml(str(tmp_path / "gone.yaml"), **_settings(work, str(tmp_path / "gone"), stage,
                                                                    resume="auto"))
    with pytest.raises(ArgumentError, match=r"reference/step-000002.safetensors is missing"):
        run(load(gone, []))
    assert len(log.read(str(tmp_path / "gone" / "log.csv"))) == 3
    run(load(resumed, []))
    assert _rows(os.path.join(cut, "log.csv")) == _rows(str(tmp_path / "whole" / "log.csv"))


def test_sync_ref_model_is_refused_where_there_is_no_reference_to_update(tmp_path):
    work = stage_files.workspace(tmp_path)

    def refused(name: str, message: str, **more) -> None:
        config = files.run_yaml(str(tmp_path / f"{name}.yaml"), **{**_settings(work, str(tmp_path / name)), **more})
        with pytest.raises(ArgumentError, match=message):
            load(config, [])
        assert not os.path.exists(tmp_path / name)

    refused("beta0", "beta 0 turns the KL term off: there is none to update", beta=0.0)
    refused("lora", "finetuning_type lora", finetuning_type="lora", lora_rank=4, lora_target="all")
    refused("alpha", r"ref_model_mixup_alpha must be in \[0, 1\]", ref_model_mixup_alpha=1.5)
    refused("every", "ref_model_sync_steps must be a whole number >= 1", ref_model_sync_steps=0)
    dpo = _settings(work, str(tmp_path / "simpo"), "dpo")
    for name, more, message in (("simpo", {"loss_type": "simpo"}, "loss_type simpo reads no reference"),
                                ("once", {"precompute_ref_log_probs": True}, "precompute_ref_log_probs true")):
        with pytest.raises(ArgumentError, match=message):
            load(files.run_yaml(str(tmp_path / f"{name}.yaml"), **{**dpo, **more}), [])
    kto = files.run_yaml(str(tmp_path / "kto.yaml"), **{**stage_files.dpo(work, str(tmp_path / "kto")),
                                                        "stage": "kto", "sync_ref_model": True})
    with pytest.raises(ArgumentError, match="sync_ref_model .* is not supported under stage kto"):
        load(kto, [])
    # TRL's KTOConfig writes the three at their defaults: they ask for nothing there
    quiet = {**stage_files.dpo(work, str(tmp_path / "kto")), "stage": "kto", "sync_ref_model": False,
             "ref_model_mixup_alpha": 0.6, "ref_model_sync_steps": 512}
    load(files.run_yaml(str(tmp_path / "quiet.yaml"), **quiet), [])
