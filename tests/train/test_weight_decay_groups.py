"""run.yaml's weight_decay means what it means under Hugging Face's Trainer (and so in a TRL or
LlamaFactory config): biases and norm weights are not decayed. The run hands its AdamW
megacompile.hf_no_decay, and trains as eager torch.optim.AdamW over the Trainer's two groups."""
from __future__ import annotations

import os

import torch

import megacompile
from megacompile.train import load, log, loop, run
from tests.train import files, finetune_runs

SEQ = 16


def test_a_runs_weight_decay_skips_what_the_trainer_skips_and_trains_as_eager(tmp_path, monkeypatch):
    engines = []
    build = loop.build

    def recorded(*args, **kwargs):
        setup = build(*args, **kwargs)
        engines.append(setup.engine)
        return setup
    monkeypatch.setattr(loop, "build", recorded)
    work = files.workspace(tmp_path)
    c = load(files.run_yaml(str(tmp_path / "wd.yaml"), model=work["model"], data=[work["notes"]],
                            eval=[work["notes"]], seq=SEQ, batch=2, steps=3, lr=3e-3, schedule="constant",
                            weight_decay=0.1, max_grad_norm=None, device="cpu", run_dir=str(tmp_path / "run"),
                            log_every=1, save_every=3), [])
    run(c)
    rows, _ = finetune_runs.rows(c, tmp_path, SEQ)
    eager, losses, _ = finetune_runs.eager(c, rows)

    (engine,) = engines
    assert engine.optimizer.weight_decay == 0.1 and engine.optimizer.no_decay is megacompile.hf_no_decay
    decayed = {id(p) for g in finetune_runs.trainer_groups(eager, 0.1) if g["weight_decay"] for p in g["params"]}
    exempt = {n for n, p in eager.named_parameters() if id(p) not in decayed}
    assert engine.state.no_decay == exempt and "model.norm.weight" in exempt     # the Trainer's second group

    ours = [float(r["loss"]) for r in log.read(os.path.join(c.run_dir, "log.csv"))]
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(losses), rtol=1e-5, atol=0)
    masters = finetune_runs.tables(os.path.join(c.run_dir, "checkpoints", "step-000003"), "master")
    for name, p in eager.named_parameters():
        ref = p.detach()
        assert (masters[name] - ref).abs().max() <= 1e-5 * ref.abs().max(), name
