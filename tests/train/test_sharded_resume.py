"""run.yaml's `resume` naming a checkpoint whose optimizer state another trainer sharded: a LoRA
run's DeepSpeed ZeRO-3 save (tests/data/deepspeed, written by DeepSpeed), the checkpoint-N a Trainer
running FSDP saved (tests/data/fsdp, written by FSDP2), torchtune's epoch_0 (tests/data/torchtune,
written by torchtune: its AdamW decayed every parameter, the run's exempts the Trainer's, as the
run says and goes on). The run starts from its fp32 masters, AdamW
moments and step (a LoRA run: its adapters' on the `model` folder's base), and trains as torch
AdamW goes on from the trainer's state over this run's rows."""
from __future__ import annotations

import importlib.util
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from megacompile.train import load, log, run
from megacompile.train.data import packing
from tests.train import files, finetune_runs

DATA = os.path.join(os.path.dirname(__file__), "..", "data")
_spec = importlib.util.spec_from_file_location("deepspeed_fixtures", os.path.join(DATA, "deepspeed", "make.py"))
make = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make)
SEQ, BATCH, STEPS = 8, 2, make.SAVED_AT + 2


def _model_folder(path: str, seed: int) -> str:
    """The model the other trainer's run trained, as a folder a run starts from: its config, weights of
    `seed` (make.py's, 0, for a LoRA run's base), and the tokenizer whose vocabulary it has."""
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**make.CONFIG)).save_pretrained(path)
    files.tokenizer().save_pretrained(path)
    return path


def _eager(model_dir: str, expected: dict, rows, lora: dict | None):
    """torch AdamW going on from the trainer's gathered masters and moments over the run's rows."""
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if lora:
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(**lora))
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    with torch.no_grad():
        for n, p in trained:
            p.copy_(expected[f"master/{n}"])
    optimizer = torch.optim.AdamW(finetune_runs.trainer_groups(model, make.WD), lr=make.LR, betas=make.BETAS,
                                  eps=make.EPS)
    for n, p in trained:
        optimizer.state[p] = {"step": torch.tensor(float(make.SAVED_AT)), "exp_avg": expected[f"exp_avg/{n}"],
                              "exp_avg_sq": expected[f"exp_avg_sq/{n}"]}
    for k in range(STEPS - make.SAVED_AT):
        optimizer.zero_grad()
        model(**packing.batch(rows, k * BATCH, BATCH, shifted=False)).loss.backward()
        optimizer.step()
    return model


# each LoRA case's adapters: DeepSpeed's fixtures', and torchtune's lora_llama (tests/data/torchtune/make.py)
LORAS = {"deepspeed/lora_zero3": make.LORA,
         "torchtune/lora_llama": dict(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0,
                                      target_modules=["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"])}


def _lora_keys(lora: dict) -> dict:
    return dict(finetuning_type="lora", lora_rank=lora["r"], lora_alpha=lora["lora_alpha"], lora_dropout=0.0,
                lora_target=",".join(lora["target_modules"]))


NAMED = {"deepspeed/lora_zero3": "the DeepSpeed ZeRO checkpoint", "fsdp/checkpoint-3": "the Trainer's FSDP checkpoint",
         "torchtune/llama": "the torchtune checkpoint", "torchtune/lora_llama": "the torchtune checkpoint"}


@pytest.mark.parametrize("case", [c if not c.startswith("torchtune/") else pytest.param(c, marks=pytest.mark.slow)
                                  for c in NAMED])
def test_a_run_resumed_from_a_sharded_checkpoint_goes_on_from_the_trainers_masters(tmp_path, capsys, case):
    work = files.workspace(tmp_path)
    lora = LORAS.get(case)
    model_dir = _model_folder(str(tmp_path / "their_model"), seed=0 if lora else 5)
    checkpoint = shutil.copytree(os.path.join(DATA, case), str(tmp_path / "saves" / case.partition("/")[2]))
    if case.startswith("torchtune/"):   # its epoch folder, torchtune 0.6's recipe_state/ beside it
        checkpoint = os.path.join(checkpoint, "epoch_0")
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), **(_lora_keys(lora) if lora else {}), model=model_dir, data=[work["notes"]], eval=[work["notes"]], seq=SEQ, batch=BATCH,
                            steps=STEPS, lr=make.LR, schedule="constant", weight_decay=make.WD,
                            betas=list(make.BETAS), eps=make.EPS, max_grad_norm=None, device="cpu",
                            run_dir=str(tmp_path / "run"), log_every=1, save_every=STEPS,
                            resume_from_checkpoint=checkpoint), [])
    run(c)
    assert f"resumed        from {NAMED[case]} {checkpoint} at step {make.SAVED_AT}" in capsys.readouterr().out
    logged = log.read(os.path.join(c.run_dir, "log.csv"))
    assert [int(r["step"]) for r in logged] == list(range(make.SAVED_AT + 1, STEPS + 1))
    rows, _ = finetune_runs.rows(c, tmp_path, SEQ)
    eager = _eager(model_dir, load_file(os.path.join(DATA, f"{case}.expected.safetensors")), rows, lora)
    masters = finetune_runs.tables(os.path.join(c.run_dir, "checkpoints", f"step-{STEPS:06d}"), "master")
    trained = [(n, p) for n, p in eager.named_parameters() if p.requires_grad]
    assert sorted(masters) == sorted(n for n, _ in trained)
    for name, p in trained:
        ref = p.detach()
        assert (masters[name] - ref).abs().max() <= 1e-5 * ref.abs().max(), name
