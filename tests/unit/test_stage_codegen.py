"""The generated straight-line code of a stage graph does what the interpreter does: the same
outputs, and the same allocations and drops in the same order (the ledger's peaks depend on it)."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from megacompile.ir.stage_codegen import generate
from megacompile.ir.stage_program import StageProgram


def _block(x, w, b):
    h = torch.nn.functional.linear(x, w, b)
    parts = torch.split(h, [3, 5], dim=-1)
    g = torch.nn.functional.gelu(parts[0]) * parts[1][..., :3]
    return torch.cat([g, x[..., :2]], dim=-1).sum(dim=(0,)), h.transpose(0, 1), x


def _trace():
    args = (torch.randn(4, 6), torch.randn(8, 6), torch.randn(8))
    return make_fx(_block)(*args), args


def _events(run, program, args):
    events = []
    outs = run(program, list(args), lambda n, v: events.append(("alloc", n.name)),
               lambda n, v: events.append(("free", n.name)))
    return outs, events


def test_generated_code_matches_the_interpreter_op_for_op():
    gm, args = _trace()
    program = StageProgram(gm)
    assert generate(program) is not None
    ours, ours_events = _events(StageProgram.run, program, args)
    theirs, their_events = _events(StageProgram.interpret, program, args)
    assert ours_events == their_events and len(ours_events) > 10
    assert len(ours) == len(theirs) == 3
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    assert ours[2] is args[0]          # an input passed through is the input itself


def test_a_node_inside_an_unknown_container_falls_back_to_the_interpreter():
    graph = fx.Graph()
    x = graph.placeholder("x")
    out = graph.call_function(operator.getitem, ({"a": x}, "a"))
    graph.output([out])
    program = StageProgram(fx.GraphModule(torch.nn.Module(), graph))
    assert generate(program) is None
    t = torch.ones(2)
    assert program.run([t], lambda n, v: None, lambda n, v: None)[0] is t
