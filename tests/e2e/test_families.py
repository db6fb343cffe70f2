"""Parity across Hugging Face decoder families: 3 steps through megacompile equal 3 eager steps
of torch.optim.AdamW, at twice the weights' bytes and at the smallest budget the compiler reports,
every device tensor of a step served from the arena the plan laid out.

The default tier keeps the families that take their own path through capture and the runtime;
the slow tier sweeps all of them, those whose blocks differ from layer to layer (and so run
several templates) included; families megacompile refuses are checked to raise a clear error
(docs/families.md lists both).
"""
from __future__ import annotations

import pytest
import torch

import megacompile
from megacompile.errors import CaptureError
from megacompile.acceptance.parity import moment_error
from tests.e2e.harness import (assert_same_weights, clone, eager_losses, make_inputs, megacompile_run, weight_bytes,
                               weight_noise)
from tests.families import FAMILIES, batch

GiB = 2 ** 30
STEPS = 3

# One family per path of its own: a block with no random op recomputed (Gemma 2's eager
# attention; Falcon), a block output nothing reads (GPT-J's attention weights, parallel
# residual, partial rotary), a multi-output op in the prologue (BLOOM's embedding layer norm,
# ALiBi bias). Llama, Qwen2 and GPT-2 are in test_parity.py.
# Mixtral: routed experts, an in-place divide in the router, router logits to the load-balancing
# loss (the other MoE families run in the slow tier). Qwen2 with sliding windows: full-attention
# layers beside ones captured onto megacompile::window_attention (capture/hf_windows.py). GPT-OSS:
# eager attention with sinks onto the same operator, sum for sum with its eager attention. DeepSeek-V3:
# latent attention (v narrower than q and k) onto it too, sum for sum with SDPA's math path.
# Qwen3.5: a hybrid, gated delta-net linear attention (a causal conv and a chunked recurrence in
# torch) beside gated full attention, two templates.
DEFAULT = {"gemma2", "mixtral", "gpt_oss", "deepseek_v3", "qwen3_5"}

# Families that cannot be captured yet, with the error they raise.
REFUSED = {
    "jamba": "linear-attention layer",
    "llama4": "not transformers' fused 3D expert weights",
}


def _param(name: str):
    marks = []
    if name not in DEFAULT:
        marks.append(pytest.mark.slow)
    return pytest.param(name, marks=marks)


SUPPORTED = [f for f in FAMILIES if f not in REFUSED]


@pytest.fixture(scope="module")
def eager():
    cache = {}

    def get(name):
        if name not in cache:
            torch.manual_seed(0)
            model = FAMILIES[name]()
            batches = [batch(seed=i) for i in range(STEPS)]
            reference, moments = clone(model), {}
            cache[name] = (model, batches, reference, eager_losses(reference, batches, "hf", first_moments=moments),
                           moments)
        return cache[name]
    return get


@pytest.mark.parametrize("name", [_param(f) for f in SUPPORTED])
def test_family_parity_at_two_budgets(name, eager):
    """Twice the weights' bytes, then the smallest budget that plan reports."""
    model, batches, reference, losses, eager_moments = eager(name)
    noise = weight_noise(model, batches, "hf", reference)
    budget_bytes = 2 * weight_bytes(model)
    for _ in range(2):
        moments = {}
        run = megacompile_run(clone(model), batches, "hf", budget_bytes / GiB, first_moments=moments)
        torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(losses), rtol=1e-5, atol=0)
        assert moment_error(moments, eager_moments) <= 1e-5
        assert_same_weights(run.engine, reference, noise=noise)
        assert max(run.peaks) <= int(budget_bytes / GiB * GiB)
        # every device tensor of the last step came from the planned arena (tests/e2e/test_device_arena.py)
        stats = run.engine.memory_stats()
        assert stats["device_allocations_last_step"] == 0, stats["device_allocations_outside"]
        assert stats["device_peak_bytes"] <= stats["device_arena_bytes"] <= int(budget_bytes / GiB * GiB)
        budget_bytes = run.engine.plan.minimum_budget_bytes


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_family_raises_a_clear_error(name):
    torch.manual_seed(0)
    model = FAMILIES[name]()
    engine = megacompile.compile(model, hbm_budget=64.0, device="cpu")
    with pytest.raises(CaptureError, match=REFUSED[name]):
        engine.prepare(**make_inputs("hf", batch()))
