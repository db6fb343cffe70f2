"""The summary's predicted time is per optimizer step, the step log.csv counts, with the time of
one micro-batch beside it when a step takes several."""
from __future__ import annotations

import re

from megacompile.train import load, run

TINY = ["bundled_model.dim=32", "bundled_model.layers=1", "bundled_model.heads=2", "bundled_model.kv_heads=1",
        "bundled_model.ffn=64", "device=cpu", "batch=1", "seq=16", "steps=1", "accumulation=micro"]


UNIT = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def test_the_predicted_time_is_that_of_an_optimizer_step(tmp_path, capsys):
    run(load(None, [*TINY, "grad_accum=3", f"run_dir={tmp_path / 'run'}"]))
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("predicted"))
    found = re.search(r"predicted +([\d.,]+) (s|ms|us) per optimizer step \(3 micro-batches of ([\d.,]+) (s|ms|us)\)",
                      line)
    assert found, line
    step, micro = (float(found[i].replace(",", "")) * UNIT[found[i + 1]] for i in (1, 3))
    assert abs(step - 3 * micro) <= 0.02 * step
