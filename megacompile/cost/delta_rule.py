"""What the gated delta rule's operators cost a plan, read from the rule itself.

megacompile::chunk_gated_delta_rule and its backward (linear_attention/delta_rule.py) are one node
each in a stage graph, but inside they run transformers' function: the torch fallback's ~40 ops a
64-token chunk, each launched on its own, and in the backward the rule again under autograd, whose
saved intermediates and gradient temporaries the operator holds while it runs. Both are measured
by tracing the rule at the node's shapes and layouts on fake tensors: the ops it runs (each pays
the profile's per-op overhead, as a traced op does) and the transient peak of the backward's
computation (op scratch, cost/reserve.py). Traced once per layout: a plan's linear-attention blocks
share one.
"""
from __future__ import annotations

import functools

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from ..ir.stage_program import StageProgram
from ..linear_attention.delta_rule import reference_rule, rule_gradients

_FORWARD = "megacompile.chunk_gated_delta_rule.default"
_BACKWARD = "megacompile.chunk_gated_delta_rule_backward.default"


def _traced_rule(node) -> tuple[int, int] | None:
    """(ops the rule runs, bytes it holds above its inputs while it runs) for a delta-rule node."""
    target = str(node.target) if node.op == "call_function" else ""
    if target not in (_FORWARD, _BACKWARD):
        return None
    n = 6 if target == _BACKWARD else 5
    tensors = [a.meta.get("val") if hasattr(a, "meta") else None for a in node.args[:n]]
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return None
    layouts = tuple((tuple(t.shape), tuple(t.stride()), t.dtype, t.device.type) for t in tensors)
    return _trace(layouts, node.args[n], node.args[n + 1], target == _BACKWARD)


@functools.lru_cache(maxsize=64)
def _trace(layouts: tuple, reference: str, use_qk_l2norm: bool, backward: bool) -> tuple[int, int]:
    with FakeTensorMode():
        tensors = [torch.empty_strided(shape, stride, dtype=dtype, device=device)
                   for shape, stride, dtype, device in layouts]
    if backward:
        def run(*xs):
            return list(rule_gradients(*xs, reference, use_qk_l2norm))
    else:
        def run(q, k, v, g, beta):
            with torch.no_grad():
                return [reference_rule(reference)(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=use_qk_l2norm)[0]]
    try:
        graph = make_fx(run, tracing_mode="fake")(*tensors)
    except Exception:  # noqa: BLE001 - a rule that does not trace (a Triton kernel) counts as one op
        return 1, 0
    program = StageProgram(graph)
    return sum(n.op == "call_function" for n in program.body), program.simulate().transient_peak


def inner_ops(node) -> int:
    """The ops a node runs: 1, or for a delta-rule operator, the ops of the rule inside it."""
    traced = _traced_rule(node)
    return 1 if traced is None else max(traced[0], 1)


def backward_scratch(node) -> int:
    """Bytes the backward operator holds inside itself (0 for any other node)."""
    traced = _traced_rule(node)
    return traced[1] if traced is not None and str(node.target) == _BACKWARD else 0


