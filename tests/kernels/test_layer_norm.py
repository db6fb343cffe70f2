import pytest
import torch

from megacompile.kernels.check import TOLERANCE, compare_autograd
from megacompile.kernels.layer_norm import layer_norm, layer_norm_backward, layer_norm_forward
from megacompile.kernels.reference import layer_norm_ref

SHAPES = [(37, 129), (5, 1000), (2, 19, 65)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_layer_norm_matches_reference(shape, dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen) + 0.5).to(dtype)
    w = (1.0 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
    b = (0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
    fwd, bwd = compare_autograd(layer_norm, layer_norm_ref, (x, w, b), (0, 1, 2))
    assert fwd <= TOLERANCE[dtype] and bwd <= TOLERANCE[dtype], (fwd, bwd)


def test_layer_norm_ignores_padding_columns_in_the_variance():
    # 129 columns sit in a 256-wide block: the padding must not pull the mean or the variance
    x = torch.full((3, 129), 5.0) + torch.linspace(-1, 1, 129)
    w, b = torch.ones(129), torch.zeros(129)
    torch.testing.assert_close(layer_norm(x, w, b), layer_norm_ref(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_frozen_weight_and_bias_get_dx_alone(dtype):
    """w and b take no gradient (LoRA, freeze): the kernel makes dx as a trained norm's, and no dw or db."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(37, 129, generator=gen) + 0.5).to(dtype)
    w = (1.0 + 0.1 * torch.randn(129, generator=gen)).to(dtype)
    b = (0.1 * torch.randn(129, generator=gen)).to(dtype)
    fwd, bwd = compare_autograd(layer_norm, layer_norm_ref, (x, w, b), (0,))
    assert fwd <= TOLERANCE[dtype] and bwd <= TOLERANCE[dtype], (fwd, bwd)
    dy = torch.randn(37, 129, generator=gen).to(dtype)
    _, mean, rstd = layer_norm_forward(x, w, b, 1e-5)
    frozen = layer_norm_backward(dy, x, w, mean, rstd, weight_grad=False)
    trained = layer_norm_backward(dy, x, w, mean, rstd)
    assert frozen[1:] == (None, None) and torch.equal(frozen[0], trained[0])
