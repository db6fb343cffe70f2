import math

import pytest
import torch

from megacompile.kernels.check import compare_autograd
from megacompile.kernels.reference import softmax_ref
from megacompile.kernels.softmax import softmax

TOLERANCE = {torch.float32: 5e-5, torch.bfloat16: 1e-2}  # fp32: dx = y * (dy - <dy, y>) cancels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape, causal", [((37, 129), False), ((2, 2, 37, 37), True), ((3, 19, 45), True), ((1, 5, 1000), False)]
)
def test_softmax_matches_reference(shape, causal, dtype):
    x = (4.0 * torch.randn(shape, generator=torch.Generator().manual_seed(0))).to(dtype)
    scale = 1.0 / math.sqrt(64)
    fwd, bwd = compare_autograd(
        lambda x: softmax(x, scale, causal), lambda x: softmax_ref(x, scale, causal), (x,), (0,)
    )
    assert fwd <= TOLERANCE[dtype] and bwd <= TOLERANCE[dtype], (fwd, bwd)


def test_causal_mask_keeps_k_at_most_q_and_zeroes_the_rest():
    x = torch.randn(2, 7, 9, requires_grad=True)  # Q < K: the mask is top-left aligned
    y = softmax(x, causal=True)
    masked = torch.ones(7, 9, dtype=torch.bool).triu(1)
    assert (y[:, masked] == 0).all() and (y[:, ~masked] > 0).all()
    torch.testing.assert_close(y.sum(-1), torch.ones(2, 7))
    y.backward(torch.randn(2, 7, 9))
    assert (x.grad[:, masked] == 0).all()


def test_bf16_backward_keeps_the_gradient_of_a_dominant_entry():
    # one entry holds nearly all the mass: recomputing y in fp32 keeps dx there, a bf16-saved y would not
    x = torch.zeros(4, 33)
    x[:, 3] = 12.0
    x = x.to(torch.bfloat16)
    fwd, bwd = compare_autograd(softmax, softmax_ref, (x,), (0,))
    assert bwd <= 1e-2, bwd
