"""TRL's sync_ref_model under stage grpo (TR-DPO's reference updates): every ref_model_sync_steps
steps the reference becomes (1 - alpha) reference + alpha policy, bit for bit TRL's arithmetic on
the float32 masters; the KL term reads the updated reference from the next rollout on; and a run
resumed between updates writes the uninterrupted run's log.csv, from the update kept in the run
folder."""
from __future__ import annotations

import glob
import os
import shutil

import pytest
from safetensors.torch import load_file

from megacompile.errors import ArgumentError
from megacompile.train import load, log, run
from tests.posttrain import stage_files
from tests.train import files

TIMED = ("seconds", "tokens_per_s")


def _settings(work, name: str, **more) -> dict:
    return stage_files.grpo(work, name, **{"beta": 0.05, "sync_ref_model": True, "ref_model_sync_steps": 2,
                                           "ref_model_mixup_alpha": 0.5, "steps": 4, "save_every": 2,
                                           **more})


def _masters(checkpoint: str) -> dict:
    found = {}
    for path in glob.glob(os.path.join(checkpoint, "owner-*.safetensors")):
        found.update({k[len("master/"):]: t for k, t in load_file(path).items() if k.startswith("master/")})
    return found


def _rows(path: str) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMED} for r in log.read(path)]


def test_the_reference_is_mixed_with_the_policy_every_sync_steps_as_trl_mixes_it(tmp_path):
    work = stage_files.workspace(tmp_path)
    run(load(files.run_yaml(str(tmp_path / "sync.yaml"), **_settings(work, str(tmp_path / "sync"))), []))
    run(load(files.run_yaml(str(tmp_path / "fixed.yaml"), **_settings(work, str(tmp_path / "fixed"),
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
    # the KL term reads the reference: alike until the first update, apart after it
    synced, fixed = log.read(str(run_dir / "log.csv")), log.read(str(tmp_path / "fixed" / "log.csv"))
    assert [r["kl"] for r in synced[:2]] == [r["kl"] for r in fixed[:2]]
    assert synced[2]["kl"] != fixed[2]["kl"] and float(synced[2]["kl"]) > 0


def test_a_run_resumed_between_updates_reads_the_kept_reference_and_writes_the_uninterrupted_log(tmp_path):
    work = stage_files.workspace(tmp_path)
    run(load(files.run_yaml(str(tmp_path / "whole.yaml"), **_settings(work, str(tmp_path / "whole"))), []))
    cut = str(tmp_path / "cut")
    run(load(files.run_yaml(str(tmp_path / "cut3.yaml"), **_settings(work, cut, steps=3)), []))
    resumed = files.run_yaml(str(tmp_path / "cut.yaml"), **_settings(work, cut, resume="auto"))
    # without the update of step 2 there is no reference to go on from: refused, nothing changed
    shutil.copytree(cut, str(tmp_path / "gone"))
    os.remove(tmp_path / "gone" / "reference" / "step-000002.safetensors")
    gone = files.run_yaml(str(tmp_path / "gone.yaml"), **_settings(work, str(tmp_path / "gone"), resume="auto"))
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

    refused("beta0", "beta 0 has none", beta=0.0)
    refused("lora", "finetuning_type lora", finetuning_type="lora", lora_rank=4, lora_target="all")
    refused("alpha", r"ref_model_mixup_alpha must be in \[0, 1\]", ref_model_mixup_alpha=1.5)
    refused("every", "ref_model_sync_steps must be a whole number >= 1", ref_model_sync_steps=0)
    dpo = files.run_yaml(str(tmp_path / "dpo.yaml"), **stage_files.dpo(work, str(tmp_path / "dpo"),
                                                                       sync_ref_model=True))
    with pytest.raises(ArgumentError, match="sync_ref_model .* is not supported under stage dpo"):
        load(dpo, [])
    # TRL's DPOConfig writes the three at their defaults: they ask for nothing there
    quiet = stage_files.dpo(work, str(tmp_path / "dpo"), sync_ref_model=False, ref_model_mixup_alpha=0.6,
                            ref_model_sync_steps=512)
    load(files.run_yaml(str(tmp_path / "quiet.yaml"), **quiet), [])
