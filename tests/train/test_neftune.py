"""neftune_noise_alpha: NEFTune's noise on the input embeddings of every training forward, drawn as
eager transformers with the Trainer's hook draws it (losses to 1e-5, weights to the float32/float64
floor measured here), none in the held-out loss; refused where it would mean something else."""
from __future__ import annotations

import os

import pytest
import torch

from megacompile.acceptance.parity import WEIGHT_NOISE_FACTOR, float64_noise
from megacompile.errors import ArgumentError
from megacompile.train import load, log, run
from megacompile.train.data import packing
from tests.train import files, finetune_runs

SEQ, ALPHA = 32, 5.0


def _settings(tmp_path, **extra) -> dict:
    chats = files.chats(str(tmp_path / "chats.jsonl"))
    return dict(model=files.model_dir(str(tmp_path / "llama"), dim=32), data=[chats], eval=[chats], seq=SEQ, batch=2,
                steps=3, lr=1e-2, schedule="constant", max_grad_norm=None, device="cpu", run_dir=str(tmp_path / "run"),
                log_every=1, save_every=3, eval_every=3, eval_batches=1, **extra)


def _eager(model, c, rows, alpha: float | None) -> list[float]:
    """Trained on the run's micro-batches from the run's seed, NEFTune hooked as the Trainer hooks it."""
    from transformers.integrations.neftune import activate_neftune
    if alpha is not None:
        activate_neftune(model, alpha)
    model.train()       # as the Trainer trains it: the hook noises training forwards alone
    torch.manual_seed(c.seed)
    losses, _ = finetune_runs.train(model, c, rows, finetune_runs.trainer_groups(model, 0.0))
    return losses


def test_the_noise_trains_as_the_trainers_hook_and_leaves_the_held_out_loss_clean(tmp_path):
    from transformers import AutoModelForCausalLM
    c = load(files.run_yaml(str(tmp_path / "r.yaml"), **_settings(tmp_path, neftune_noise_alpha=ALPHA)), [])
    run(c)
    rows, eval_rows = finetune_runs.rows(c, tmp_path, SEQ)
    logged = log.read(os.path.join(c.run_dir, "log.csv"))
    ours = torch.tensor([float(r["loss"]) for r in logged])

    def built():
        return AutoModelForCausalLM.from_pretrained(c.model, dtype=torch.float32)
    eager, start = built(), {n: p.detach().clone() for n, p in built().named_parameters()}
    torch.testing.assert_close(ours, torch.tensor(_eager(eager, c, rows, ALPHA)), rtol=1e-5, atol=0)
    clean = torch.tensor(_eager(built(), c, rows, None))
    assert (ours - clean).abs().max() > 1e-3 * ours.abs().max()         # the noise is there

    def train_again(exact):
        exact.load_state_dict({n: w.double() for n, w in start.items()})
        _eager(exact, c, rows, ALPHA)
    noise = float64_noise(train_again, eager, eager)
    tol = max(1e-5, WEIGHT_NOISE_FACTOR * noise)
    masters = finetune_runs.tables(os.path.join(c.run_dir, "checkpoints", "step-000003"), "master")
    for name, p in eager.named_parameters():
        err = (masters[name] - p.detach()).abs().max() / p.detach().abs().max()
        assert err <= tol, f"{name}: {err:.3g} (tolerance {tol:.3g})"

    eager.eval()        # the Trainer's evaluation: no noise
    with torch.no_grad():
        held = eager(**packing.batch(eval_rows, 0, c.batch, shifted=False)).loss.item()
    assert float(logged[-1]["eval_loss"]) == pytest.approx(held, rel=max(1e-5, 10 * tol))


@pytest.mark.parametrize("extra, says", [
    (dict(neftune_noise_alpha=-1), "neftune_noise_alpha must be a number >= 0; got -1"),
    (dict(neftune_noise_alpha=5, model="bundled"), "neftune_noise_alpha: the bundled model is no Hugging Face model"),
    (dict(neftune_noise_alpha=5, grad_accum=2, accumulation="layer"),
     "neftune_noise_alpha draws its noise in each micro-batch's forward, and accumulation: layer"),
])
def test_an_alpha_that_cannot_mean_what_it_does_in_transformers_is_refused(tmp_path, extra, says):
    with pytest.raises(ArgumentError) as e:
        load(files.run_yaml(str(tmp_path / "r.yaml"), **{**_settings(tmp_path), **extra}), [])
    assert says in str(e.value)


def test_a_preference_stage_refuses_it_and_zero_is_off(tmp_path):
    from tests.posttrain import stage_files
    work = {"model": str(tmp_path), "pairs": stage_files.pairs(str(tmp_path / "pairs.jsonl"))}
    settings = {**stage_files.dpo(work, str(tmp_path / "run")), "neftune_noise_alpha": 5}
    with pytest.raises(ArgumentError, match="neftune_noise_alpha noises the input embeddings of sft and pt training; "
                                            "under stage dpo"):
        load(files.run_yaml(str(tmp_path / "r.yaml"), **settings), [])
    settings["neftune_noise_alpha"] = 0
    assert load(files.run_yaml(str(tmp_path / "r.yaml"), **settings), []).neftune_noise_alpha is None


@pytest.mark.slow
def test_a_lora_runs_noise_is_on_the_base_models_embeddings_as_the_trainer_hooks_it(tmp_path):
    import peft
    from transformers import AutoModelForCausalLM
    from transformers.integrations.neftune import activate_neftune
    c = load(files.run_yaml(str(tmp_path / "r.yaml"), **_settings(
        tmp_path, neftune_noise_alpha=ALPHA, finetuning_type="lora", lora_rank=4, lora_alpha=8, lora_dropout=0.0,
        lora_target="q_proj,v_proj")), [])
    run(c)
    rows, _ = finetune_runs.rows(c, tmp_path, SEQ)
    ours = torch.tensor([float(r["loss"]) for r in log.read(os.path.join(c.run_dir, "log.csv"))])

    def eager(alpha: float | None) -> list[float]:
        """The adapters drawn from the run's seed, the noise from the same stream after them."""
        torch.manual_seed(c.seed)
        model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(c.model, dtype=torch.float32),
                                    peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                    target_modules=["q_proj", "v_proj"]))
        if alpha is not None:
            activate_neftune(model, alpha)
        model.train()
        return finetune_runs.train(model, c, rows, finetune_runs.trainer_groups(model, 0.0))[0]
    torch.testing.assert_close(ours, torch.tensor(eager(ALPHA)), rtol=1e-5, atol=0)
    assert (ours - torch.tensor(eager(None))).abs().max() > 1e-3 * ours.abs().max()      # the noise is there
