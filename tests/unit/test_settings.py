"""One settings object: compile(), the Engine, plan(), minimum_budget and run.yaml take their
defaults from megacompile.Settings, and plan() predicts the accumulation compile() runs."""
from __future__ import annotations

import dataclasses
import inspect

import megacompile
from megacompile import Settings
from megacompile.engine import Engine
from megacompile.train.config import RunConfig

# plan() plans the GPU run in bfloat16 (docs/decisions.md, "One settings object").
PLAN_OWN = {"compute_dtype"}


def _defaults(function) -> dict:
    return {n: p.default for n, p in inspect.signature(function).parameters.items()
            if p.default is not inspect.Parameter.empty}


def test_every_entry_point_defaults_to_the_settings_defaults():
    fields = {f.name: f.default for f in dataclasses.fields(Settings)}
    for function, own in ((megacompile.compile, set()), (Engine.__init__, set()), (megacompile.planner.plan, PLAN_OWN),
                          (megacompile.minimum_budget, PLAN_OWN)):
        given = _defaults(function)
        shared = {n for n in fields if n in given} - own
        assert shared and all(given[n] == fields[n] for n in shared), (function, given)
    run_yaml = {f.name: f.default for f in dataclasses.fields(RunConfig)}
    assert all(run_yaml[n] == fields[n] for n in ("accumulation", "fuse", "on_nonfinite", "retrace", "grad_accum",
                                                  "nvme_dir", "nvme_budget", "dump_dir", "host_budget"))
    assert Settings.accumulation == "micro"


def test_the_front_doors_take_a_settings():
    """compile(), plan() and minimum_budget() take a Settings instead of the keywords, and mean the
    same by it; a keyword given beside it must agree with it."""
    import pytest
    import torch

    from megacompile.errors import ArgumentError
    from tests import models
    settings = Settings(hbm_budget=1.0, device="cpu", grad_accum=2, compute_dtype=torch.bfloat16)
    engine = megacompile.compile(models.NanoGPT(vocab=32, d=16, layers=1), settings=settings)
    assert (engine.budget_bytes, engine.grad_accum, engine.compute_dtype) == (2 ** 30, 2, torch.bfloat16)
    engine.close()
    same = megacompile.compile(models.NanoGPT(vocab=32, d=16, layers=1), 1.0, settings=settings, grad_accum=2)
    same.close()
    with pytest.raises(ArgumentError, match="grad_accum is given twice: 4 as a keyword and 2 in settings"):
        megacompile.compile(models.NanoGPT(vocab=32, d=16, layers=1), settings=settings, grad_accum=4)
    with pytest.raises(ArgumentError, match="settings must be a megacompile.Settings"):
        megacompile.compile(models.NanoGPT(vocab=32, d=16, layers=1), settings={"hbm_budget": 1.0})
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}
    given = dict(hardware="h100", batch=1, seq=64, host_budget=64.0)
    planned = Settings(hbm_budget=0.5, compute_dtype=torch.bfloat16, grad_accum=2, host_budget=64.0)
    by_keywords = megacompile.plan(config, 0.5, grad_accum=2, **given)
    by_settings = megacompile.plan(config, settings=planned, **given)
    assert by_settings.to_json()["device_peak_bytes"] == by_keywords.to_json()["device_peak_bytes"]
    assert by_settings.grad_accum == 2
    assert (megacompile.minimum_budget(config, settings=planned, hardware="h100", batch=1, seq=64)
            == megacompile.minimum_budget(config, grad_accum=2, host_budget=64.0, hardware="h100", batch=1, seq=64))


def test_the_global_batch_door_takes_a_settings():
    """plan_global_batch (`megacompile plan --global-batch`) takes a Settings too, chooses the same
    split as from keywords, and refuses a setting given twice."""
    import pytest
    import torch

    from megacompile.errors import ArgumentError
    from megacompile.planner.from_config import plan_global_batch
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}
    settings = Settings(hbm_budget=0.5, compute_dtype=torch.bfloat16, host_budget=64.0)
    by_settings, k = plan_global_batch(config, global_batch=4, settings=settings, hardware="h100", seq=64)
    by_keywords, k_keywords = plan_global_batch(config, 0.5, 4, compute_dtype=torch.bfloat16, host_budget=64.0,
                                                hardware="h100", seq=64)
    timings = ("pass_seconds", "trace_seconds", "solve_seconds")
    same = [{key: v for key, v in p.to_json().items() if key not in timings} for p in (by_settings, by_keywords)]
    assert k == k_keywords and same[0] == same[1]
    with pytest.raises(ArgumentError, match="host_budget given twice"):
        plan_global_batch(config, global_batch=4, settings=settings, host_budget=32.0, hardware="h100", seq=64)
    with pytest.raises(ArgumentError, match="hbm_budget is given twice"):
        plan_global_batch(config, 0.25, 4, settings=settings, hardware="h100", seq=64)
