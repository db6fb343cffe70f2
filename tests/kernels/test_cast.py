import torch

from megacompile.kernels.cast import accumulate_, cast


def _bits(t):
    return t.view(torch.int16)


def test_cast_rounds_to_nearest_even_like_torch():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 129, generator=gen) * torch.exp2(torch.randint(-140, 125, (37, 129), generator=gen))
    assert torch.equal(_bits(cast(x)), _bits(x.to(torch.bfloat16)))


def test_cast_ties_specials_and_overflow():
    one = 1.0
    x = torch.tensor([
        one + 2**-8,  # halfway, even below: rounds down
        one + 3 * 2**-8,  # halfway, odd below: rounds up
        one + 2**-8 + 2**-20,  # just above halfway
        float("inf"), -float("inf"), 3.4028235e38,  # the largest float rounds to inf, as torch does
        -0.0, 1e-45, -1e-40,  # signed zero and subnormals
    ])
    assert torch.equal(_bits(cast(x)), _bits(x.to(torch.bfloat16)))
    assert torch.isnan(cast(torch.tensor([float("nan")]))).all()


def test_accumulate_adds_bf16_gradients_exactly():
    gen = torch.Generator().manual_seed(1)
    acc = torch.randn(37, 129, generator=gen)
    expected = acc.clone()
    for _ in range(3):
        g = torch.randn(37, 129, generator=gen).to(torch.bfloat16)
        expected += g.float()
        accumulate_(acc, g)
    assert torch.equal(acc, expected)
