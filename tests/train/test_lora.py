"""finetuning_type: lora from a run file trains what eager PEFT training trains (same seed, same
batches, torch.optim.AdamW): the same losses and first-step gradients to 1e-5, host state for the
adapters alone; the exported adapter loads with PEFT and the merged export with transformers, and
both give the trained engine's own eval loss."""
from __future__ import annotations

import json
import os

import pytest
import safetensors.torch
import torch

from megacompile.train import load, log, run
from megacompile.train.finetune import apply as apply_finetuning
from megacompile.train import packing
from megacompile.acceptance.parity import moment_error
from tests.train import files

SEQ, BATCH, STEPS, LR = 16, 2, 3, 3e-3
BUDGET = 0.0004     # GiB: about the weights, so the blocks stream and one is recomputed
RANK, TARGET = 4, ["q_proj", "v_proj", "down_proj"]


def _settings(work: dict, tmp, name: str, **kw) -> dict:
    return dict(model=work["model"], data=[work["notes"]], eval=[work["notes"]], seq=SEQ, batch=BATCH, steps=STEPS,
                lr=LR, schedule="constant", max_grad_norm=None, device="cpu", run_dir=str(tmp / name),
                export=str(tmp / f"{name}-export"), log_every=1, save_every=1, eval_every=STEPS,
                eval_batches=1, finetuning_type="lora",
                lora_rank=RANK, lora_target=",".join(TARGET), lora_dropout=0.1, seed=3, hbm_budget=BUDGET, **kw)


def _eager(c, rows) -> tuple[torch.nn.Module, list[float], dict]:
    """The run's model as eager PEFT builds it (the run's seed, weights read by transformers),
    trained on the run's batches with torch.optim.AdamW."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(c.seed)
    base = AutoModelForCausalLM.from_pretrained(c.model, dtype=torch.float32)
    base.config.use_cache = False
    model = apply_finetuning(c, base)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(trainable.values(), lr=c.lr, betas=tuple(c.betas), eps=c.eps, weight_decay=c.weight_decay)
    losses, first = [], {}
    for step in range(c.steps):
        opt.zero_grad(set_to_none=True)
        loss = model(**packing.batch(rows, step * c.batch, c.batch, shifted=False)).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step == 0:
            first = {n: opt.state[p]["exp_avg"].clone() for n, p in trainable.items()}
    return model, losses, first


def _tables(checkpoint: str, table: str) -> dict:
    out = {}
    for f in sorted(os.listdir(checkpoint)):
        if f.startswith("owner-"):
            out.update({k.split("/", 1)[1]: v for k, v in safetensors.torch.load_file(os.path.join(checkpoint, f)).items()
                        if k.startswith(table + "/")})
    return out


def _rows(c, tmp) -> tuple[packing.Rows, packing.Rows]:
    """The run's training rows and held-out rows, as the run reads them."""
    from megacompile.train.tokens import load_tokenizer, token_file
    tok = load_tokenizer(c.model)
    train = token_file(str(tmp / "tokens"), "train", c.data, tok, c.model, c.train_on_prompt)
    held = token_file(str(tmp / "tokens"), "eval", c.eval, tok, c.model, c.train_on_prompt)
    return (packing.Rows(train, SEQ, c.packing, c.seed, pad_id=tok.pad_token_id),
            packing.Rows(held, SEQ, c.packing, c.seed, shuffle=False, pad_id=tok.pad_token_id))


def test_a_lora_run_trains_as_eager_peft_and_its_exports_load(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    work = files.workspace(tmp_path)
    c = load(files.run_yaml(str(tmp_path / "lora.yaml"), **_settings(work, tmp_path, "lora")), [])
    result = run(c)
    rows, eval_rows = _rows(c, tmp_path)
    eager, eager_losses, eager_first = _eager(c, rows)

    logged = log.read(os.path.join(c.run_dir, "log.csv"))
    ours = [float(r["loss"]) for r in logged]
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(eager_losses), rtol=1e-5, atol=0)
    first = _tables(os.path.join(c.run_dir, "checkpoints", "step-000001"), "exp_avg")
    trainable, total = eager.get_nb_trainable_parameters()
    assert set(first) == {n for n, p in eager.named_parameters() if p.requires_grad}
    assert moment_error(first, eager_first) <= 1e-5

    # The plan: the adapters alone trainable, their masters and moments alone on the host.
    with open(os.path.join(c.run_dir, "plan", "plan.json")) as f:
        plan = json.load(f)
    assert plan["trainable_params"] == trainable and plan["trainable_params"] + plan["frozen_params"] == total
    masters = _tables(os.path.join(c.run_dir, "checkpoints", f"step-{STEPS:06d}"), "master")
    assert sum(t.numel() for t in masters.values()) == trainable
    assert plan["host_tiers"]["fp32 masters"]["bytes"] == 4 * trainable
    assert plan["host_tiers"]["exp_avg+exp_avg_sq"]["bytes"] == 8 * trainable
    frozen = {n: p for n, p in eager.named_parameters() if not p.requires_grad}
    assert plan["host_frozen_bytes"] >= sum(p.numel() * p.element_size() for p in frozen.values())

    # Both exports give the trained model's eval loss, the engine's own (eval_every: the last step).
    engine_eval = float(logged[-1]["eval_loss"])
    eval_batch = packing.batch(eval_rows, 0, BATCH, shifted=False)     # eval_batches: 1
    adapter = c.export
    assert sorted(f for f in os.listdir(adapter) if f.startswith("adapter")) == ["adapter_config.json",
                                                                                "adapter_model.safetensors"]
    assert not os.path.exists(os.path.join(adapter, "README.md"))
    base = AutoModelForCausalLM.from_pretrained(c.model, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, adapter).eval()
    with torch.no_grad():
        adapter_loss = loaded(**eval_batch).loss.item()
        eager_loss = eager.eval()(**eval_batch).loss.item()
    assert abs(adapter_loss - engine_eval) <= 1e-5 * engine_eval
    assert abs(eager_loss - engine_eval) <= 1e-5 * engine_eval

    merged_c = load(files.run_yaml(str(tmp_path / "merged.yaml"), **_settings(
        work, tmp_path, "merged", merge_adapter=True)), [])
    run(merged_c)
    merged_eval = float(log.read(os.path.join(merged_c.run_dir, "log.csv"))[-1]["eval_loss"])
    assert merged_eval == engine_eval        # the same run again
    merged = AutoModelForCausalLM.from_pretrained(merged_c.export, dtype=torch.float32).eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        merged_loss = merged(**eval_batch).loss.item()
    assert abs(merged_loss - engine_eval) <= 1e-5 * engine_eval
    assert result["steps"] == STEPS
