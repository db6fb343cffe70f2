"""finetuning_type: lora from a run file trains what eager PEFT training trains (same seed, same
batches, torch.optim.AdamW): the same losses and first-step gradients to 1e-5, host state for the
adapters alone; the exported adapter loads with PEFT and the merged export with transformers, and
both give the trained engine's own eval loss."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from megacompile.train import load, log, run
from megacompile.train.data import packing
from megacompile.acceptance.parity import moment_error
from megacompile.train.methods import apply as apply_finetuning
from tests.train import files, finetune_runs

SEQ, BATCH, STEPS, LR = 16, 2, 3, 3e-3
BUDGET = 0.0004     # GiB: about the weights, so the blocks stream and one is recomputed
RANK, TARGET = 4, ["q_proj", "v_proj", "down_proj"]


def _settings(work: dict, tmp, name: str, **kw) -> dict:
    return dict(model=work["model"], data=[work["notes"]], eval=[work["notes"]], seq=SEQ, batch=BATCH, steps=STEPS,
                lr=LR, schedule="constant", max_grad_norm=None, device="cpu", run_dir=str(tmp / name),
                export=str(tmp / f"{name}-export"), log_every=1, save_every=1, eval_every=STEPS,
                eval_batches=1, finetuning_type="lora",
                lora_rank=RANK, lora_target=",".join(TARGET), lora_dropout=0.1, seed=3, hbm_budget=BUDGET, **kw)


def test_a_lora_run_trains_as_eager_peft_and_its_exports_load(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    work = files.workspace(tmp_path)
    c = load(files.run_yaml(str(tmp_path / "lora.yaml"), **_settings(work, tmp_path, "lora")), [])
    os.makedirs(c.export)
    with open(os.path.join(c.export, "README.md"), "w") as f:
        f.write("# my adapter\n")
    result = run(c)
    rows, eval_rows = finetune_runs.rows(c, tmp_path, SEQ)
    eager, eager_losses, eager_first = finetune_runs.eager(c, rows)

    logged = log.read(os.path.join(c.run_dir, "log.csv"))
    ours = [float(r["loss"]) for r in logged]
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(eager_losses), rtol=1e-5, atol=0)
    first = finetune_runs.tables(os.path.join(c.run_dir, "checkpoints", "step-000001"), "exp_avg")
    trainable, total = eager.get_nb_trainable_parameters()
    assert set(first) == {n for n, p in eager.named_parameters() if p.requires_grad}
    assert moment_error(first, eager_first) <= 1e-5

    # The plan: the adapters alone trainable, their masters and moments alone on the host.
    with open(os.path.join(c.run_dir, "plan", "plan.json")) as f:
        plan = json.load(f)
    assert plan["trainable_params"] == trainable and plan["trainable_params"] + plan["frozen_params"] == total
    masters = finetune_runs.tables(os.path.join(c.run_dir, "checkpoints", f"step-{STEPS:06d}"), "master")
    assert sum(t.numel() for t in masters.values()) == trainable
    for name, p in eager.named_parameters():        # the adapters after every step, as eager's
        if p.requires_grad:
            assert (masters[name] - p.detach()).abs().max() <= 1e-5 * p.detach().abs().max(), name
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
    with open(os.path.join(adapter, "README.md")) as f:
        assert f.read() == "# my adapter\n"          # kept: PEFT's model card is left out
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


def test_a_dora_run_trains_as_eager_peft_dora_and_its_merged_export_is_peft_merge(tmp_path):
    """use_dora: true (LlamaFactory's key): PEFT's DoRA, a learned magnitude per output beside each
    adapter, trains as eager PEFT DoRA does; the merged export (PEFT's merge) and megacompile's own
    merge of a state_dict (methods.merged, which a reward model's export uses) give the same weights."""
    from transformers import AutoModelForCausalLM
    from megacompile.train.methods import merged
    work = files.workspace(tmp_path)
    # DoRA's norm of each adapted weight holds a weight's size more in its block: a budget of 1.5x the weights
    c = load(files.run_yaml(str(tmp_path / "dora.yaml"), **{**_settings(work, tmp_path, "dora", use_dora=True),
                                                            "merge_adapter": True, "hbm_budget": 0.0012}), [])
    run(c)
    rows, _ = finetune_runs.rows(c, tmp_path, SEQ)
    eager, losses, eager_first = finetune_runs.eager(c, rows)
    assert any("lora_magnitude_vector" in n for n, p in eager.named_parameters() if p.requires_grad)
    ours = [float(r["loss"]) for r in log.read(os.path.join(c.run_dir, "log.csv"))]
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(losses), rtol=1e-5, atol=0)
    first = finetune_runs.tables(os.path.join(c.run_dir, "checkpoints", "step-000001"), "exp_avg")
    assert moment_error(first, eager_first) <= 1e-5
    exported = AutoModelForCausalLM.from_pretrained(c.export, dtype=torch.float32).state_dict()
    ours_merged = merged(eager.base_model.model.state_dict(), c.lora_alpha / c.lora_rank)
    theirs = eager.merge_and_unload().state_dict()
    for name, t in theirs.items():
        assert (ours_merged[name] - t).abs().max() <= 1e-5 * t.abs().max(), name
        assert (exported[name] - t).abs().max() <= 1e-5 * t.abs().max(), name


def test_a_rank_stabilised_lora_run_trains_as_eager_peft_and_its_adapter_loads_so(tmp_path):
    """use_rslora: true (LlamaFactory's and TRL's key): PEFT's rank-stabilised LoRA, whose adapters
    scale by lora_alpha / sqrt(lora_rank), trains as eager PEFT built with it does; the exported
    adapter says so in its config, and PEFT loads it to the engine's own eval loss."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM
    from megacompile.train.methods import merged, scaling
    work = files.workspace(tmp_path)
    c = load(files.run_yaml(str(tmp_path / "rslora.yaml"), **_settings(work, tmp_path, "rslora", use_rslora=True)), [])
    run(c)
    rows, eval_rows = finetune_runs.rows(c, tmp_path, SEQ)
    # The reference is PEFT's own wrapper with use_rslora, not the run's method code.
    torch.manual_seed(c.seed)
    base = AutoModelForCausalLM.from_pretrained(c.model, dtype=torch.float32)
    base.config.use_cache = False
    eager = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", r=RANK, lora_alpha=c.lora_alpha,
                                            lora_dropout=c.lora_dropout, target_modules=TARGET, use_rslora=True))
    adapted = eager.base_model.model.model.layers[0].self_attn.q_proj
    assert adapted.scaling["default"] == c.lora_alpha / RANK ** 0.5 == scaling(eager.peft_config["default"])
    losses, _ = finetune_runs.train(eager, c, rows, finetune_runs.trainer_groups(eager, c.weight_decay))
    logged = log.read(os.path.join(c.run_dir, "log.csv"))
    torch.testing.assert_close(torch.tensor([float(r["loss"]) for r in logged]), torch.tensor(losses),
                               rtol=1e-5, atol=0)
    with open(os.path.join(c.export, "adapter_config.json")) as f:
        assert json.load(f)["use_rslora"] is True
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(c.model, dtype=torch.float32),
                                       c.export).eval()
    with torch.no_grad():
        loss = loaded(**packing.batch(eval_rows, 0, BATCH, shifted=False)).loss.item()
    engine_eval = float(logged[-1]["eval_loss"])
    assert abs(loss - engine_eval) <= 1e-5 * engine_eval
    # megacompile's merge (a reward model's export) at the rank-stabilised scale is PEFT's.
    ours = merged(eager.base_model.model.state_dict(), scaling(eager.peft_config["default"]))
    for name, t in eager.merge_and_unload().state_dict().items():
        assert (ours[name] - t).abs().max() <= 1e-5 * t.abs().max(), name


def test_a_loraplus_run_trains_as_llamafactorys_loraplus_groups(tmp_path):
    """loraplus_lr_ratio (LlamaFactory's LoRA+): each adapter's B and every trained 1-D parameter
    (DoRA's magnitudes here) at lr x the ratio, the A matrices at lr, weight decay as the Trainer
    splits it. Eager PEFT trained with those param groups of torch.optim.AdamW gives the same losses
    and first moments to 1e-5; the checkpoint records the ratios, which a resume holds to."""
    ratio = 16.0
    work = files.workspace(tmp_path)
    c = load(files.run_yaml(str(tmp_path / "plus.yaml"), **{**_settings(work, tmp_path, "plus", use_dora=True,
                                                                         loraplus_lr_ratio=ratio, weight_decay=0.01),
                                                           "hbm_budget": 0.0012}), [])
    run(c)
    rows, _ = finetune_runs.rows(c, tmp_path, SEQ)
    torch.manual_seed(c.seed)
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(c.model, dtype=torch.float32)
    base.config.use_cache = False
    eager = apply_finetuning(c, base)
    trainable = {n: p for n, p in eager.named_parameters() if p.requires_grad}
    plus = {n for n, p in trainable.items() if "lora_B" in n or p.ndim == 1}      # LlamaFactory's rule
    assert any("lora_magnitude_vector" in n for n in plus) and any("lora_A" in n for n in set(trainable) - plus)
    losses, first = finetune_runs.train(eager, c, rows, finetune_runs.loraplus_groups(eager, c.lr, c.weight_decay,
                                                                                      ratio))
    ours = [float(r["loss"]) for r in log.read(os.path.join(c.run_dir, "log.csv"))]
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(losses), rtol=1e-5, atol=0)
    assert moment_error(finetune_runs.tables(os.path.join(c.run_dir, "checkpoints", "step-000001"), "exp_avg"),
                        first) <= 1e-5
    with open(os.path.join(c.run_dir, "checkpoints", f"step-{STEPS:06d}", "manifest.json")) as f:
        recorded = json.load(f)["optimizer"]["lr_ratios"]
    assert recorded == {n: ratio for n in sorted(plus)}


def test_a_bfloat16_lora_run_holds_its_frozen_base_in_bfloat16(tmp_path):
    """bfloat16 compute reads the base in bfloat16 only: the host holds it so (half the RAM), and
    the run trains as eager float32 PEFT does, to bfloat16's rounding."""
    from megacompile.acceptance.parity import BF16_LOSS_RTOL
    work = files.workspace(tmp_path)
    c = load(files.run_yaml(str(tmp_path / "bf16.yaml"), **_settings(work, tmp_path, "bf16", compute_dtype="bfloat16")),
             [])
    run(c)
    rows, _ = finetune_runs.rows(c, tmp_path, SEQ)
    eager, losses, _ = finetune_runs.eager(dataclasses.replace(c, compute_dtype="float32"), rows)
    ours = [float(r["loss"]) for r in log.read(os.path.join(c.run_dir, "log.csv"))]
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(losses), rtol=BF16_LOSS_RTOL, atol=0)
    with open(os.path.join(c.run_dir, "plan", "plan.json")) as f:
        plan = json.load(f)
    trainable, total = eager.get_nb_trainable_parameters()
    buffers = sum(b.numel() * b.element_size() for b in eager.buffers())
    assert plan["host_frozen_bytes"] == 2 * (total - trainable) + buffers


@pytest.mark.slow   # three short runs: ~20 s on 2 cores
def test_a_resumed_lora_run_goes_on_as_the_uninterrupted_one_and_replaces_its_own_adapter(tmp_path):
    work = files.workspace(tmp_path)

    def settings(name: str, steps: int) -> str:
        return files.run_yaml(str(tmp_path / f"{name}-{steps}.yaml"), **{
            **_settings(work, tmp_path, name), "steps": steps, "resume": "auto", "eval": [], "eval_every": None,
            "eval_batches": None, "hbm_budget": 0.0006, "lora_target": "all"})
    run(load(settings("resumed", 2), []))
    first = (tmp_path / "resumed-export" / "adapter_model.safetensors").read_bytes()
    run(load(settings("resumed", 4), []))
    run(load(settings("whole", 4), []))
    resumed, whole = (log.read(str(tmp_path / name / "log.csv")) for name in ("resumed", "whole"))
    assert [float(r["loss"]) for r in resumed] == [float(r["loss"]) for r in whole]      # dropout's draws too
    ours = (tmp_path / "resumed-export" / "adapter_model.safetensors").read_bytes()
    assert ours != first and ours == (tmp_path / "whole-export" / "adapter_model.safetensors").read_bytes()


@pytest.mark.slow   # the fused kernels run on Triton's interpreter on the cpu: ~20 s
def test_a_fused_lora_run_trains_as_eager_peft(tmp_path):
    """fuse: true (a GPU run's default): the adapters' matmuls beside the fused kernels, and the
    frozen embedding's stage, whose backward computes nothing, train as eager PEFT does."""
    work = files.workspace(tmp_path)
    c = load(files.run_yaml(str(tmp_path / "fused.yaml"), **{
        **_settings(work, tmp_path, "fused", fuse=True), "eval": [], "eval_every": None, "eval_batches": None,
        "export": None, "hbm_budget": 0.0006, "lora_target": "all"}), [])
    run(c)
    assert os.path.isfile(os.path.join(c.run_dir, "plan", "fusion.txt"))     # the stages ran fused kernels
    rows, _ = finetune_runs.rows(dataclasses.replace(c, eval=[work["notes"]]), tmp_path, SEQ)
    eager, losses, eager_first = finetune_runs.eager(c, rows)
    ours = [float(r["loss"]) for r in log.read(os.path.join(c.run_dir, "log.csv"))]
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(losses), rtol=1e-5, atol=0)
    first = finetune_runs.tables(os.path.join(c.run_dir, "checkpoints", "step-000001"), "exp_avg")
    assert moment_error(first, eager_first) <= 1e-5


def test_the_engine_holds_the_frozen_base_once(tmp_path):
    """PEFT wraps an uninitialised model, and the base streams from the folder's files into the
    host state: the module's base is on meta (the adapters are its own), so the host holds the
    base once, as planned."""
    from megacompile.train.model import build, meta_model
    work = files.workspace(tmp_path)
    c = load(files.run_yaml(str(tmp_path / "once.yaml"), **_settings(work, tmp_path, "once")), [])
    rows, _ = finetune_runs.rows(c, tmp_path, SEQ)
    setup = build(c, apply_finetuning(c, meta_model(c)), lambda b: packing.batch(rows, 0, b, shifted=False))
    try:
        frozen = {n for n, p in setup.engine.model.named_parameters() if not p.requires_grad}
        assert frozen and all(p.is_meta for n, p in setup.engine.model.named_parameters() if n in frozen)
        assert not any(p.is_meta for p in setup.engine.model.parameters() if p.requires_grad)
        assert setup.engine.host.nbytes == setup.engine.plan.host_bytes
    finally:
        setup.engine.close()


def test_wrapping_a_model_in_adapters_prints_no_warning_between_peft_and_transformers():
    """PEFT reads transformers' deprecated is_gradient_checkpointing: every run and plan with LoRA
    printed that FutureWarning, which nothing in a run.yaml could change."""
    import warnings

    from transformers import LlamaConfig, LlamaForCausalLM

    from megacompile.train.methods.lora import with_adapters
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        with_adapters(model, 2, 4.0, 0.0, "all")
