"""Refuse a forward that writes a parameter or buffer in place.

BatchNorm in training mode updates its running statistics and num_batches_tracked inside the
forward. megacompile runs every stage on device copies of the host's parameters and buffers and
carries nothing back but gradients, so such a write would be dropped silently: refuse it at
capture, naming the tensor.
"""
from __future__ import annotations

import torch

from ..errors import CaptureError

# Ops that update their running_mean and running_var arguments in training mode, though their
# schema does not mark those arguments as written.
_RUNNING_STATS = {"native_batch_norm", "_native_batch_norm_legit", "cudnn_batch_norm", "miopen_batch_norm",
                  "_batch_norm_impl_index", "batch_norm"}


def refuse_state_writes(gm: torch.fx.GraphModule, names: list[str], where: str) -> None:
    """`names`: what the graph's first placeholders are (parameters and buffers, in order)."""
    placeholders = (n for n in gm.graph.nodes if n.op == "placeholder")
    state = dict(zip(placeholders, names))
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        args = {a.name: (node.args[i] if i < len(node.args) else node.kwargs.get(a.name))
                for i, a in enumerate(schema.arguments)}
        written = [args[a.name] for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        if schema.name.split("::")[-1] in _RUNNING_STATS and args.get("training") is True:
            written += [args.get("running_mean"), args.get("running_var")]
        for target in written:
            if target in state:
                raise CaptureError(
                    f"{where} writes {state[target]} in its forward ({node.target}); megacompile trains from "
                    "device copies of parameters and buffers and would drop that update. A BatchNorm in "
                    "training mode updates its running statistics so: put such modules in eval() or build "
                    "them with track_running_stats=False before compile()")
