"""A Hugging Face model after gradient_checkpointing_enable() trains as eagerly: megacompile plans
recompute itself, so the layers are captured as they run without checkpointing (which changes no
value, dropout included), and the model keeps its setting for the user's own eager runs."""
from __future__ import annotations

import warnings

import pytest
import torch

from tests import models
from tests.e2e.harness import clone, eager_losses, megacompile_run, weight_errors

BUILDERS = {
    "llama": lambda: models.hf_llama(layers=2, d=32),
    "gpt2 with dropout": lambda: models.hf_gpt2(layers=2, d=32, dropout=0.1),
}


def _checkpointing(model) -> list[bool]:
    return [layer.gradient_checkpointing for layer in model.modules() if hasattr(layer, "gradient_checkpointing")]


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_a_model_with_gradient_checkpointing_enabled_trains_as_eagerly(kind):
    torch.manual_seed(0)
    model = BUILDERS[kind]()
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)     # transformers 5 names it activation_checkpointing_enable
        model.gradient_checkpointing_enable()
    flags = _checkpointing(model)
    assert any(flags)
    batches = [models.batch(96, b=2, t=16, seed=i) for i in range(3)]
    reference = clone(model)
    torch.manual_seed(1)                                    # the dropout masks: one stream for both runs
    losses = eager_losses(reference, batches, "hf")
    torch.manual_seed(1)
    run = megacompile_run(model, batches, "hf", 1.0)
    assert run.losses == losses
    assert max(weight_errors(run.engine, reference).values()) == 0.0
    assert _checkpointing(model) == flags
