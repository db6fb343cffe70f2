"""The fused attention kernels are priced at the profile's attention efficiency, a share of the
matmul rate; a matmul beside them is not."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from megacompile.cost import PROFILES, graph_cost
from megacompile.cost.estimate import is_attention, node_bytes, node_flops
from megacompile.ir.stage_program import StageProgram


def _program() -> StageProgram:
    """An attention forward and backward with a projection: enough work that compute, not memory
    or the per-op overhead, sets both ops' times on an H100 profile."""
    def step(x, w, k, v):
        x, w, k, v = (t.requires_grad_() for t in (x, w, k, v))
        q = (x @ w).view(1, 8, 4096, 128)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.autograd.grad(out.sum(), (x, w, k, v))
    x, w = torch.randn(8 * 4096, 128, dtype=torch.bfloat16), torch.randn(128, 128, dtype=torch.bfloat16)
    k = torch.randn(1, 8, 4096, 128, dtype=torch.bfloat16)
    return StageProgram(make_fx(step, tracing_mode="fake")(x, w, k, k.clone()))


def _attention_nodes(program: StageProgram) -> list:
    nodes = [n for n in program.body if n.op == "call_function"]
    assert any(node_flops(n) > 0 for n in nodes if not is_attention(n))     # the projection
    return [n for n in nodes if is_attention(n) and node_flops(n) > 0]


@pytest.mark.parametrize("efficiency", [0.48, 0.25])
def test_attention_time_follows_the_efficiency(efficiency):
    """Lowering the efficiency adds to each attention op's time exactly flops / rate more, and
    nothing to any other op."""
    hw = PROFILES["h100"]
    matmul_rate = hw.peak_bf16 * hw.matmul_efficiency
    program = _program()
    attention = _attention_nodes(program)
    assert len(attention) == 2                      # forward and backward
    for node in attention:                          # compute-bound even at the matmul rate
        assert node_flops(node) / matmul_rate > node_bytes(node) / (hw.device_bw * hw.memory_efficiency)
    flops = sum(map(node_flops, attention))
    at_matmul_rate = graph_cost(program, replace(hw, attention_efficiency=1.0), torch.bfloat16).seconds
    slower = graph_cost(program, replace(hw, attention_efficiency=efficiency), torch.bfloat16).seconds
    assert slower - at_matmul_rate == pytest.approx(flops / matmul_rate * (1 / efficiency - 1), rel=1e-6)


def test_hopper_profiles_price_attention_below_matmul_peak():
    for name in ("h100", "h100-pcie", "h200", "gh200"):
        assert PROFILES[name].attention_efficiency == pytest.approx(0.48)
    assert PROFILES["a100"].attention_efficiency == 1.0
    program = _program()
    hopper = graph_cost(program, PROFILES["h100"], torch.bfloat16).seconds
    at_matmul_rate = graph_cost(program, replace(PROFILES["h100"], attention_efficiency=1.0), torch.bfloat16).seconds
    assert hopper > at_matmul_rate


def _sdpa_step(causal: bool):
    """SDPA forward and backward with an upstream gradient of its own (as a block's is)."""
    def step(q, k, v, do):
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return torch.autograd.grad(out, (q, k, v), do)
    q = torch.randn(1, 2, 64, 16)
    return make_fx(step, tracing_mode="fake")(q, q.clone(), q.clone(), q.clone())


def test_the_fused_attention_kernels_are_priced_by_the_matmuls_they_run():
    """Rewritten onto kernels/attention.py, the forward counts what the flash op counts and the
    backward 14/10 of it (seven matmuls to five), causal halving both, at the same efficiency."""
    from megacompile.fusion.attention import attention_backward, attention_forward
    from megacompile.fusion.graph import GraphEdit

    for causal in (True, False):
        gm = _sdpa_step(causal)
        before = [node_flops(n) for n in gm.graph.nodes if is_attention(n)]
        edit = GraphEdit(gm)
        assert attention_backward(edit) == 1
        edit.dce()
        assert attention_forward(edit) == 1
        edit.dce()
        kernels = [n for n in gm.graph.nodes if is_attention(n)]
        assert [n.meta["kernel"] for n in kernels] == ["attention", "attention_backward"]
        after = [node_flops(n) for n in kernels]
        assert after == pytest.approx([before[0], before[1] * 14 / 10]) and after[0] == 4 * 2 * 64 * 64 * 16 * (
            0.5 if causal else 1.0)


def test_a_measured_kernel_efficiency_prices_the_kernel_and_leaves_torchs_ops_alone():
    from megacompile.cost.estimate import attention_share
    from megacompile.fusion.attention import attention_backward, attention_forward
    from megacompile.fusion.graph import GraphEdit

    aten_ops = [n for n in _sdpa_step(True).graph.nodes if is_attention(n)]
    fused_gm = _sdpa_step(True)
    edit = GraphEdit(fused_gm)
    assert attention_backward(edit) == 1
    edit.dce()
    assert attention_forward(edit) == 1
    hw = PROFILES["h100"]
    measured = replace(hw, fused_attention_efficiency=0.3)
    kernels = [n for n in fused_gm.graph.nodes if n.meta.get("kernel") in ("attention", "attention_backward")]
    assert [attention_share(n, hw) for n in kernels] == [hw.attention_efficiency] * 2      # unmeasured: torch's
    assert [attention_share(n, measured) for n in kernels] == [0.3, 0.3]
    assert len(aten_ops) == 2 and all(attention_share(n, measured) == hw.attention_efficiency for n in aten_ops)
