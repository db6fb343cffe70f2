import pytest
import torch

from megacompile.kernels.check import TOLERANCE, compare_autograd
from megacompile.kernels.reference import swiglu_ref
from megacompile.kernels.swiglu import swiglu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 129), (3, 11, 301), (1,)])
def test_swiglu_matches_reference(shape, dtype):
    gen = torch.Generator().manual_seed(0)
    a = (3.0 * torch.randn(shape, generator=gen)).to(dtype)
    b = torch.randn(shape, generator=gen).to(dtype)
    fwd, bwd = compare_autograd(swiglu, swiglu_ref, (a, b), (0, 1))
    assert fwd <= TOLERANCE[dtype] and bwd <= TOLERANCE[dtype], (fwd, bwd)


def test_swiglu_saturates_without_nan():
    a = torch.tensor([-200.0, -90.0, 0.0, 90.0, 200.0], requires_grad=True)
    b = torch.ones(5, requires_grad=True)
    swiglu(a, b).sum().backward()
    assert torch.isfinite(a.grad).all() and torch.isfinite(b.grad).all()
