"""`megacompile export CHECKPOINT OUT [--config run.yaml]`: a checkpoint of a run written as the run
writes its model, the run read back from the training_args.yaml it left in its folder. An
intermediate step's export loads with transformers (a LoRA one with PEFT, or merged) and
evaluates to the held-out loss the run logged at that step; a run folder means its latest
checkpoint; what cannot be exported is refused by name, and nothing is written."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file

from megacompile.cli import main
from megacompile.train import load, log, run
from megacompile.train.data import packing
from tests.train import files, finetune_runs

HELD = 4        # held-out records: 2 eval batches of 2


def _run(folder, name: str, **extra):
    """A 3-step run checkpointed and evaluated at every step; its config."""
    folder = str(folder)
    settings = dict(model=os.path.join(folder, "llama"), data=[os.path.join(folder, "chats.jsonl")],
                    eval=[os.path.join(folder, "held.jsonl")], seq=64, batch=2, steps=3, lr=1e-2,
                    schedule="constant", max_grad_norm=None, device="cpu", run_dir=os.path.join(folder, name),
                    eval_every=1, save_every=1, export_dtype="float32") | extra
    if not os.path.isdir(settings["model"]):
        files.model_dir(settings["model"], dim=32)
        files.chats(settings["data"][0])
        files.chats(settings["eval"][0], n=HELD)
    c = load(files.run_yaml(os.path.join(folder, f"{name}.yaml"), **settings), [])
    run(c)
    return c


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("export"), "full")


def _step(c, n: int) -> str:
    return os.path.join(c.run_dir, "checkpoints", f"step-{n:06d}")


def _yaml(c) -> str:
    return c.run_dir + ".yaml"


def _export(*argv) -> int:
    return main(["export", *argv])


def _held_out_loss(c, model, tmp) -> float:
    """The held-out loss as the run evaluates it: each eval batch's mean over its target tokens,
    weighted by its rows (Trainer.evaluate's, test_eval_loss.py)."""
    _, held = finetune_runs.rows(c, tmp, c.seq)
    total = 0.0
    with torch.no_grad():
        for start in range(0, HELD, c.batch):
            total += model.eval()(**packing.batch(held, start, c.batch, shifted=False)).loss.item() * c.batch
    return total / HELD


def _logged(c, step: int) -> float:
    return float(next(r for r in log.read(os.path.join(c.run_dir, "log.csv")) if int(r["step"]) == step)["eval_loss"])


def test_an_intermediate_checkpoint_is_the_model_of_its_step(full, tmp_path, capsys):
    from transformers import AutoModelForCausalLM
    out = str(tmp_path / "step2")
    with open(os.path.join(full.run_dir, "training_args.yaml")) as f:       # the run's settings, kept
        assert yaml.safe_load(f)["model"] == full.model
    assert _export(_step(full, 2), out) == 0        # the run read back from them
    assert f"model: {out} (a Hugging Face model folder" in capsys.readouterr().out
    exported = load_file(os.path.join(out, "model.safetensors"))
    masters = finetune_runs.tables(_step(full, 2), "master")
    assert all(torch.equal(exported[n], t) for n, t in masters.items())
    assert not torch.equal(exported["lm_head.weight"], load_file(os.path.join(full.run_dir, "model.safetensors"))[
        "lm_head.weight"])       # not the run's last step
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert _held_out_loss(full, model, tmp_path) == pytest.approx(_logged(full, 2), rel=1e-5, abs=1e-5)
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))


def test_a_run_folder_means_its_latest_checkpoint_and_dtype_is_taken(full, tmp_path):
    out = str(tmp_path / "latest")
    assert _export(full.run_dir, out, "--config", _yaml(full), "--dtype", "bfloat16") == 0
    exported = load_file(os.path.join(out, "model.safetensors"))
    final = load_file(os.path.join(full.run_dir, "model.safetensors"))      # the run's own export, step 3
    assert set(exported) == set(final)
    assert all(exported[n].dtype == torch.bfloat16 and torch.equal(exported[n], final[n].bfloat16()) for n in final)


@pytest.mark.slow
def test_a_freeze_runs_checkpoint_keeps_its_frozen_layers(full, tmp_path):
    c = _run(os.path.dirname(full.run_dir), "freeze", finetuning_type="freeze", freeze_trainable_layers=1, steps=2)
    out = str(tmp_path / "freeze")
    assert _export(_step(c, 1), out, "--config", _yaml(c)) == 0
    exported = load_file(os.path.join(out, "model.safetensors"))
    base = load_file(os.path.join(c.model, "model.safetensors"))
    trained = finetune_runs.tables(_step(c, 1), "master")
    assert trained and all(torch.equal(exported[n], t) for n, t in trained.items())
    frozen = [n for n in base if n not in trained]
    assert frozen and all(torch.equal(exported[n], base[n]) for n in frozen)


@pytest.mark.slow
def test_a_run_under_an_objective_exports_its_policy(full, tmp_path):
    """loss_type dft trains the model inside an objective: the checkpoint's names are `policy.`'s."""
    from transformers import AutoModelForCausalLM
    c = _run(os.path.dirname(full.run_dir), "dft", loss_type="dft", steps=2)
    trained = finetune_runs.tables(_step(c, 1), "master")
    assert trained and all(n.startswith("policy.") for n in trained)
    out = str(tmp_path / "dft")
    assert _export(_step(c, 1), out, "--config", _yaml(c)) == 0
    exported = load_file(os.path.join(out, "model.safetensors"))
    assert all(torch.equal(exported[n.removeprefix("policy.")], t) for n, t in trained.items())
    AutoModelForCausalLM.from_pretrained(out)


@pytest.mark.slow
def test_a_lora_checkpoint_is_its_adapter_or_the_merged_model(full, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    c = _run(os.path.dirname(full.run_dir), "lora", finetuning_type="lora", lora_rank=4, lora_target="q_proj,v_proj")
    adapter, merged = str(tmp_path / "adapter"), str(tmp_path / "merged")
    assert _export(_step(c, 2), adapter, "--config", _yaml(c)) == 0
    assert _export(_step(c, 2), merged, "--config", _yaml(c), "--merge-adapter") == 0
    assert sorted(f for f in os.listdir(adapter) if f.startswith("adapter")) == ["adapter_config.json",
                                                                              "adapter_model.safetensors"]
    written = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    trained = finetune_runs.tables(_step(c, 2), "master")
    assert len(written) == len(trained) and all(torch.equal(written[n.replace(".default.", ".")], t)
                                                for n, t in trained.items())
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(c.model, dtype=torch.float32), adapter)
    whole = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    assert _held_out_loss(c, peft, tmp_path) == pytest.approx(_logged(c, 2), rel=1e-5, abs=1e-5)
    assert _held_out_loss(c, whole, tmp_path) == pytest.approx(_logged(c, 2), rel=1e-5, abs=1e-5)
    # the full run's checkpoint is no LoRA run's: refused by its fine-tuning keys
    assert _export(_step(full, 2), str(tmp_path / "no"), "--config", _yaml(c)) == 2
    assert not os.path.exists(tmp_path / "no")


def _refused(capsys, out, *argv) -> str:
    assert _export(*argv) == 2
    assert not os.path.exists(out)
    return capsys.readouterr().err


def test_what_is_no_checkpoint_is_refused_and_nothing_written(full, tmp_path, capsys):
    out = str(tmp_path / "out")
    said = _refused(capsys, out, full.model, out, "--config", _yaml(full))
    assert f"cannot load the checkpoint {full.model}" in said
    said = _refused(capsys, out, str(tmp_path), out, "--config", _yaml(full))
    assert "there is no checkpoint folder there" in said or "not committed" in said
    alone = shutil.copytree(_step(full, 2), tmp_path / "step-000002")      # no run folder around it
    said = _refused(capsys, out, str(alone), out)
    assert f"export needs --config, the run.yaml of the run that saved {alone}: its run folder holds no " \
           "training_args.yaml" in said
    inside = os.path.join(_step(full, 3), "model")
    said = _refused(capsys, inside, _step(full, 2), inside)
    assert f"lies inside the checkpoint {os.path.realpath(_step(full, 3))}, which the run's keep_last removes" in said
    said = _refused(capsys, out, _step(full, 2), out, "--config", _yaml(full), "--merge-adapter")
    assert "has no adapter to merge" in said
    said = _refused(capsys, out, _step(full, 2), out, "--config", _yaml(full), "stage=rm")
    assert f"{_step(full, 2)} was saved by a stage sft run and {_yaml(full)} is a stage rm run" in said
    said = _refused(capsys, out, _step(full, 2), out, "--config", _yaml(full), "finetuning_type=lora")
    assert "trained other parameters than" in said and "finetuning_type 'full' -> 'lora'" in said


def test_a_folder_holding_a_model_is_refused_unless_overwrite(full, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_text("mine")
    (out / "config.json").write_text("{}")
    assert _export(_step(full, 2), str(out), "--config", _yaml(full)) == 2
    assert "already holds a model (config.json)" in capsys.readouterr().err
    assert sorted(os.listdir(out)) == ["README.md", "config.json"] and (out / "config.json").read_text() == "{}"
    assert _export(_step(full, 2), str(out), "--config", _yaml(full), "--overwrite") == 0
    assert (out / "README.md").read_text() == "mine" and os.path.isfile(out / "model.safetensors")


def test_a_failed_write_leaves_no_half_folder(full, tmp_path, capsys, monkeypatch):
    from megacompile.io import hf_save

    def broken(target, shard, dtype):
        with open(target, "wb") as f:
            f.write(b"half")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(hf_save, "_write_shard", broken)
    out = tmp_path / "out"
    assert _export(_step(full, 2), str(out), "--config", _yaml(full)) == 2
    assert "the disk is full (No space left on device); nothing was written" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_a_training_args_yaml_of_the_users_own_in_the_run_folder_is_never_replaced(tmp_path):
    """A run started from the run.yaml it keeps in its own folder under LlamaFactory's name."""
    folder = tmp_path / "run"
    folder.mkdir()
    model = files.model_dir(str(tmp_path / "llama"), dim=32)
    files.chats(str(tmp_path / "chats.jsonl"))
    mine = files.run_yaml(str(folder / "training_args.yaml"), model=model, data=[str(tmp_path / "chats.jsonl")],
                          seq=32, batch=2, steps=1, device="cpu", run_dir=str(folder), export_dtype="float32")
    with open(mine) as f:
        before = f.read()
    run(load(mine, ["lr=1e-3"]))
    with open(mine) as f:
        assert f.read() == before


def _copied_run(full, tmp_path, **changed) -> str:
    """The run folder copied elsewhere (to another machine, say), its training_args.yaml changed."""
    run_dir = shutil.copytree(full.run_dir, tmp_path / "run", ignore=shutil.ignore_patterns("tokens", "plan"))
    with open(run_dir / "training_args.yaml") as f:
        given = yaml.safe_load(f)
    for key, value in changed.items():
        given.pop(key, None) if value is None else given.__setitem__(key, value)
    with open(run_dir / "training_args.yaml", "w") as f:
        yaml.safe_dump(given, f)
    return str(run_dir)


def test_the_runs_data_gone_is_no_matter_its_model_gone_is_refused(full, tmp_path, capsys):
    from megacompile.errors import ArgumentError
    gone = str(tmp_path / "gone")
    run_dir = _copied_run(full, tmp_path, data=None, dataset="mine", dataset_dir=gone,
                          eval=[os.path.join(gone, "held.jsonl")], resume=os.path.join(gone, "step-000001"))
    step = os.path.join(run_dir, "checkpoints", "step-000002")
    with pytest.raises(ArgumentError, match="cannot read .*dataset_info.json"):     # train still checks them
        load(os.path.join(run_dir, "training_args.yaml"), [])
    out = str(tmp_path / "out")
    assert _export(step, out) == 0
    exported = load_file(os.path.join(out, "model.safetensors"))
    assert all(torch.equal(exported[n], t) for n, t in finetune_runs.tables(step, "master").items())
    said = _refused(capsys, str(tmp_path / "no"), step, str(tmp_path / "no"), "--config",
                    os.path.join(run_dir, "training_args.yaml"), f"model={gone}")
    assert f"model: {gone} does not exist" in said and "model=FOLDER" in said


def test_an_export_pins_its_checkpoint_against_the_live_runs_keep_last(full, tmp_path, monkeypatch, capsys):
    """The run saves step 3 and rotates (keep_last 1) while step 2 is being exported."""
    from megacompile.io import checkpoint
    from megacompile.train import checkpoint_export
    run_dir = _copied_run(full, tmp_path)
    folder = os.path.join(run_dir, "checkpoints")
    step2, step3 = (os.path.join(folder, f"step-00000{n}") for n in (2, 3))
    masters = finetune_runs.tables(step2, "master")
    with open(os.path.join(step3, checkpoint.MANIFEST)) as f:
        run_id = json.load(f)["run"]
    write = checkpoint_export.trained_model.write

    def saved_meanwhile(*args, **kwargs):
        checkpoint.rotate(step3, run_id, keep_last=1)
        return write(*args, **kwargs)
    monkeypatch.setattr(checkpoint_export.trained_model, "write", saved_meanwhile)
    out = str(tmp_path / "out")
    assert _export(step2, out) == 0
    assert f"checkpoint: {step2} (step 2)" in capsys.readouterr().out
    exported = load_file(os.path.join(out, "model.safetensors"))
    assert all(torch.equal(exported[n], t) for n, t in masters.items())
    assert sorted(os.listdir(folder)) == ["step-000002", "step-000003"]     # step 1 went, no pin file is left
    checkpoint.rotate(step3, run_id, keep_last=1)
    assert os.listdir(folder) == ["step-000003"]


@pytest.mark.parametrize("given", ["checkpoints/latest", "checkpoints/", "checkpoints", ""])
def test_the_checkpoints_folder_or_latest_means_the_latest(full, tmp_path, capsys, given):
    out = str(tmp_path / "out")
    assert _export(os.path.join(full.run_dir, given), out) == 0
    assert f"checkpoint: {_step(full, 3)} (step 3)" in capsys.readouterr().out
