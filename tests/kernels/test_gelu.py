import pytest
import torch

from megacompile.kernels.check import TOLERANCE, compare_autograd
from megacompile.kernels.gelu import geglu, gelu
from megacompile.kernels.reference import gelu_ref

SHAPES = [(37, 129), (2, 5, 301)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("shape", SHAPES)
def test_gelu_matches_reference(shape, approximate, dtype):
    a = (3.0 * torch.randn(shape, generator=torch.Generator().manual_seed(0))).to(dtype)
    fwd, bwd = compare_autograd(lambda a: gelu(a, approximate), lambda a: gelu_ref(a, None, approximate), (a,), (0,))
    assert fwd <= TOLERANCE[dtype] and bwd <= TOLERANCE[dtype], (fwd, bwd)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("shape", SHAPES)
def test_geglu_matches_reference(shape, approximate, dtype):
    gen = torch.Generator().manual_seed(0)
    a = (3.0 * torch.randn(shape, generator=gen)).to(dtype)
    b = torch.randn(shape, generator=gen).to(dtype)
    fwd, bwd = compare_autograd(
        lambda a, b: geglu(a, b, approximate), lambda a, b: gelu_ref(a, b, approximate), (a, b), (0, 1)
    )
    assert fwd <= TOLERANCE[dtype] and bwd <= TOLERANCE[dtype], (fwd, bwd)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_tails_and_origin_against_float64(approximate):
    # the far tails (1 + erf cancels there, in torch's fp32 as well) and the origin
    a = torch.tensor([-30.0, -9.0, -5.0, -1e-3, 0.0, 1e-6, 1e-3, 5.0, 9.0, 30.0])
    exact = gelu_ref(a.double(), None, approximate).float()
    torch.testing.assert_close(gelu(a, approximate), exact, rtol=1e-6, atol=3e-7)
    torch.testing.assert_close(gelu(a[3:7], approximate), exact[3:7], rtol=1e-6, atol=1e-12)


def test_gelu_rejects_unknown_approximation():
    with pytest.raises(AssertionError):
        gelu(torch.randn(4), "sigmoid")
