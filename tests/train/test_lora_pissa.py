"""pissa_init (LlamaFactory's pissa_init, pissa_iter, pissa_convert): the adapters start as each
adapted weight's principal part and the base streams as the residual, as PEFT's PiSSA
initialisation makes them; the run trains as eager PEFT PiSSA training does (losses and first
moments to 1e-5, adapters after every step); its adapter export is the LoRA of twice the rank on the
folder's own weights that PEFT's conversion writes, its merged export the trained model; a resumed
run streams the same residual from the initial adapters it kept."""
from __future__ import annotations

import os

import pytest
import torch

from megacompile.acceptance.parity import moment_error
from megacompile.errors import ArgumentError
from megacompile.train import load, log, run
from megacompile.train.data import packing
from megacompile.train.methods import pissa
from tests.train import files, finetune_runs

SEQ, BATCH, STEPS, LR = 16, 2, 3, 3e-3
RANK, TARGET = 4, ["q_proj", "v_proj", "down_proj"]


def _settings(work: dict, tmp, name: str, **kw) -> dict:
    return {**dict(model=work["model"], data=[work["notes"]], eval=[work["notes"]], seq=SEQ, batch=BATCH, steps=STEPS,
                lr=LR, schedule="constant", max_grad_norm=None, device="cpu", run_dir=str(tmp / name),
                export=str(tmp / f"{name}-export"), log_every=1, save_every=1, eval_every=STEPS, eval_batches=1,
                finetuning_type="lora", lora_rank=RANK, lora_target=",".join(TARGET), lora_dropout=0.1, seed=3,
                hbm_budget=0.0006, pissa_init=True, pissa_iter=-1), **kw}


def _eager(c, rows):
    """The run's model as eager PEFT builds it with PiSSA's full-SVD initialisation (the run's seed,
    weights read by transformers), trained on the run's batches with torch.optim.AdamW."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(c.seed)
    base = AutoModelForCausalLM.from_pretrained(c.model, dtype=torch.float32)
    base.config.use_cache = False
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", r=c.lora_rank, lora_alpha=c.lora_alpha,
                                            lora_dropout=c.lora_dropout, target_modules=c.lora_target,
                                            init_lora_weights="pissa"))
    return model, *finetune_runs.train(model, c, rows, finetune_runs.trainer_groups(model, c.weight_decay))


def test_the_initial_adapters_are_peft_pissas_and_the_low_rank_ones_seeded():
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    linear = torch.nn.Sequential(torch.nn.Linear(24, 40))
    weight = linear[0].weight.detach().clone()
    peft = get_peft_model(linear, LoraConfig(r=4, lora_alpha=8, target_modules=["0"], init_lora_weights="pissa"))
    layer = peft.base_model.model[0]
    a0, b0 = pissa.principal(weight, 4, 2.0, -1, seed=0)
    torch.testing.assert_close(a0, layer.lora_A["default"].weight, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(b0, layer.lora_B["default"].weight, rtol=1e-6, atol=1e-7)
    residual = pissa.Residual({"w": (a0, b0)}, 2.0)
    torch.testing.assert_close(residual.residual("w", weight), layer.base_layer.weight, rtol=1e-6, atol=1e-7)
    # the randomised SVD: the same draws for the same seed; where the weight's top singular values
    # stand apart, its rank-4 part is the full SVD's
    g = torch.Generator().manual_seed(1)
    spread = torch.randn(40, 4, generator=g) @ torch.randn(4, 24, generator=g) + 1e-3 * torch.randn(40, 24, generator=g)
    fast = pissa.principal(spread, 4, 2.0, 16, seed=7)
    assert all(torch.equal(x, y) for x, y in zip(fast, pissa.principal(spread, 4, 2.0, 16, seed=7)))
    full = pissa.principal(spread, 4, 2.0, -1, seed=0)
    torch.testing.assert_close(fast[1] @ fast[0], full[1] @ full[0], rtol=0, atol=1e-4)


def test_a_pissa_run_trains_as_eager_peft_pissa_and_its_exports_are_the_trained_model(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    work = files.workspace(tmp_path)
    c = load(files.run_yaml(str(tmp_path / "p.yaml"), **_settings(work, tmp_path, "p", pissa_convert=True)), [])
    run(c)
    # kept in the run folder before the first step, the initial adapters are read from there, not held
    assert c.pissa.initial is None and c.pissa.path == os.path.join(c.run_dir, pissa.INITIAL)
    rows, eval_rows = finetune_runs.rows(c, tmp_path, SEQ)
    eager, eager_losses, eager_first = _eager(c, rows)
    ours = [float(r["loss"]) for r in log.read(os.path.join(c.run_dir, "log.csv"))]
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(eager_losses), rtol=1e-5, atol=0)
    first = finetune_runs.tables(os.path.join(c.run_dir, "checkpoints", "step-000001"), "exp_avg")
    assert moment_error(first, eager_first) <= 1e-5
    masters = finetune_runs.tables(os.path.join(c.run_dir, "checkpoints", f"step-{STEPS:06d}"), "master")
    for name, p in eager.named_parameters():
        if p.requires_grad:
            assert (masters[name] - p.detach()).abs().max() <= 1e-5 * p.detach().abs().max(), name

    # The adapter, converted: on the folder's own weights, the trained model (eager's, merged).
    eval_batch = packing.batch(eval_rows, 0, BATCH, shifted=False)
    base = AutoModelForCausalLM.from_pretrained(c.model, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, c.export).eval()
    assert loaded.peft_config["default"].r == 2 * RANK
    with torch.no_grad():
        theirs = eager.eval()(**eval_batch).loss.item()
        assert abs(loaded(**eval_batch).loss.item() - theirs) <= 1e-5 * theirs
    # merged: the residual the host held plus the trained adapters
    merged_c = load(files.run_yaml(str(tmp_path / "m.yaml"), **_settings(work, tmp_path, "m", merge_adapter=True)), [])
    run(merged_c)
    merged = AutoModelForCausalLM.from_pretrained(merged_c.export, dtype=torch.float32).state_dict()
    for name, t in eager.merge_and_unload().state_dict().items():
        assert (merged[name] - t).abs().max() <= 1e-5 * t.abs().max(), name


@pytest.mark.slow   # three short runs
def test_a_resumed_pissa_run_goes_on_as_the_uninterrupted_one(tmp_path):
    work = files.workspace(tmp_path)

    def settings(name: str, steps: int) -> str:
        return files.run_yaml(str(tmp_path / f"{name}-{steps}.yaml"), **{
            **_settings(work, tmp_path, name, pissa_iter=4), "steps": steps, "resume": "auto", "eval": [],
            "eval_every": None, "eval_batches": None})
    run(load(settings("resumed", 2), []))
    run(load(settings("resumed", 4), []))
    run(load(settings("whole", 4), []))
    resumed, whole = (log.read(str(tmp_path / name / "log.csv")) for name in ("resumed", "whole"))
    assert [float(r["loss"]) for r in resumed] == [float(r["loss"]) for r in whole]
    os.remove(tmp_path / "resumed" / pissa.INITIAL)
    with pytest.raises(ArgumentError, match="pissa_init.safetensors is missing"):
        run(load(settings("resumed", 5), []))


@pytest.mark.parametrize("more, says", [
    (dict(use_dora=True), "pissa_init: use_dora's magnitudes start from the weight's norms"),
    (dict(use_rslora=True), "pissa_init: use_rslora's scaling does not survive the conversion"),
    (dict(stage="dpo", packing=None), "pissa_init: stage dpo's reference is the base with the adapters off"),
    (dict(finetuning_type="full", lora_rank=None, lora_target=None, lora_dropout=None),
     "pissa_init: finetuning_type is not lora"),
    (dict(pissa_iter=-2), "pissa_iter is the randomised SVD's subspace iterations"),
])
def test_what_pissa_cannot_start_is_refused(tmp_path, more, says):
    work = files.workspace(tmp_path)
    settings = {k: v for k, v in {**_settings(work, tmp_path, "r"), **more}.items() if v is not None}
    with pytest.raises(ArgumentError, match=says.replace("(", r"\(").replace(")", r"\)")):
        load(files.run_yaml(str(tmp_path / "r.yaml"), **settings), [])


def test_a_weight_the_added_tokens_grow_takes_no_pissa_adapter(tmp_path):
    work = files.workspace(tmp_path)
    settings = {**_settings(work, tmp_path, "g"), "lora_target": "q_proj,lm_head", "add_tokens": ["zorblax"],
                "additional_target": ["embed_tokens"]}
    with pytest.raises(ArgumentError, match="pissa_init: lm_head.weight takes an adapter and grows by the tokens"):
        run(load(files.run_yaml(str(tmp_path / "g.yaml"), **settings), []))
    assert not os.path.exists(tmp_path / "g")
