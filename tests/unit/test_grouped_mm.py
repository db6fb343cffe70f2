"""The grouped matmul of MoE layers (megacompile/moe): results and gradients against a per-row
dense reference, over odd groupings (experts with no row, one row, every row), static shapes
under fake tensors, and the static-shape experts forward against transformers' own."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from megacompile.capture.experts import static_experts
from megacompile.moe import grouped_mm

# Rows per expert, 4 experts: empty experts first, last, in between; one row; all rows in one.
GROUPS = [(0, 5, 1, 7), (0, 0, 0, 13), (1, 1, 1, 1)]


def _case(counts, k=24, n=40, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = sum(counts)
    x = torch.randn(rows, k, generator=g, dtype=dtype)
    w = torch.randn(len(counts), k, n, generator=g, dtype=dtype)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    expert_of_row = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    return x, w, offs, expert_of_row


def _dense(x, w, expert_of_row):
    # [S, 1, K] @ [S, K, N]: each row meets its own expert's weight, no grouping at all.
    return torch.bmm(x.unsqueeze(1), w[expert_of_row]).squeeze(1)


@pytest.mark.parametrize("counts", GROUPS)
def test_forward_and_gradients_match_the_per_row_reference(counts):
    x, w, offs, expert_of_row = _case(counts)
    dy = torch.randn(x.size(0), w.size(2), generator=torch.Generator().manual_seed(1))
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = grouped_mm(xa, wa, offs)
    y_ref = _dense(xb, wb, expert_of_row)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    y.backward(dy)
    y_ref.backward(dy)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(wa.grad, wb.grad, rtol=1e-5, atol=1e-5)
    for e, c in enumerate(counts):
        if c == 0:
            assert wa.grad[e].abs().max() == 0, f"expert {e} got no row but a gradient"


def test_transposed_weights_view():
    """The experts pass `w.transpose(-2, -1)` of [E, N, K] weights; the backward passes it back."""
    x, w, offs, expert_of_row = _case((2, 0, 5, 3))
    wt = w.transpose(-2, -1).contiguous().requires_grad_()        # [E, N, K]
    y = grouped_mm(x, wt.transpose(-2, -1), offs)
    torch.testing.assert_close(y, _dense(x, w, expert_of_row), rtol=1e-5, atol=1e-5)
    y.sum().backward()
    ref = w.clone().requires_grad_()
    _dense(x, ref, expert_of_row).sum().backward()
    torch.testing.assert_close(wt.grad, ref.grad.transpose(-2, -1), rtol=1e-5, atol=1e-5)


def test_shapes_are_static_under_fake_tensors():
    with FakeTensorMode():
        x = torch.empty(37, 16)
        w = torch.empty(4, 16, 8)
        offs = torch.empty(4, dtype=torch.int32)
        y = grouped_mm(x, w, offs)
        dw = torch.ops.megacompile.grouped_mm_weight_grad(x, torch.empty(37, 8), offs)
    assert tuple(y.shape) == (37, 8) and tuple(dw.shape) == (4, 16, 8)


@pytest.mark.parametrize("implementation", ["eager", "batched_mm"])
def test_static_experts_forward_matches_transformers(implementation):
    """Mixtral's experts (fused [E, 2I, H] weights) and GPT-OSS's (transposed, biased, interleaved
    gate/up with a clamped gate): output and every gradient as transformers computes them."""
    import transformers
    from tests.families import FAMILIES
    for name in ("mixtral", "gpt_oss"):
        torch.manual_seed(0)
        model = FAMILIES[name]()
        layer = model.model.layers[0].mlp
        experts = layer.experts
        model.config._experts_implementation = implementation
        torch.manual_seed(1)
        h = torch.randn(23, model.config.hidden_size)
        index = torch.stack([torch.randperm(experts.num_experts)[:2] for _ in range(23)])   # [T, 2], expert 3 maybe idle
        weights = torch.rand(23, 2).requires_grad_()

        def run():
            experts.zero_grad(set_to_none=True)
            hh, ww = h.clone().requires_grad_(), weights.detach().clone().requires_grad_()
            y = experts(hh, index, ww)
            y.pow(2).sum().backward()
            return [y, hh.grad, ww.grad] + [p.grad for p in experts.parameters()]
        theirs = run()
        with static_experts(model):
            ours = run()
        assert isinstance(model, transformers.PreTrainedModel)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
