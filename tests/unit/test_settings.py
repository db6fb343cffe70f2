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
