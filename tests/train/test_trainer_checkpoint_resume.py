"""run.yaml's `resume` (LlamaFactory's and TRL's resume_from_checkpoint) naming a checkpoint a
transformers Trainer saved: the run starts from its weights, AdamW moments and step, and trains as
the Trainer's torch AdamW would go on over this run's rows; stopped and run again, the same command
goes on from the run's own checkpoint, not from the Trainer's again."""
from __future__ import annotations

import json
import os
import re

import pytest
import torch

from megacompile.train import load, log, run
from megacompile.train.data import packing
from tests.train import files, finetune_runs

SEQ, BATCH, SAVED_AT, STEPS, LR, WD = 16, 2, 2, 4, 3e-3, 0.1


def _trainer_checkpoint(model_dir: str, folder: str) -> None:
    """What Trainer._save_checkpoint leaves after SAVED_AT steps on batches of its own."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(finetune_runs.trainer_groups(model, WD), lr=LR)
    vocab = model.config.vocab_size
    for step in range(SAVED_AT):
        ids = torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    model.save_pretrained(folder)
    torch.save(optimizer.state_dict(), os.path.join(folder, "optimizer.pt"))
    with open(os.path.join(folder, "trainer_state.json"), "w") as f:
        json.dump({"global_step": SAVED_AT}, f)


def _eager_steps(model, rows, steps: int, saved: str | None = None, groups=None) -> list[float]:
    """torch.optim.AdamW over the Trainer's groups, or `groups` (its state from `saved`'s
    optimizer.pt, if given), `steps` steps on this run's rows from its first, as a new run reads them."""
    optimizer = torch.optim.AdamW(groups or finetune_runs.trainer_groups(model, WD), lr=LR)
    if saved is not None:
        optimizer.load_state_dict(torch.load(os.path.join(saved, "optimizer.pt"), weights_only=True))
    losses = []
    for k in range(steps):
        optimizer.zero_grad()
        loss = model(**packing.batch(rows, k * BATCH, BATCH, shifted=False)).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _eager_from(folder: str, rows) -> tuple[torch.nn.Module, list[float]]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model, _eager_steps(model, rows, STEPS - SAVED_AT, saved=folder)


def test_a_run_resumed_from_a_trainer_checkpoint_goes_on_as_its_adamw_would(tmp_path, capsys):
    work = files.workspace(tmp_path)
    checkpoint = str(tmp_path / "saves" / "checkpoint-2")
    _trainer_checkpoint(work["model"], checkpoint)
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), model=work["model"], data=[work["notes"]], eval=[work["notes"]], seq=SEQ,
                            batch=BATCH, steps=STEPS, lr=LR, schedule="constant", weight_decay=WD,
                            max_grad_norm=None, device="cpu", run_dir=str(tmp_path / "run"), log_every=1,
                            save_every=STEPS, resume_from_checkpoint=checkpoint), [])
    run(c)
    said = capsys.readouterr().out
    assert f"resumed        from the Trainer checkpoint {checkpoint} at step {SAVED_AT}" in said
    rows, _ = finetune_runs.rows(c, tmp_path, SEQ)
    eager, losses = _eager_from(checkpoint, rows)
    logged = log.read(os.path.join(c.run_dir, "log.csv"))
    assert [int(r["step"]) for r in logged] == list(range(SAVED_AT + 1, STEPS + 1))
    torch.testing.assert_close(torch.tensor([float(r["loss"]) for r in logged]), torch.tensor(losses),
                               rtol=1e-5, atol=0)
    masters = finetune_runs.tables(os.path.join(c.run_dir, "checkpoints", f"step-{STEPS:06d}"), "master")
    for name, p in eager.named_parameters():
        ref = p.detach()
        assert (masters[name] - ref).abs().max() <= 1e-5 * ref.abs().max(), name

    # The same command again: the run holds its own checkpoint now, which it goes on from (here:
    # already complete), never the Trainer's again.
    run(load(str(tmp_path / "run.yaml"), []))
    again = capsys.readouterr().out
    assert "from the Trainer checkpoint" not in again and "complete" in again, again


def test_resume_from_checkpoint_true_takes_the_latest_checkpoint_its_trainer_left_in_the_output_dir(tmp_path, capsys):
    """LlamaFactory's resume_from_checkpoint: true over its own output_dir: the checkpoint-N of the
    highest N (not the last in the folder's alphabetical order), a folder that is no Trainer
    checkpoint passed over."""
    import shutil
    work = files.workspace(tmp_path)
    out = tmp_path / "saves"
    _trainer_checkpoint(work["model"], str(out / "checkpoint-2"))
    shutil.copytree(out / "checkpoint-2", out / "checkpoint-10")
    (out / "checkpoint-10" / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    (out / "checkpoint-11").mkdir()           # cut short: no weights, no optimizer
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), model=work["model"], data=[work["notes"]], seq=SEQ,
                            batch=BATCH, steps=STEPS, lr=LR, schedule="constant", weight_decay=WD,
                            max_grad_norm=None, device="cpu", output_dir=str(out), save_every=STEPS,
                            resume_from_checkpoint=True), [])
    run(c)
    said = capsys.readouterr().out
    assert f"resumed        from the Trainer checkpoint {out / 'checkpoint-10'} at step 3" in said, said
    assert [int(r["step"]) for r in log.read(os.path.join(c.run_dir, "log.csv"))] == [4]


@pytest.mark.slow    # the default tier holds the engine's LoRA import (tests/e2e/test_trainer_checkpoint.py)
@pytest.mark.parametrize("loraplus", [None, 16.0], ids=["lora", "loraplus"])
def test_a_lora_run_resumed_from_its_trainer_checkpoint_goes_on_as_its_adamw_would(tmp_path, capsys, loraplus):
    """finetuning_type: lora and resume_from_checkpoint naming a LoRA run's checkpoint-N (PEFT's adapter,
    the adapters' AdamW state): the adapters and moments are the Trainer's, the base the model folder's.
    With loraplus_lr_ratio, the checkpoint is LlamaFactory's LoRA+ one, of its four param groups."""
    import peft
    from transformers import AutoModelForCausalLM
    work = files.workspace(tmp_path)
    lora = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    trainer = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(work["model"], dtype=torch.float32),
                                  peft.LoraConfig(task_type="CAUSAL_LM", **lora))

    def groups(model):
        return None if loraplus is None else finetune_runs.loraplus_groups(model, LR, WD, loraplus)
    optimizer = torch.optim.AdamW(groups(trainer) or finetune_runs.trainer_groups(trainer, WD), lr=LR)
    for step in range(SAVED_AT):
        ids = torch.randint(0, trainer.config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        trainer(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    checkpoint = str(tmp_path / "saves" / "checkpoint-2")
    trainer.save_pretrained(checkpoint)
    torch.save(optimizer.state_dict(), os.path.join(checkpoint, "optimizer.pt"))
    with open(os.path.join(checkpoint, "trainer_state.json"), "w") as f:
        json.dump({"global_step": SAVED_AT}, f)
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), model=work["model"], data=[work["notes"]],
                            eval=[work["notes"]], seq=SEQ, batch=BATCH, steps=STEPS, lr=LR, schedule="constant",
                            weight_decay=WD, max_grad_norm=None, device="cpu", run_dir=str(tmp_path / "run"),
                            log_every=1, save_every=STEPS, finetuning_type="lora", lora_rank=4, lora_alpha=8,
                            lora_dropout=0.0, lora_target="q_proj,v_proj", resume_from_checkpoint=checkpoint,
                            loraplus_lr_ratio=loraplus), [])
    run(c)
    assert f"from the Trainer checkpoint {checkpoint} at step {SAVED_AT}" in capsys.readouterr().out
    rows, _ = finetune_runs.rows(c, tmp_path, SEQ)
    reference = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(work["model"], dtype=torch.float32),
                                               checkpoint, is_trainable=True)
    losses = _eager_steps(reference, rows, STEPS - SAVED_AT, saved=checkpoint, groups=groups(reference))
    logged = log.read(os.path.join(c.run_dir, "log.csv"))
    torch.testing.assert_close(torch.tensor([float(r["loss"]) for r in logged]), torch.tensor(losses),
                               rtol=1e-5, atol=0)


@pytest.mark.slow    # a LoRA run's set-up; the refusals are in the default tier's catalogue
def test_a_lora_run_starts_its_adapters_from_adapter_name_or_path(tmp_path, capsys):
    """LlamaFactory's adapter_name_or_path: the run's adapters start as the given PEFT adapter (its B
    not zero), AdamW afresh, and train as eager PEFT from PeftModel.from_pretrained(..., is_trainable=True)."""
    import peft
    from transformers import AutoModelForCausalLM
    work = files.workspace(tmp_path)
    lora = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    trained = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(work["model"], dtype=torch.float32),
                                  peft.LoraConfig(task_type="CAUSAL_LM", **lora))
    torch.manual_seed(7)
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    adapter = str(tmp_path / "sft-adapter")
    trained.save_pretrained(adapter)
    settings = dict(model=work["model"], data=[work["notes"]], eval=[work["notes"]], seq=SEQ, batch=BATCH, steps=2,
                    lr=LR, schedule="constant", weight_decay=WD, max_grad_norm=None, device="cpu",
                    run_dir=str(tmp_path / "run"), log_every=1, save_every=2, finetuning_type="lora", lora_rank=4,
                    lora_alpha=8, lora_dropout=0.0, lora_target="q_proj,v_proj", adapter_name_or_path=adapter)
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), **settings), [])
    run(c)
    assert f"adapter        from {adapter} (its weights; AdamW starts afresh)" in capsys.readouterr().out
    rows, _ = finetune_runs.rows(c, tmp_path, SEQ)
    reference = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(work["model"], dtype=torch.float32),
                                               adapter, is_trainable=True)
    losses = _eager_steps(reference, rows, 2)
    logged = log.read(os.path.join(c.run_dir, "log.csv"))
    torch.testing.assert_close(torch.tensor([float(r["loss"]) for r in logged]), torch.tensor(losses),
                               rtol=1e-5, atol=0)

    # An adapter of another rank is refused by name before anything of the run is written.
    from megacompile.errors import WeightsFileError
    other = load(files.run_yaml(str(tmp_path / "other.yaml"), **{**settings, "lora_rank": 8, "lora_alpha": 16,
                                                                   "run_dir": str(tmp_path / "other")}), [])
    with pytest.raises(WeightsFileError, match=r"not this model's: r 4 \(this model 8; run.yaml lora_rank\); "
                                               r"lora_alpha 8 \(this model 16"):
        run(other)
    assert not os.path.exists(tmp_path / "other")


def test_a_dpo_run_resumed_from_a_trainer_checkpoint_starts_its_policy_from_it(tmp_path, capsys):
    """Under stage dpo the engine's module is the objective around the policy (keys `policy.`...): the
    checkpoint's files are named without it. The policy starts from the checkpoint, the reference is
    the model folder's (as TRL's reference is the model it was given): at the first step their
    implicit rewards already differ, where a new run's are 0."""
    from tests.posttrain import stage_files
    work = stage_files.workspace(tmp_path)
    checkpoint = str(tmp_path / "saves" / "checkpoint-2")
    _trainer_checkpoint(work["model"], checkpoint)
    config = files.run_yaml(str(tmp_path / "dpo.yaml"), **stage_files.dpo(
        work, str(tmp_path / "run"), steps=3, lr=LR, weight_decay=WD,
        resume_from_checkpoint=checkpoint))
    run(load(config, []))
    assert f"from the Trainer checkpoint {checkpoint} at step {SAVED_AT}" in capsys.readouterr().out
    rows = log.read(str(tmp_path / "run" / "log.csv"))
    assert [r["step"] for r in rows] == ["3"] and float(rows[0]["reward_margin"]) != 0.0


def _tree(folder) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, names in os.walk(folder) for f in names)


def test_a_trainer_checkpoint_that_does_not_fit_is_refused_before_anything_of_the_run_is_written(tmp_path):
    """Its optimizer.pt checked against the run's model on meta and the run's AdamW, before any
    engine exists: no run folder is made, and a run over the Trainer's own output_dir
    (resume_from_checkpoint: true) leaves that folder as it was."""
    from megacompile.errors import WeightsFileError
    work = files.workspace(tmp_path)
    out = tmp_path / "saves"
    checkpoint = out / "checkpoint-2"
    _trainer_checkpoint(work["model"], str(checkpoint))
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    saved["state"][0]["exp_avg"] = saved["state"][0]["exp_avg"][:-1]
    torch.save(saved, checkpoint / "optimizer.pt")
    settings = dict(model=work["model"], data=[work["notes"]], seq=SEQ, batch=BATCH, steps=STEPS, lr=LR,
                    weight_decay=WD, device="cpu")
    given = load(files.run_yaml(str(tmp_path / "run.yaml"), **settings, run_dir=str(tmp_path / "run"),
                                resume_from_checkpoint=str(checkpoint)), [])
    with pytest.raises(WeightsFileError, match=r"optimizer.pt does not fit this model's trainable parameters in the "
                                               r"Trainer's order: parameter 0's exp_avg is \(\d+, \d+\), "
                                               r"model.embed_tokens.weight is"):
        run(given)
    assert not os.path.exists(tmp_path / "run")
    before = _tree(out)
    latest = load(files.run_yaml(str(tmp_path / "auto.yaml"), **settings, output_dir=str(out),
                                 resume_from_checkpoint=True), [])
    with pytest.raises(WeightsFileError, match="parameter 0's exp_avg"):
        run(latest)
    assert _tree(out) == before


def test_an_adapter_missing_a_tensor_is_refused_before_anything_of_the_run_is_written(tmp_path):
    """adapter_name_or_path: every tensor of the PEFT adapter named and shaped against the run's
    adapters on meta, not only its config, before the run folder exists."""
    import peft
    import safetensors.torch
    from transformers import AutoModelForCausalLM

    from megacompile.errors import WeightsFileError
    work = files.workspace(tmp_path)
    adapter = str(tmp_path / "adapter")
    peft.get_peft_model(AutoModelForCausalLM.from_pretrained(work["model"]),
                        peft.LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8,
                                        target_modules=["q_proj", "v_proj"])).save_pretrained(adapter)
    weights = os.path.join(adapter, "adapter_model.safetensors")
    tensors = safetensors.torch.load_file(weights)
    dropped = sorted(tensors)[0]
    safetensors.torch.save_file({k: v for k, v in tensors.items() if k != dropped}, weights)
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), model=work["model"], data=[work["notes"]], seq=SEQ,
                            batch=BATCH, steps=1, device="cpu", run_dir=str(tmp_path / "run"), finetuning_type="lora",
                            lora_rank=4, lora_alpha=8, lora_target="q_proj,v_proj", adapter_name_or_path=adapter), [])
    layer = dropped.split(".layers.")[1].split(".lora_")[0]
    with pytest.raises(WeightsFileError, match=rf"cannot take in the LoRA adapter in {adapter}: it holds nothing for "
                                               rf"\S*layers.{re.escape(layer)}"):
        run(c)
    assert not os.path.exists(tmp_path / "run")
