"""What crosses a stage boundary is laid out as the reading stage was traced: contiguous where the
value is a permuted dense tensor (its copy made inside the producing graph, where the plan counts
and places it), a broadcast left as it is (made contiguous it would grow)."""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from megacompile.capture.stage import ParamSlot, TensorMeta, trace_stage


def _source(params, acts):
    w, = params
    x, mask = acts
    h = (x @ w).transpose(0, 1)          # [4, 8] laid out as a transpose of [8, 4]
    return [h, mask.expand(3, 8, 8)]     # a broadcast: stride 0 on its first dimension


def _template():
    with FakeTensorMode():
        w = torch.empty(8, 4).requires_grad_(True)
        x = torch.empty(8, 8).t().requires_grad_(True)      # the gradient of x comes out transposed too
        mask = torch.empty(1, 8, 8)
        slot = ParamSlot("w", TensorMeta((8, 4), torch.float32, True), True)
        return trace_stage("block", _source, [slot], [w], [x, mask], True, "test")


def _val(program, i):
    return program.output_node.args[0][i].meta["val"]


def test_a_permuted_output_and_input_gradient_leave_their_graph_contiguous():
    t = _template()
    h = _val(t.forward, 0)
    assert tuple(h.shape) == (4, 8) and h.is_contiguous()
    grads = t.backward.output_node.args[0]
    dx = grads[len(t.grad_params)].meta["val"]      # the gradient of x: the previous stage's tangent
    assert tuple(dx.shape) == (8, 8) and dx.is_contiguous()
    targets = {str(n.target) for n in t.forward.gm.graph.nodes} | {str(n.target) for n in t.backward.gm.graph.nodes}
    assert "aten.clone.default" in targets


def test_a_broadcast_output_is_not_materialised():
    t = _template()
    mask = _val(t.forward, 1)
    assert tuple(mask.shape) == (3, 8, 8) and mask.stride()[0] == 0
