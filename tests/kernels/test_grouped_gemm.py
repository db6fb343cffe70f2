"""The Triton grouped GEMM (kernels/grouped_gemm.py) against a one-row-at-a-time reference, forward
and both gradients, over groupings with empty experts, one-row experts and one expert taking all."""
import pytest
import torch

from megacompile.kernels.check import TOLERANCE, compare_autograd
from megacompile.kernels.grouped_gemm import grouped_matmul
from megacompile.kernels.reference import grouped_mm_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [(0, 5, 1, 7), (13, 0, 0, 0), (1, 1, 1, 1)])
def test_grouped_gemm_matches_reference(counts, dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), 24, generator=gen).to(dtype)
    w = (torch.randn(len(counts), 24, 40, generator=gen) / 5).to(dtype)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    fwd, bwd = compare_autograd(grouped_matmul, grouped_mm_ref, (x, w, offs), (0, 1))
    assert fwd <= TOLERANCE[dtype] and bwd <= TOLERANCE[dtype], (fwd, bwd)


def test_idle_expert_gets_a_zero_gradient():
    x = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(3, 8, 5, requires_grad=True)
    grouped_matmul(x, w, torch.tensor([2, 2, 6], dtype=torch.int32)).sum().backward()
    assert w.grad[1].abs().max() == 0 and w.grad[0].abs().max() > 0
