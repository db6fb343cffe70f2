"""`accumulation: layer` in a run file trains as `accumulation: micro` does: the same losses, lr,
tokens and gradient norms per logged step, and the same exported weights (float32, 1e-5), with
isolated packing, so each micro-batch carries its own block-diagonal mask through the blocks."""
from __future__ import annotations

import json
import os

import pytest
import torch

from megacompile.train import load, log, run
from tests.train import files


def _run(tmp, work: dict, accumulation: str) -> tuple[list[dict], dict]:
    import safetensors.torch
    name = str(tmp / accumulation)
    config = files.run_yaml(name + ".yaml", model=work["model"], data=[work["chats"], work["notes"]], seq=24,
                            packing="isolated", batch=2, grad_accum=2, accumulation=accumulation, steps=3,
                            lr=3e-3, max_grad_norm=1.0, device="cpu", run_dir=name, export=name + "-export",
                            log_every=1)
    result = run(load(config, []))
    assert result["steps"] == 3
    with open(os.path.join(name, "plan", "plan.json")) as f:
        assert json.load(f)["accumulation"] == {"micro": "micro-batch-major", "layer": "layer-major"}[accumulation]
    weights = safetensors.torch.load_file(os.path.join(name + "-export", "model.safetensors"))
    return log.read(os.path.join(name, "log.csv")), weights


@pytest.mark.slow   # two runs: ~20 s on 2 cores
def test_a_layer_major_run_logs_and_exports_what_a_micro_batch_major_run_does(tmp_path):
    work = files.workspace(tmp_path)
    micro, micro_weights = _run(tmp_path, work, "micro")
    layer, layer_weights = _run(tmp_path, work, "layer")
    for a, b in zip(micro, layer, strict=True):
        assert (a["step"], a["lr"], a["tokens"]) == (b["step"], b["lr"], b["tokens"])
        for key in ("loss", "grad_norm"):
            assert abs(float(a[key]) - float(b[key])) <= 1e-5 * abs(float(a[key])), (key, a, b)
        assert int(b["device_peak_bytes"]) > 0 and b["predicted_device_peak_bytes"]
    # A weight whose gradient is rounding noise moves by up to lr per step in a direction the
    # summation order picks (docs/decisions.md): the losses and norms above hold the step to 1e-5;
    # here all but a few weights in a thousand agree to 1e-5, and none by more than 2 lr a step.
    for name, w in micro_weights.items():
        off = ~torch.isclose(layer_weights[name], w, rtol=1e-5, atol=1e-6)
        assert off.float().mean() <= 1e-3, (name, int(off.sum()))
        assert (layer_weights[name] - w).abs().max() <= 2 * 3e-3 * 3, name
    import safetensors.torch
    before = safetensors.torch.load_file(os.path.join(work["model"], "model.safetensors"))
    assert not all(torch.equal(w, micro_weights[k]) for k, w in before.items())     # it trained
