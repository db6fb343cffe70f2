"""run.yaml's `resume` naming the checkpoint-N a Trainer running DeepSpeed ZeRO-3 saved
(tests/data/deepspeed/checkpoint-3, written by DeepSpeed: make.py): the run starts from its fp32
masters, AdamW moments and step, and trains as torch AdamW goes on from DeepSpeed's state over this
run's rows."""
from __future__ import annotations

import importlib.util
import os
import shutil

import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from megacompile.train import load, log, run
from megacompile.train.data import packing
from tests.train import files, finetune_runs

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "deepspeed")
_spec = importlib.util.spec_from_file_location("deepspeed_fixtures", os.path.join(DATA, "make.py"))
make = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make)
SEQ, BATCH, STEPS = 8, 2, make.SAVED_AT + 2


def _model_folder(path: str) -> str:
    """The model the DeepSpeed run trained, as a folder a run starts from: its config, other
    weights (the import replaces them all), and the tokenizer whose vocabulary it has."""
    torch.manual_seed(5)
    LlamaForCausalLM(LlamaConfig(**make.CONFIG)).save_pretrained(path)
    files.tokenizer().save_pretrained(path)
    return path


def _eager(model_dir: str, expected: dict, rows) -> LlamaForCausalLM:
    """torch AdamW going on from DeepSpeed's gathered masters and moments over the run's rows."""
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict({n: expected[f"master/{n}"] for n, _ in model.named_parameters()}, strict=False)
    optimizer = torch.optim.AdamW(finetune_runs.trainer_groups(model, make.WD), lr=make.LR, betas=make.BETAS,
                                  eps=make.EPS)
    for n, p in model.named_parameters():
        optimizer.state[p] = {"step": torch.tensor(float(make.SAVED_AT)), "exp_avg": expected[f"exp_avg/{n}"],
                              "exp_avg_sq": expected[f"exp_avg_sq/{n}"]}
    for k in range(STEPS - make.SAVED_AT):
        optimizer.zero_grad()
        model(**packing.batch(rows, k * BATCH, BATCH, shifted=False)).loss.backward()
        optimizer.step()
    return model


def test_a_run_resumed_from_a_deepspeed_trainer_checkpoint_goes_on_from_deepspeeds_masters(tmp_path, capsys):
    work = files.workspace(tmp_path)
    model_dir = _model_folder(str(tmp_path / "deepspeed_model"))
    checkpoint = shutil.copytree(os.path.join(DATA, "checkpoint-3"), str(tmp_path / "saves" / "checkpoint-3"))
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), model=model_dir, data=[work["notes"]], eval=[work["notes"]], seq=SEQ, batch=BATCH,
                            steps=STEPS, lr=make.LR, schedule="constant", weight_decay=make.WD,
                            betas=list(make.BETAS), eps=make.EPS, max_grad_norm=None, device="cpu",
                            run_dir=str(tmp_path / "run"), log_every=1, save_every=STEPS,
                            resume_from_checkpoint=checkpoint), [])
    run(c)
    assert f"resumed        from the Trainer checkpoint {checkpoint} at step {make.SAVED_AT}" in capsys.readouterr().out
    logged = log.read(os.path.join(c.run_dir, "log.csv"))
    assert [int(r["step"]) for r in logged] == list(range(make.SAVED_AT + 1, STEPS + 1))
    rows, _ = finetune_runs.rows(c, tmp_path, SEQ)
    eager = _eager(model_dir, load_file(os.path.join(DATA, "checkpoint-3.expected.safetensors")), rows)
    masters = finetune_runs.tables(os.path.join(c.run_dir, "checkpoints", f"step-{STEPS:06d}"), "master")
    for name, p in eager.named_parameters():
        ref = p.detach()
        assert (masters[name] - ref).abs().max() <= 1e-5 * ref.abs().max(), name
