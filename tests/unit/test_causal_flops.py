"""Causal attention costs about half the FLOPs of full attention: the kernels skip the blocks
above the diagonal, which torch's counter formulas count."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from megacompile.cost.estimate import node_flops


def _attention_flops(causal: bool) -> tuple[float, float]:
    def step(q, k, v):
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return torch.autograd.grad(out.sum(), (q, k, v))
    q = torch.randn(1, 2, 64, 16)
    gm = make_fx(step, tracing_mode="fake")(q, q.clone(), q.clone())
    sdpa = [n for n in gm.graph.nodes if n.op == "call_function" and "scaled_dot_product" in str(n.target)]
    forward = [n for n in sdpa if "backward" not in str(n.target)]
    backward = [n for n in sdpa if "backward" in str(n.target)]
    assert forward and backward
    return sum(map(node_flops, forward)), sum(map(node_flops, backward))


def test_causal_attention_counts_half_the_pairs():
    full, causal = _attention_flops(False), _attention_flops(True)
    assert full[0] > 0 and full[1] > 0
    assert causal == (full[0] / 2, full[1] / 2)
