"""Capture: the model's forward and backward as ATen graphs, one template per distinct stage."""
from __future__ import annotations

import contextlib
import dataclasses
import time

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from ..errors import CaptureError
from .blocks import BlockStack, find_block_stack
from .chunk import chunked
from .experts import routed_fractions, spread_over_templates, static_experts
from .flash_attention import flash_attention as flash_attention_op
from .grid_constants import GridConstants
from .hf_delta_rule import delta_rule_as_op
from .hf_masks import causal_attention_without_mask
from .hf_windows import span_attention, spans_without_mask
from .image_tokens import ImageTokens, static_image_merge
from .loss import LossAndOutputs, LossFn, extract_loss
from .model_graph import CapturedModel, Port, StageInstance, StateEntry
from .refuse import CHECKED_LINEAR_ATTENTION, refuse_unsupported
from .segment import build_stages
from .stage import ParamSlot, StageTemplate, TensorMeta
from .top import blocks_logged_before, trace_top
from .vision_chunks import batched_chunks
from .grid_constants import GRID_INPUTS
from .rope_positions import with_rope_positions

__all__ = ["capture", "CapturedModel", "StageInstance", "StageTemplate", "TensorMeta", "ParamSlot",
           "Port", "StateEntry", "find_block_stack", "extract_loss", "LossAndOutputs", "BlockStack", "ImageTokens",
           "GRID_INPUTS", "with_rope_positions",
           "CHECKED_LINEAR_ATTENTION", "blocks_logged_before"]


def model_state(model: nn.Module) -> dict[str, StateEntry]:
    """Parameters then buffers, by the model's own (deduplicated) names."""
    persistent = set(model.state_dict(keep_vars=True).keys())
    state = {n: StateEntry(tuple(p.shape), p.dtype, p.requires_grad, False) for n, p in model.named_parameters()}
    for n, b in model.named_buffers():
        state[n] = StateEntry(tuple(b.shape), b.dtype, False, True, n in persistent)
    return state


def capture(model: nn.Module, args: tuple, kwargs: dict, *, device: torch.device,
            compute_dtype: torch.dtype, loss_fn: LossFn | None = None, train: bool = True,
            flash_attention: bool = False) -> CapturedModel:
    """Trace `model(*args, **kwargs)` into stage templates, with fake tensors only.

    Floating parameters and buffers are traced in `compute_dtype` on `device`, as the device will
    hold them; the model's own tensors are never read, so a model on the meta device works.
    A training capture traces the backward whatever the caller's grad mode: under torch.no_grad()
    no probe would require a gradient and the backward would be traced as zeros.
    `flash_attention`: attention is recorded as torch's FlashAttention op where torch would take
    cuDNN's, the op the fusion rewrites (a capture for a fused plan; capture/flash_attention.py).
    """
    with _grad_mode(train):
        return _capture(model, args, kwargs, device=device, compute_dtype=compute_dtype, loss_fn=loss_fn, train=train,
                        flash_attention=flash_attention)


def _grad_mode(train: bool):
    return torch.enable_grad() if train else contextlib.nullcontext()


def _capture(model: nn.Module, args: tuple, kwargs: dict, *, device: torch.device,
             compute_dtype: torch.dtype, loss_fn: LossFn | None = None, train: bool = True,
             flash_attention: bool = False) -> CapturedModel:
    start = time.perf_counter()
    state = model_state(model)
    if train and not any(e.trainable for e in state.values()):     # a frozen model still runs its forward
        raise CaptureError(f"{type(model).__name__} has no trainable parameters: there is nothing to "
                           "train (check requires_grad, or that the model builds its layers in __init__)")
    refuse_unsupported(model)
    stack = find_block_stack(model)
    if stack is not None:
        stack.refuse_backward_hooks()
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    tensor_leaves = [x for x in leaves if isinstance(x, torch.Tensor)]
    if not tensor_leaves:
        raise CaptureError("the model's inputs hold no tensor: call step()/forward with tensors such as input_ids")
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)

    def cast(dtype: torch.dtype) -> torch.dtype:
        return compute_dtype if dtype.is_floating_point else dtype

    with fake_mode:
        fakes = {n: torch.empty(e.shape, dtype=cast(e.dtype), device=device).requires_grad_(e.trainable and train)
                 for n, e in state.items()}
        input_fakes = [torch.empty(t.shape, dtype=t.dtype, device=device) for t in tensor_leaves]
    fake_leaves, it = [], iter(input_fakes)
    for x in leaves:
        fake_leaves.append(next(it) if isinstance(x, torch.Tensor) else x)
    fargs, fkwargs = pytree.tree_unflatten(fake_leaves, spec)
    grids: dict[str, GridConstants] = {}
    with static_experts(model) as routed, span_attention(), batched_chunks(model), delta_rule_as_op(model), \
            flash_attention_op(flash_attention):
        with causal_attention_without_mask(model, args, kwargs), spans_without_mask(), \
                static_image_merge(model, tensor_leaves, grids) as image_tokens:
            top = trace_top(model, stack, fakes, fargs, fkwargs, loss_fn, train)
        with fake_mode:
            stages, outputs, notes = build_stages(top, model, stack, fakes,
                                                  {n: e.trainable for n, e in state.items()}, input_fakes, train)

    rechunked: dict[int, CapturedModel] = {}

    def rechunk(n: int) -> CapturedModel:
        """The same capture with the blocks' token-wise parts run over n sequence chunks (chunk.py);
        the top-level trace is reused, the stages are traced again, once per n: a model planned
        again (the smallest budget, then the user's) tries the same counts."""
        if n not in rechunked:
            with _grad_mode(train), static_experts(model), span_attention(), batched_chunks(model), \
                    delta_rule_as_op(model), flash_attention_op(flash_attention), fake_mode, chunked(n):
                again, _, _ = build_stages(top, model, stack, fakes, {k: e.trainable for k, e in state.items()},
                                           input_fakes, train)
            rechunked[n] = dataclasses.replace(captured, stages=again, rechunk=None)
        return rechunked[n]
    captured = CapturedModel(
        stages=stages, state=state, inputs=[TensorMeta.of(t, False) for t in tensor_leaves],
        input_spec=spec, input_constants=[None if isinstance(x, torch.Tensor) else x for x in leaves],
        outputs=outputs, out_spec=top.out_spec, out_constants=top.out_constants,
        out_is_tensor=top.out_is_tensor, train=train, extra_outputs=top.extra_names, compute_dtype=compute_dtype,
        block_path=stack.path if stack else None, towers=stack.towers if stack else (), template_notes=notes,
        routed_fractions=spread_over_templates(routed_fractions(model, routed), stages),
        image_tokens=list(image_tokens.values()), grids=list(grids.values()),
        trace_seconds=time.perf_counter() - start, rechunk=rechunk if train and stack is not None else None)
    return captured
