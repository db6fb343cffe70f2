"""The fused cross-entropy's launchers allocate nothing their meta does not declare, and scale the
saved gradients by the loss tangent in fp32 with one rounding (grad_accum=k gives a tangent of 1/k)."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megacompile.fusion.cross_entropy import (_backward_meta, _forward_meta, linear_cross_entropy_backward,
                                                     linear_cross_entropy_forward)

N, H, V = 48, 16, 200


class NewStorages(TorchDispatchMode):
    """Every storage an op makes (outputs whose memory no earlier tensor had)."""

    def __init__(self, known):
        super().__init__()
        self.seen = {t.untyped_storage().data_ptr() for t in known}
        self.made: list[tuple[str, int, int]] = []    # (op, data_ptr, bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.seen:
                self.seen.add(t.untyped_storage().data_ptr())
                self.made.append((str(func), t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
        return out


def _undeclared(fn, meta, args) -> list:
    """Storages of more than a per-token float that fn made and did not return, and its outputs'
    (shape, dtype) against the meta's."""
    with NewStorages([a for a in args if isinstance(a, torch.Tensor)]) as mode:
        outs = fn(*args)
    returned = {t.untyped_storage().data_ptr() for t in outs}
    expected = meta(*args)
    assert [(tuple(o.shape), o.dtype) for o in outs] == [(tuple(e.shape), e.dtype) for e in expected]
    return [(op, nbytes) for op, ptr, nbytes in mode.made if ptr not in returned and nbytes > 4 * N]


@pytest.mark.parametrize("frozen_head", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_launchers_allocate_only_what_their_meta_declares(dtype, frozen_head):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(N, H, generator=gen).to(dtype)
    w = (torch.randn(V, H, generator=gen) * H ** -0.5).to(dtype)
    labels = torch.randint(0, V, (N,), generator=gen)
    args = (h, w, labels, -100, 16, 0.0, frozen_head)
    assert _undeclared(lambda *a: linear_cross_entropy_forward(*a), _forward_meta, args) == []
    out = linear_cross_entropy_forward(*args)
    dh, dw = out[1], None if frozen_head else out[2]
    tangent = torch.tensor(1 / 3)
    assert _undeclared(lambda *a: linear_cross_entropy_backward(*a), _backward_meta, (tangent, dh, dw, dtype)) == []


def test_the_tangent_scales_in_fp32_with_one_rounding():
    gen = torch.Generator().manual_seed(1)
    dh = torch.randn(N, H, generator=gen).to(torch.bfloat16)
    dw = torch.randn(V, H, generator=gen)
    tangent = torch.tensor(1 / 3)      # grad_accum=3
    out_dh, out_dw = linear_cross_entropy_backward(tangent, dh, dw, torch.bfloat16)
    assert torch.equal(out_dh, (dh.float() * tangent).to(torch.bfloat16))
    assert torch.equal(out_dw, (dw * tangent).to(torch.bfloat16))
    biased = dh * tangent.to(torch.bfloat16)       # 1/3 rounded to bf16 first: +0.2% on every element
    assert not torch.equal(out_dh, biased)
