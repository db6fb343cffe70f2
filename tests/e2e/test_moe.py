"""Mixture-of-experts training whichever experts implementation transformers selected.

Against the default (`grouped_mm`) test_families.py holds the weights to 1e-5 (they agree bit for
bit). transformers' `eager` loop and `batched_mm` sum in other orders: after three AdamW steps
their own weights differ from `grouped_mm`'s by up to a few 1e-5 of a tensor's largest entry, where
a gradient component is small against its moments. Training through megacompile must stay within
that spread: a wrong gradient (a dropped aux-loss term, a mis-routed token) moves weights by orders
of magnitude more.
"""
from __future__ import annotations

import pytest
import torch

from tests.e2e.harness import clone, eager_losses, megacompile_run, weight_bytes, weight_errors
from tests.families import FAMILIES, batch

GiB = 2 ** 30


def _eager(model, implementation, batches):
    reference = clone(model)
    reference.config._experts_implementation = implementation
    return reference, eager_losses(reference, batches, "hf")


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["eager", "batched_mm"])
def test_other_experts_implementations_within_their_own_spread(implementation):
    torch.manual_seed(0)
    model = FAMILIES["mixtral"]()
    batches = [batch(seed=i) for i in range(3)]
    reference, losses = _eager(model, implementation, batches)
    default, _ = _eager(model, "grouped_mm", batches)
    spread = max(weight_errors_between(default, reference).values())
    selected = clone(model)
    selected.config._experts_implementation = implementation
    run = megacompile_run(selected, batches, "hf", 2 * weight_bytes(model) / GiB)
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(losses), rtol=1e-5, atol=0)
    ours = max(weight_errors(run.engine, reference).values())
    assert ours <= max(2 * spread, 1e-5), f"{ours:.3g} against transformers' own spread {spread:.3g}"


def weight_errors_between(a: torch.nn.Module, b: torch.nn.Module) -> dict[str, float]:
    theirs = b.state_dict()
    out = {}
    for name, t in a.state_dict().items():
        ref = theirs[name].float()
        out[name] = (t.float() - ref).abs().max().item() / (ref.abs().max().item() or 1.0)
    return out


def test_experts_decorated_by_an_earlier_transformers_5_release_train_as_eagerly():
    """transformers 5.17 (a GPU image's) sets has_gate, has_bias and is_transposed on an experts
    module but neither has_post_expert_norm nor _is_expert_parallel, which later releases add: such
    a module is still transformers' fused experts, captured and trained, not refused. (The eager
    reference keeps the flags: this release's own forward reads them.)"""
    torch.manual_seed(0)
    model = FAMILIES["mixtral"]()
    batches = [batch(seed=i) for i in range(2)]
    losses = eager_losses(clone(model), batches, "hf")
    earlier = clone(model)
    stripped = 0
    for module in earlier.modules():
        for flag in ("has_post_expert_norm", "_is_expert_parallel"):
            if flag in vars(module):
                delattr(module, flag)
                stripped += 1
    assert stripped == 2 * 4      # both flags of each layer's experts
    run = megacompile_run(earlier, batches, "hf", 2 * weight_bytes(model) / GiB)
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(losses), rtol=1e-5, atol=0)
