"""What the fusion pass did, per template: which kernel covers which original ATen nodes."""
from __future__ import annotations

from collections import Counter

import torch.fx as fx

from megacompile.capture import CapturedModel

from .graph import is_kernel


def kernel_nodes(gm: fx.GraphModule | None) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if is_kernel(n)] if gm is not None else []


def kernel_counts(gm: fx.GraphModule | None) -> Counter:
    """{kernel name: nodes} in one graph; generated kernels count as 'elementwise'."""
    return Counter(n.meta["kernel"] for n in kernel_nodes(gm))


def fusion_report(captured: CapturedModel) -> str:
    """One section per template: each kernel node, the kernel it runs and the nodes it replaced."""
    uses = Counter(id(s.template) for s in captured.stages)
    lines = []
    for t in captured.templates:
        shared = f", shared by {uses[id(t)]} stages" if uses[id(t)] > 1 else ""
        lines.append(f"{t.kind}{shared}:")
        graphs = [("forward", t.forward), ("backward", t.backward), ("inference", t.inference)]
        any_kernel = False
        for label, program in graphs:
            nodes = kernel_nodes(program.gm) if program is not None else []
            for n in nodes:
                name = n.meta["kernel"]
                if name == "elementwise":
                    name = n.target.__name__
                covered = ", ".join(n.meta["fused_from"])
                lines.append(f"  {label:<9} {name:<36} <- {covered}")
                any_kernel = True
        if not any_kernel:
            lines.append("  (no fused kernels: every node runs eager ATen)")
    return "\n".join(lines)
