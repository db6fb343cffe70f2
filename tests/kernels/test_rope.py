import pytest
import torch

from megacompile.kernels.check import TOLERANCE, compare_autograd, rope_inputs
from megacompile.kernels.reference import rope_ref
from megacompile.kernels.rope import rope

# (batch, q heads, kv heads, seq, head_dim): head_dim/2 of 12 and 48 is not a power of two
SHAPES = [(2, 3, 2, 19, 24), (1, 4, 4, 37, 96), (3, 2, 1, 5, 8)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batched_table", [True, False], ids=["cos[B,S,D]", "cos[S,D]"])
@pytest.mark.parametrize("shape", SHAPES)
def test_rope_matches_reference(shape, batched_table, dtype):
    inputs = rope_inputs(dtype, {"rope": shape}, torch.Generator().manual_seed(0), batched_table)
    fwd, bwd = compare_autograd(rope, rope_ref, inputs, (0, 1))
    assert fwd <= TOLERANCE[dtype] and bwd <= TOLERANCE[dtype], (fwd, bwd)


def test_rope_takes_hf_4d_tables_and_contiguous_heads():
    q, k, cos, sin = rope_inputs(torch.float32, {"rope": SHAPES[0]}, torch.Generator().manual_seed(1))
    q, k = q.contiguous(), k.contiguous()
    got = rope(q, k, cos[:, None], sin[:, None])  # [B, 1, S, D] as HF unsqueezes them
    for g, r in zip(got, rope_ref(q, k, cos, sin)):
        torch.testing.assert_close(g, r)


def test_rope_handles_tables_whose_halves_differ():
    q, k, cos, sin = rope_inputs(torch.float32, {"rope": SHAPES[0]}, torch.Generator().manual_seed(2))
    cos, sin = cos * torch.linspace(0.5, 1.5, cos.shape[-1]), sin * torch.linspace(1.5, 0.5, sin.shape[-1])
    fwd, bwd = compare_autograd(rope, rope_ref, (q, k, cos, sin), (0, 1))
    assert fwd <= 1e-6 and bwd <= 1e-6, (fwd, bwd)
