"""additional_target (LlamaFactory's key): modules trained whole beside a LoRA run's adapters, PEFT's
modules_to_save. The run trains as eager PEFT built with modules_to_save does (losses to 1e-5, the
trained copies and adapters to 1e-5 after every step), the frozen originals stream from the folder
and the copies start from its files; the adapter export holds the copies as PEFT names them and
PEFT loads it to the engine's eval loss; the merged export is PEFT's merge."""
from __future__ import annotations

import os

import pytest
import torch

from megacompile.errors import ArgumentError
from megacompile.train import load, log, run
from megacompile.train.data import packing
from tests.train import files, finetune_runs

SEQ, BATCH, STEPS, LR, RANK = 16, 2, 3, 3e-3, 4
TARGET, WHOLE = ["q_proj", "v_proj"], ["lm_head", "embed_tokens"]


def _settings(work: dict, tmp, name: str, **kw) -> dict:
    return dict(model=work["model"], data=[work["notes"]], eval=[work["notes"]], seq=SEQ, batch=BATCH, steps=STEPS,
                lr=LR, schedule="constant", max_grad_norm=None, device="cpu", run_dir=str(tmp / name),
                export=str(tmp / f"{name}-export"), log_every=1, save_every=STEPS, eval_every=STEPS,
                eval_batches=1, finetuning_type="lora", lora_rank=RANK, lora_target=",".join(TARGET),
                additional_target=",".join(WHOLE), seed=3, **kw)


def _eager(c, rows):
    """PEFT's own wrapper with modules_to_save (not the run's method code), trained on the run's batches."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(c.seed)
    base = AutoModelForCausalLM.from_pretrained(c.model, dtype=torch.float32)
    base.config.use_cache = False
    eager = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", r=RANK, lora_alpha=c.lora_alpha,
                                            lora_dropout=0.0, target_modules=TARGET, modules_to_save=WHOLE))
    losses, _ = finetune_runs.train(eager, c, rows, finetune_runs.trainer_groups(eager, c.weight_decay))
    return eager, losses


def test_modules_trained_whole_beside_the_adapters_train_and_export_as_peft(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    work = files.workspace(tmp_path)
    c = load(files.run_yaml(str(tmp_path / "whole.yaml"), **_settings(work, tmp_path, "whole")), [])
    run(c)
    rows, eval_rows = finetune_runs.rows(c, tmp_path, SEQ)
    eager, losses = _eager(c, rows)
    logged = log.read(os.path.join(c.run_dir, "log.csv"))
    torch.testing.assert_close(torch.tensor([float(r["loss"]) for r in logged]), torch.tensor(losses),
                               rtol=1e-5, atol=0)
    masters = finetune_runs.tables(os.path.join(c.run_dir, "checkpoints", f"step-{STEPS:06d}"), "master")
    trained = {n: p.detach() for n, p in eager.named_parameters() if p.requires_grad}
    assert set(masters) == set(trained)
    assert {n for n in trained if ".modules_to_save." in n} == {
        "base_model.model.lm_head.modules_to_save.default.weight",
        "base_model.model.model.embed_tokens.modules_to_save.default.weight"}
    for name, p in trained.items():
        assert (masters[name] - p).abs().max() <= 1e-5 * p.abs().max(), name

    engine_eval = float(logged[-1]["eval_loss"])
    eval_batch = packing.batch(eval_rows, 0, BATCH, shifted=False)
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(c.model, dtype=torch.float32),
                                       c.export).eval()
    with torch.no_grad():
        assert abs(loaded(**eval_batch).loss.item() - engine_eval) <= 1e-5 * engine_eval
        # the original modules stayed the folder's: with the adapter off, the base model's loss
        with loaded.disable_adapter():
            off = loaded(**eval_batch).loss.item()
        base = AutoModelForCausalLM.from_pretrained(c.model, dtype=torch.float32).eval()(**eval_batch).loss.item()
    assert off == pytest.approx(base, rel=1e-6)


@pytest.mark.slow       # 7 s; the merge itself is test_lora_merge.py's in the default tier
def test_the_merged_export_with_modules_trained_whole_is_peft_merge(tmp_path):
    from transformers import AutoModelForCausalLM
    work = files.workspace(tmp_path)
    c = load(files.run_yaml(str(tmp_path / "merged.yaml"), **_settings(work, tmp_path, "merged", merge_adapter=True)),
             [])
    run(c)
    rows, _ = finetune_runs.rows(c, tmp_path, SEQ)
    eager, _ = _eager(c, rows)
    merged = AutoModelForCausalLM.from_pretrained(c.export, dtype=torch.float32).state_dict()
    for name, t in eager.merge_and_unload().state_dict().items():
        assert (merged[name] - t).abs().max() <= 1e-5 * t.abs().max(), name


def test_the_copies_start_from_the_folders_files(tmp_path):
    """The skeleton's base is never initialised: each copy is read from the files. Under torch's
    deterministic mode uninitialised memory is NaN, so a copy left as built shows."""
    from safetensors.torch import load_file
    from megacompile.train.model import make_module, meta_model
    work = files.workspace(tmp_path)
    c = load(files.run_yaml(str(tmp_path / "r.yaml"), **_settings(work, tmp_path, "r")), [])
    torch.use_deterministic_algorithms(True)
    try:
        module = make_module(c, meta_model(c), quiet=True)
    finally:
        torch.use_deterministic_algorithms(False)
    saved = load_file(os.path.join(work["model"], "model.safetensors"))
    inner = module.base_model.model
    assert torch.equal(inner.lm_head.modules_to_save.default.weight, saved["lm_head.weight"])
    assert torch.equal(inner.model.embed_tokens.modules_to_save.default.weight, saved["model.embed_tokens.weight"])
    assert inner.lm_head.original_module.weight.is_meta         # the frozen original streams from the files


@pytest.mark.parametrize("extra, says", [
    (dict(additional_target="wte"), "additional_target: wte names no module of LlamaForCausalLM"),
    (dict(additional_target="q_proj"), "additional_target: q_proj is in lora_target too"),
    (dict(additional_target="lm_head", stage="dpo"), "additional_target trains whole modules beside the adapters in "
                                                      "stages sft and pt; under stage dpo"),
    (dict(additional_target="lm_head", finetuning_type="full"), "additional_target applies to finetuning_type: lora"),
])
def test_a_module_that_cannot_train_whole_is_refused_by_name(tmp_path, extra, says):
    from tests.posttrain import stage_files
    work = files.workspace(tmp_path)
    settings = {**_settings(work, tmp_path, "r"), **extra}
    if settings.get("stage") == "dpo":
        settings["data"] = stage_files.pairs(str(tmp_path / "pairs.jsonl"))
    if settings["finetuning_type"] == "full":
        for key in ("lora_rank", "lora_target"):
            del settings[key]
    with pytest.raises(ArgumentError) as e:
        run(load(files.run_yaml(str(tmp_path / "r.yaml"), **settings), []))
    assert says in str(e.value)
