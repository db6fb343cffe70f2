"""A buffer filled through slices (DeepSeek's key: new_empty, then copy_ into each part) stays in
the forward with the writes that fill it, whoever reads it: a view of it, or an operator whose
result shares nothing with it (megacompile::window_attention), which reads it last."""
from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from megacompile.attention import window as _registers_window_attention  # noqa: F401
from megacompile.capture.split import _writes_into_forward, ancestors


def _filled_then_read(read_by_view: bool):
    def f(q, part, v):
        key = part.new_empty(*part.shape[:-1], 2 * part.shape[-1])
        key[..., :part.shape[-1]].copy_(part)
        key[..., part.shape[-1]:].copy_(part * 2)
        if read_by_view:
            return torch.matmul(q, key.transpose(-1, -2))
        return torch.ops.megacompile.window_attention(q, key, v, 0.5, q.shape[2])[0]
    q, part, v = torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 8)
    return make_fx(f, tracing_mode="fake")(q, part, v).graph


def test_the_writes_that_fill_a_buffer_stay_in_the_forward_with_its_reader():
    for read_by_view in (True, False):
        graph = _filled_then_read(read_by_view)
        nodes = list(graph.nodes)
        reader = next(n for n in reversed(nodes) if n.op == "call_function" and n.target is not torch.ops.aten.transpose.int
                      and "getitem" not in str(n.target))
        forward = ancestors([reader]) | {reader}
        writes = [n for n in nodes if n.target is torch.ops.aten.copy_.default]
        assert len(writes) == 2 and not set(writes) & forward     # no data edge leads to them ...
        assert set(writes) <= _writes_into_forward(nodes, forward), read_by_view   # ... yet they stay
