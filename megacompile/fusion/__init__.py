"""The fusion pass: captured ATen stage graphs rewritten onto megacompile's fused Triton kernels.

    captured = fuse(captured)          # a new CapturedModel; blocks keep their templates
    print(fusion_report(captured))     # which kernel covers which original nodes, per template

Each training template's forward and backward graphs are rewritten as a pair (contract.py), in
this order, for these reasons:

  fused_linear_cross_entropy  first: it changes what the forward saves (dh and dW, or dh alone
                              for a frozen head, instead of the log-softmax), and the later
                              rewrites should see the final contract;
  linear_logprobs             the post-training losses' head, for the same reason (the fp32
                              logits leave the saved values; logprobs.py);
  backward patterns           before the forward ones: a fused backward reads only what its
                              kernel needs (x, rstd; gate, up), so the values eager saved for
                              its own backward (xhat, silu(gate), tanh(...)) stop being saved ...
  prune                       ... and are dropped from both graphs here, which frees the
                              forward groups that computed them to become one kernel each;
  forward patterns            RMSNorm, LayerNorm, SwiGLU, GELU, RoPE, softmax, in the forward
                              and in the backward (a selective variant recomputes them there);
  embedding_backward          the embedding's backward, whose ATen op allocates its [V, H]
                              result and float32 partials beside the arena (fusion/embedding.py);
  attention                   its backward with the backward patterns, its forward first of the
                              forward ones: the forward's extra outputs are pruned once the
                              backward stops reading them (fusion/attention.py);
  elementwise                 last, over what is left: chains of elementwise ops become
                              generated kernels (elementwise.py).

Everything that no rewrite claims stays eager ATen. An inference template gets the forward
patterns and the elementwise kernels.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from megacompile.capture import CapturedModel, StageTemplate
from megacompile.ir.stage_program import StageProgram

from . import activations, attention, embedding, norms, rope
from .logprobs import linear_logprobs, linear_logprobs_forward_only
from .contract import StagePair
from .cross_entropy import fused_linear_cross_entropy
from .elementwise import fuse_elementwise
from .graph import GraphEdit, copy_module
from .report import fusion_report, kernel_counts

__all__ = ["fuse", "fusion_report", "kernel_counts", "REWRITES", "FORWARD_PATTERNS"]

Rewrite = Callable[[StagePair], int]


# The rewrites of an inference template, in the order they run.
FORWARD_ONLY: dict[str, Callable[[GraphEdit], int]] = {
    "linear_logprobs": linear_logprobs_forward_only,
    "attention": attention.attention_forward,
    "rms_norm": norms.rms_norm_forward, "layer_norm": norms.layer_norm_forward,
    "swiglu": activations.swiglu_forward, "gelu": activations.gelu_forward, "rope": rope.rope_forward,
    "softmax": activations.softmax_forward, "elementwise": fuse_elementwise,
}
FORWARD_PATTERNS = frozenset(FORWARD_ONLY) - {"elementwise", "linear_logprobs"}   # the latter: pair rewrite


def over_both_graphs(forward_pattern: Callable[[GraphEdit], int]) -> Rewrite:
    """A forward pattern over a training template's forward graph and then its backward: a selective
    variant's backward redoes the block's cheap forward ops (norms, rotary, activations) before the
    gradients that read them, and those recomputed copies are the same groups of ATen ops. They are
    matched after the backward patterns and the prune, as in the forward: by then a recomputed
    `xhat` or `silu(gate)` is read only by the rest of its own forward group."""
    return lambda pair: forward_pattern(pair.fwd) + forward_pattern(pair.bwd)


# (name, rewrite), in the order they run; names are what `fuse(only=...)` selects
REWRITES: list[tuple[str, Rewrite]] = [
    ("fused_linear_cross_entropy", fused_linear_cross_entropy),
    ("linear_logprobs", linear_logprobs),
    ("attention_backward", lambda p: attention.attention_backward(p.bwd)),
    ("rms_norm_backward", norms.rms_norm_backward),
    ("layer_norm_backward", lambda p: norms.layer_norm_backward(p.bwd)),
    ("swiglu_backward", activations.swiglu_backward),
    ("gelu_backward", activations.gelu_backward),
    ("rope_backward", lambda p: rope.rope_backward(p.bwd)),
    ("embedding_backward", lambda p: embedding.embedding_backward(p.bwd)),
    ("prune", lambda p: p.prune() or 0),
    *[(name, over_both_graphs(rewrite)) for name, rewrite in FORWARD_ONLY.items() if name in FORWARD_PATTERNS],
    ("elementwise", lambda p: fuse_elementwise(p.fwd) + fuse_elementwise(p.bwd)),
]


def fuse(captured: CapturedModel, *, only: set[str] | None = None) -> CapturedModel:
    """A new CapturedModel whose stages run the fused graphs; `only` limits the rewrites by name."""
    new: dict[int, StageTemplate] = {}
    for t in captured.templates:
        new[id(t)] = fuse_template(t, only)
    stages = [dataclasses.replace(s, template=new[id(s.template)]) for s in captured.stages]
    base = captured.rechunk   # a chunked capture is fused alike
    return dataclasses.replace(captured, stages=stages,
                               rechunk=None if base is None else (lambda n: fuse(base(n), only=only)))


def fuse_template(t: StageTemplate, only: set[str] | None = None) -> StageTemplate:
    wanted = lambda name: only is None or name in only or name == "prune"  # noqa: E731
    if t.forward is not None and t.backward is not None:
        pair = StagePair(t)
        for name, rewrite in REWRITES:
            if wanted(name):
                rewrite(pair)
                pair.fwd.dce()
                pair.bwd.dce()
        fused = pair.template()
        if t.selective is not None:
            fused.selective = fuse_template(t.selective, only)
            fused.selective.full = fused
        return fused
    if t.inference is not None:
        edit = GraphEdit(copy_module(t.inference.gm))
        for name, rewrite in FORWARD_ONLY.items():
            if wanted(name):
                rewrite(edit)
                edit.dce()
        edit.graph.lint()
        edit.gm.recompile()
        inference = StageProgram(edit.gm)
        return dataclasses.replace(t, inference=inference, inf_memory=inference.simulate())
    return t
