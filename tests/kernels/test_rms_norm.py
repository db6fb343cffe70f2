import pytest
import torch

from megacompile.kernels.check import TOLERANCE, compare_autograd
from megacompile.kernels.reference import rms_norm_ref
from megacompile.kernels.rms_norm import rms_norm, rms_norm_backward, rms_norm_forward

SHAPES = [(37, 129), (5, 1000), (2, 19, 65), (1, 7)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_matches_reference(shape, dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).to(dtype)
    w = (1.0 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
    fwd, bwd = compare_autograd(
        lambda x, w: rms_norm(x, w, 1e-6), lambda x, w: rms_norm_ref(x, w, 1e-6), (x, w), (0, 1)
    )
    assert fwd <= TOLERANCE[dtype] and bwd <= TOLERANCE[dtype], (fwd, bwd)


def test_rms_norm_reads_strided_rows():
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(37, 2 * 129, generator=gen)
    x = base[:, :129]  # rows 258 elements apart
    w = torch.randn(129, generator=gen)
    torch.testing.assert_close(rms_norm(x, w), rms_norm_ref(x, w), rtol=1e-5, atol=1e-6)


def test_rms_norm_backward_from_a_broadcast_upstream_gradient():
    # .sum() sends back an expanded (stride-0) gradient
    x = torch.randn(37, 129, generator=torch.Generator().manual_seed(2), requires_grad=True)
    w = torch.ones(129, requires_grad=True)
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    rms_norm(x, w).sum().backward()
    rms_norm_ref(xr, wr).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, wr.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_frozen_weight_gets_dx_alone(dtype):
    """w takes no gradient (LoRA): the kernel makes dx as a trained norm's, and no dw."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, 129, generator=gen).to(dtype)
    w = (1.0 + 0.1 * torch.randn(129, generator=gen)).to(dtype)
    fwd, bwd = compare_autograd(
        lambda x, w: rms_norm(x, w, 1e-6), lambda x, w: rms_norm_ref(x, w, 1e-6), (x, w), (0,)
    )
    assert fwd <= TOLERANCE[dtype] and bwd <= TOLERANCE[dtype], (fwd, bwd)
    dy = torch.randn(37, 129, generator=gen).to(dtype)
    frozen = rms_norm_backward(dy, x, w, rms_norm_forward(x, w, 1e-6)[1], weight_grad=False)
    trained = rms_norm_backward(dy, x, w, rms_norm_forward(x, w, 1e-6)[1])
    assert frozen[1] is None and torch.equal(frozen[0], trained[0])
