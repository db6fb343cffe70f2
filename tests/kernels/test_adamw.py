import pytest
import torch

from megacompile.kernels.adamw import adamw_step_, adamw_step_all_
from megacompile.kernels.check import relative_error
from megacompile.kernels.reference import adamw_ref


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("shape", [(37, 129), (5,)])
def test_adamw_matches_torch_over_steps(shape, weight_decay, grad_dtype):
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(shape, generator=gen)
    m, v = torch.zeros(shape), torch.zeros(shape)  # a cold start: the bias corrections matter most
    hyper = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    kp, km, kv, out = p.clone(), m.clone(), v.clone(), torch.empty(shape, dtype=torch.bfloat16)
    for step in range(1, 5):
        g = torch.randn(shape, generator=gen).to(grad_dtype)
        adamw_step_(kp, g, km, kv, step=step, out=out, **hyper)
        p, m, v = adamw_ref(p, g, m, v, step=step, **hyper)
        assert relative_error(kp, p) < 1e-6 and relative_error(km, m) < 1e-6 and relative_error(kv, v) < 1e-6
        assert torch.equal(out, p.to(torch.bfloat16))


def test_adamw_over_a_list_leaves_out_none_copies():
    gen = torch.Generator().manual_seed(1)
    ps = [torch.randn(7, generator=gen), torch.randn(3, 5, generator=gen)]
    gs = [torch.randn_like(p) for p in ps]
    ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    expected = [adamw_ref(p, g, m, v, step=1)[0] for p, g, m, v in zip(ps, gs, ms, vs)]
    out = torch.empty(3, 5, dtype=torch.bfloat16)
    adamw_step_all_(ps, gs, ms, vs, step=1, outs=[None, out])
    for p, e in zip(ps, expected):
        assert relative_error(p, e) < 1e-6
    assert torch.equal(out, expected[1].to(torch.bfloat16))
