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

from megacompile.acceptance.parity import moment_error
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
    flags = ("has_post_expert_norm", "_is_expert_parallel")
    for module in earlier.modules():
        for flag in flags:
            if flag in vars(module):
                delattr(module, flag)
    assert not any(hasattr(m, f) for m in earlier.modules() for f in flags)
    run = megacompile_run(earlier, batches, "hf", 2 * weight_bytes(model) / GiB)
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(losses), rtol=1e-5, atol=0)


def _balance_by_bincount(gate_logits, num_experts=None, top_k=2, attention_mask=None):
    """A load-balancing loss that counts each expert's tokens with torch.bincount, as transformers
    5.17's does: under fake tensors its length depends on the values."""
    counts, probs, rows = 0.0, 0.0, 0
    for logits in gate_logits:
        p = torch.softmax(logits, dim=-1)
        _, chosen = torch.topk(p, top_k, dim=-1)
        counts = counts + torch.bincount(chosen.reshape(-1), minlength=num_experts).float()
        probs = probs + p.sum(dim=0)
        rows += p.shape[0]
    return num_experts * (counts / (rows * top_k) * probs / rows).sum()


def test_a_load_balancing_loss_that_counts_with_bincount_trains_as_eagerly(monkeypatch):
    from transformers.models.mixtral import modeling_mixtral
    monkeypatch.setattr(modeling_mixtral, "load_balancing_loss_func", _balance_by_bincount)
    torch.manual_seed(0)
    model = FAMILIES["mixtral"]()
    batches = [batch(seed=i) for i in range(2)]
    moments, eager_moments = {}, {}
    losses = eager_losses(clone(model), batches, "hf", first_moments=eager_moments)
    run = megacompile_run(clone(model), batches, "hf", 2 * weight_bytes(model) / GiB, first_moments=moments)
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(losses), rtol=1e-5, atol=0)
    assert moment_error(moments, eager_moments) <= 1e-5
    # The traced count has its minlength's length; an id past it fails instead of lengthening it.
    from megacompile.capture.experts import static_bincount
    with static_bincount():
        assert torch.bincount(torch.tensor([0, 2, 2]), minlength=4).tolist() == [1, 0, 2, 0]
        with pytest.raises(RuntimeError):
            torch.bincount(torch.tensor([0, 5]), minlength=4)
    assert torch.bincount(torch.tensor([0, 5]), minlength=4).tolist() == [1, 0, 0, 0, 0, 1]
