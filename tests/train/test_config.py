"""run.yaml is checked key by key before anything is loaded or written."""
from __future__ import annotations

import math
import os

import pytest

from megacompile.errors import ArgumentError
from megacompile.train import load
from megacompile.train.schedule import learning_rate
from tests.train import files


def _yaml(tmp_path, **settings) -> str:
    (tmp_path / "d.jsonl").write_text('{"text": "a b"}\n')
    base = dict(data="d.jsonl", steps=2, run_dir="run")
    return files.run_yaml(str(tmp_path / "run.yaml"), **{**base, **settings})


@pytest.mark.parametrize("settings, overrides, message", [
    ({"learnin_rate": 1e-3}, [], "unknown key learnin_rate (did you mean learning_rate?)"),
    ({"schedule": "exp"}, [], "schedule must be one of constant, linear, cosine; got 'exp'"),
    ({"accumulation": "block"}, [], "accumulation must be one of micro, layer, auto; got 'block'"),
    ({"updates": "as_gradients_land"}, [], "updates: as_gradients_land cannot clip gradients (max_grad_norm 1; "),
    ({"updates": "as_gradients_land", "max_grad_norm": None, "global_batch": 8}, [],
     "updates: as_gradients_land needs one micro-batch per step: give batch"),
    ({"updates": "as_gradients_land", "max_grad_norm": None, "grad_accum": 2}, [],
     "updates='as_gradients_land' needs grad_accum=1"),
    ({"updates": "sooner"}, [], "updates says when each owner's host AdamW update starts"),
    ({}, ["packing=always"], "packing must be false, true or isolated; got 'always'"),
    ({}, ["packing=isolated"], "packing: isolated needs a model that takes position_ids"),
    ({"global_batch": 8, "batch": 2}, [], "give global_batch, or batch and grad_accum, not both"),
    ({"epochs": 1}, [], "give steps (optimizer steps) or epochs"),
    ({}, ["lr=fast"], "lr must be a number >= 0; got 'fast'"),
    ({}, ["betas=[0.9, 1.0]"], "betas must be a number >= 0 and < 1; got 1.0"),
    # finite and sane optimizer settings (docs/training.md, "Optimizer and schedule")
    ({}, ["lr=1e30"], "lr 1e+30 is not a learning rate AdamW can train with: each step moves every weight"),
    ({}, ["lr=.nan"], "lr must be a number >= 0; got nan"),
    ({}, ["lr=inf"], "lr must be a number >= 0; got inf"),
    ({}, ["eps=0"], "eps must be a number > 0 and < 1; got 0"),
    ({}, ["eps=.inf"], "eps must be a number > 0 and < 1; got inf"),
    ({}, ["weight_decay=.nan"], "weight_decay must be a number >= 0; got nan"),
    ({}, ["lr=0.1", "weight_decay=10"], "weight_decay 10 with lr 0.1: AdamW multiplies each weight by 1 - lr * "
                                        "weight_decay = 0 a step"),
    ({}, ["betas=[.nan, 0.999]"], "betas must be a number >= 0 and < 1; got nan"),
    ({}, ["max_consecutive_skips=0"], "max_consecutive_skips must be a whole number >= 1; got 0"),
    ({}, ["stop_signals=[SIGKILL]"], "stop_signals: SIGKILL cannot be caught by any process"),
    ({}, ["stop_signals=[SIGNOPE]"], "stop_signals: SIGNOPE is no signal of this system"),
    ({}, ["stop_signals=15"], "stop_signals is a list of signal names, e.g. [SIGTERM, SIGUSR1]"),
    ({"data": "missing.jsonl"}, [], "missing.jsonl is not a local file or folder"),
    ({"data": "tatsu-lab/alpaca"}, [], "dataset ids of the Hugging Face hub are not read"),
    ({"eval_every": 5}, [], "eval_every needs held-out data"),
    ({"model": "nowhere"}, [], "model: "),
    ({}, ["log=[mlflow]"], "log is a list of csv, tensorboard, wandb, none or all (csv is always written); got 'mlflow'"),
    ({}, ["steps"], "overrides are key=value"),
    ({}, ["export=out"], "export writes a Hugging Face model folder"),
    ({"resume": "auto", "run_dir": None}, [], "resume: auto looks for checkpoints in run_dir"),
    # compile()'s settings, checked by compile()'s own code (megacompile/settings.py)
    ({"nvme_budget": 10}, [], "nvme_budget bounds the disk tier in nvme_dir: give nvme_dir=PATH too"),
    ({"nvme_dir": "/proc/tier"}, [], "nvme_dir /proc/tier is not on a disk"),
    ({}, ["on_nonfinite=ignore"], "on_nonfinite says what a step with an inf or NaN loss or gradient does"),
    ({}, ["fuse=sometimes"], "fuse must be True or False (or None); got 'sometimes'"),
    ({}, ["retrace=maybe"], "retrace must be True or False; got 'maybe'"),
    ({}, ["hbm_budget=1e30"], "hbm_budget of 1e+30 GiB is more than any device holds"),
    ({}, ["grad_accum=0"], "grad_accum (micro-batches per optimizer step) must be an int >= 1; got 0"),
])
def test_bad_settings_are_refused_by_name_before_anything_is_made(tmp_path, settings, overrides, message):
    path = _yaml(tmp_path, **settings)
    with pytest.raises(ArgumentError) as e:
        load(path, overrides)
    assert message in str(e.value)
    assert not os.path.exists(tmp_path / "run")


def test_overrides_win_and_numbers_in_e_notation_are_numbers(tmp_path):
    c = load(_yaml(tmp_path, lr=2e-4), ["lr=2e-5", "steps=500", "bundled_model.dim=96"])
    assert c.lr == 2e-5 and c.steps == 500 and c.bundled_model["dim"] == 96 and c.bundled_model["layers"] == 6
    assert [e["path"] for e in c.data] == [str(tmp_path / "d.jsonl")]        # relative to the run.yaml's folder
    assert c.log == ["csv"]


def test_compile_settings_in_run_yaml_reach_the_engine(tmp_path):
    from megacompile.train import run
    dump = tmp_path / "passes"
    tiny = dict(dim=32, layers=1, heads=2, kv_heads=1, ffn=64)
    c = load(_yaml(tmp_path, model="bundled", data="bundled", bundled_model=tiny, device="cpu", seq=16, steps=1,
                   on_nonfinite="raise", dump_dir="passes", fuse=False, updates="as_gradients_land",
                   max_grad_norm=None))
    assert c.dump_dir == str(dump) and c.settings().on_nonfinite == "raise"
    run(c)
    assert any(dump.iterdir())      # the schedule after each planning pass
    placed = "".join(p.read_text() for p in dump.iterdir() if "optimizer" in p.name)
    assert "as soon as its gradients have landed" in placed


def test_the_embedded_default_is_a_valid_run():
    c = load(None)
    assert c.bundled and [e["path"] for e in c.data] == ["bundled"] and c.steps == 200 and c.packing is True
    assert c.stop_signals == ["SIGTERM", "SIGUSR1"] and c.max_consecutive_skips == 50
    assert load(None, ["stop_signals=usr2,TERM", "max_consecutive_skips=null"]).stop_signals == ["SIGUSR2", "SIGTERM"]


def test_schedules_warm_up_then_decay_towards_min_lr():
    cosine = learning_rate(1.0, "cosine", 4, 0.1, 14)
    assert [cosine(s) for s in (1, 2, 4, 5)] == [0.25, 0.5, 1.0, 1.0]
    assert cosine(10) == pytest.approx(0.55) and cosine(14) == pytest.approx(0.1 + 0.45 * (1 + math.cos(0.9 * math.pi)))
    linear = learning_rate(1.0, "linear", 0, 0.0, 10)
    assert linear(1) == 1.0 and linear(6) == pytest.approx(0.5) and linear(10) == pytest.approx(0.1)
    assert learning_rate(1.0, "constant", 2, 0.0, 10)(7) == 1.0
