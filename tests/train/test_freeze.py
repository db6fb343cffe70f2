"""finetuning_type: freeze from a run file: the last block (and lm_head) train exactly as eager
torch.optim.AdamW trains them with the rest frozen, and the frozen blocks hold no master and no
moments on the host (the checkpoint and the plan's host bytes say so)."""
from __future__ import annotations

import json
import os

import torch

from megacompile.acceptance.parity import moment_error
from megacompile.train import load, log, run
from tests.train import files, finetune_runs

SEQ = 16


def test_a_freeze_run_trains_the_chosen_blocks_as_eager_and_keeps_no_state_for_the_rest(tmp_path):
    work = files.workspace(tmp_path)
    c = load(files.run_yaml(str(tmp_path / "freeze.yaml"), model=work["model"], data=[work["notes"]],
                            eval=[work["notes"]], seq=SEQ, batch=2, steps=3, lr=3e-3, schedule="constant",
                            max_grad_norm=None, device="cpu", hbm_budget=0.0004, run_dir=str(tmp_path / "run"),
                            log_every=1, save_every=1, finetuning_type="freeze", freeze_trainable_layers=1,
                            freeze_trainable_modules="self_attn,mlp.down_proj", freeze_extra_modules="lm_head"), [])
    run(c)
    rows, _ = finetune_runs.rows(c, tmp_path, SEQ)
    eager, losses, eager_first = finetune_runs.eager(c, rows)
    trainable = {n: p for n, p in eager.named_parameters() if p.requires_grad}
    assert sorted(trainable) == ["lm_head.weight", "model.layers.1.mlp.down_proj.weight",
                                 "model.layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.o_proj.weight",
                                 "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.v_proj.weight"]

    ours = [float(r["loss"]) for r in log.read(os.path.join(c.run_dir, "log.csv"))]
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(losses), rtol=1e-5, atol=0)
    first = finetune_runs.tables(os.path.join(c.run_dir, "checkpoints", "step-000001"), "exp_avg")
    assert moment_error(first, eager_first) <= 1e-5          # the trained ones alone have moments
    masters = finetune_runs.tables(os.path.join(c.run_dir, "checkpoints", "step-000003"), "master")
    assert set(masters) == set(trainable)
    for name, p in trainable.items():
        ref = p.detach()
        assert (masters[name] - ref).abs().max() <= 1e-5 * ref.abs().max(), name

    with open(os.path.join(c.run_dir, "plan", "plan.json")) as f:
        plan = json.load(f)
    n = sum(p.numel() for p in trainable.values())
    assert plan["trainable_params"] == n
    assert plan["frozen_params"] == sum(p.numel() for p in eager.parameters()) - n
    assert plan["host_tiers"]["fp32 masters"]["bytes"] == 4 * n
    assert plan["host_tiers"]["exp_avg+exp_avg_sq"]["bytes"] == 8 * n
    assert plan["host_frozen_bytes"] >= 4 * plan["frozen_params"]
