"""A resumed run whose AdamW exempts other parameters from weight decay than the checkpoint's run
did says so, naming them, and goes on with its own (as it does for a changed lr or betas)."""
from __future__ import annotations

from megacompile.train import load, model, run

TINY = ["bundled_model.dim=32", "bundled_model.layers=1", "bundled_model.heads=2", "bundled_model.kv_heads=1",
        "bundled_model.ffn=64", "device=cpu", "batch=1", "seq=16", "save_every=1", "resume=auto", "weight_decay=0.1"]


def test_a_resume_under_another_no_decay_says_which_parameters_changed(tmp_path, monkeypatch, capsys):
    tiny = [*TINY, f"run_dir={tmp_path / 'run'}"]
    run(load(None, ["steps=1", *tiny]))
    capsys.readouterr()
    monkeypatch.setattr(model, "hf_no_decay", lambda m: [])      # every parameter decayed now
    assert run(load(None, ["steps=2", *tiny]))["steps"] == 2
    notes = [line for line in capsys.readouterr().out.splitlines() if "resume note" in line]
    assert any("other parameters exempt from weight decay, this engine's AdamW no_decay is kept: no_decay: the "
               "checkpoint's run stepped" in line and "this engine 0 (decayed now: " in line for line in notes), notes
