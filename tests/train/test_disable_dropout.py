"""TRL's `disable_dropout`: every nn.Dropout of the model at p 0 (a LoRA adapter's too), by default
under stage dpo, kto and rm as TRL's and LlamaFactory's trainers of them do. A model with dropout
then gives a DPO run the same reference log-probabilities whatever the seed; kept, dropout acts in
the policy's steps while the reference runs in eval mode, as TRL's does."""
from __future__ import annotations

import math
import os

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from megacompile.train import load, log, run
from megacompile.train.model import disable_dropout
from tests.posttrain import stage_files
from tests.train import files


def _gpt2(path: str) -> str:
    tok = files.tokenizer()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2, n_positions=128, resid_pdrop=0.1,
                        embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                        use_cache=False)
    GPT2LMHeadModel(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_every_dropout_module_goes_to_p_0_and_is_counted(tmp_path):
    from peft import LoraConfig, get_peft_model
    model = GPT2LMHeadModel.from_pretrained(_gpt2(str(tmp_path / "gpt2")))
    dropping = sum(m.p > 0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    assert dropping == 1 + 2 * 3      # the embeddings', and each block's attention, residual and MLP
    adapted = get_peft_model(model, LoraConfig(r=2, lora_dropout=0.2, target_modules=["c_attn"]))
    assert disable_dropout(adapted) == dropping + 2           # the adapters' too
    assert all(m.p == 0 for m in adapted.modules() if isinstance(m, torch.nn.Dropout))
    assert disable_dropout(adapted) == 0


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return stage_files.workspace(tmp_path_factory.mktemp("dropout"))


@pytest.mark.parametrize("stage, default", [("dpo", True), ("kto", True), ("rm", True), ("grpo", False),
                                            ("sft", False)])
def test_the_default_is_the_stages_trainers(tmp_path, work, stage, default):
    keys = stage_files.grpo(work, str(tmp_path / "run")) if stage == "grpo" else {
        **stage_files.dpo(work, str(tmp_path / "run")), "stage": stage}
    if stage == "sft":
        keys = {k: v for k, v in keys.items() if k != "stage"} | {"data": files.chats(str(tmp_path / "c.jsonl"))}
    assert load(files.run_yaml(str(tmp_path / "run.yaml"), **keys), []).disable_dropout is default
    keys["disable_dropout"] = not default
    assert load(files.run_yaml(str(tmp_path / "run.yaml"), **keys), []).disable_dropout is (not default)


def test_a_dpo_run_of_a_model_with_dropout_takes_its_reference_without_it(tmp_path, work, capsys):
    work = {**work, "model": _gpt2(str(tmp_path / "gpt2"))}

    def reference(name: str, **more) -> torch.Tensor:
        run_dir = str(tmp_path / name)
        run(load(files.run_yaml(str(tmp_path / f"{name}.yaml"), **stage_files.dpo(
            work, run_dir, steps=1, eval_fraction=0.0, eval_every=None, **more)), []))
        return torch.load(os.path.join(run_dir, "reference_logps.pt"))["train"]

    first = reference("seed1", seed=1)
    said = capsys.readouterr().out
    assert torch.equal(reference("seed2", seed=2), first)
    assert "disable_dropout: 7 dropout modules of the model at p 0 (stage dpo's default" in said
    # Kept, dropout acts in the policy's steps; the reference still runs in eval mode, as TRL's
    # (create_reference_model hands back its copy in eval mode).
    kept = reference("kept", seed=1, disable_dropout=False)
    assert torch.equal(kept, first)
    first_loss = {name: float(log.read(str(tmp_path / name / "log.csv"))[0]["loss"]) for name in ("seed1", "kept")}
    assert first_loss["seed1"] == pytest.approx(math.log(2), abs=1e-6)     # the policy is the reference at step 1
    assert abs(first_loss["kept"] - math.log(2)) > 1e-4                   # its dropout masks move it off
