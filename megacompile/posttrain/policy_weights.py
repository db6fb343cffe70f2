"""The trained policy's weights out of the engine, one tensor at a time, under the policy's own
Hugging Face names: what a generation copy (a bf16 transformers model, a vLLM engine) loads after
each optimizer step.

The engine trains an objective (the policy + a loss, `posttrain/dpo.py`, `grpo.py`) or the policy
itself; its state_dict keys are the objective's, `policy.model.layers.0...`. The policy is the
Hugging Face model inside it (a `PreTrainedModel`); its prefix is stripped. Each tensor is a view
of the fp32 master (io/unbuilt.py: never a copy of the whole state); a tied weight is given once,
under its first name, as transformers saves it.
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from ..errors import ArgumentError
from ..io import unbuilt


def policy_of(engine) -> tuple[nn.Module, str]:
    """The Hugging Face model the engine trains (the model itself, or the first one inside it) and
    the prefix its names carry in the engine's state (`policy.` inside an objective)."""
    from transformers import PreTrainedModel
    for name, module in engine.state.model.named_modules():
        if isinstance(module, PreTrainedModel):
            adapted = [n for n, _ in module.named_parameters() if ".base_layer." in n]
            if adapted:
                raise ArgumentError(
                    f"the policy carries LoRA adapters ({adapted[0]}, ...), and a generation copy takes plain "
                    "weights under the model's own names: sample with EngineGenerator, or train without adapters")
            return module, f"{name}." if name else ""
    raise ArgumentError(
        f"a generation copy is built from a Hugging Face model's config, and the engine trains "
        f"{type(engine.state.model).__name__}, which holds none: compile a transformers model (or an objective "
        "around one), or sample with EngineGenerator")


def tied_names(engine, prefix: str) -> dict[str, str]:
    """Each tied alias under the policy -> the name its weight is given under (both prefix-free)."""
    return {key[len(prefix):]: name[len(prefix):] for key, name in engine.state.canonical.items()
            if key != name and key.startswith(prefix)}


def policy_weights(engine, prefix: str, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name without the prefix, tensor) for every weight and persistent buffer of the policy, one
    at a time: the master itself where `dtype` is None or its own, else that tensor alone cast to
    `dtype` (floating tensors only), made when the consumer asks for it."""
    canonical = engine.state.canonical
    for key, t in unbuilt.state_tensors(engine.state):
        if canonical.get(key, key) != key or not key.startswith(prefix):
            continue          # a tied alias, or the objective's own tensors
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        yield key[len(prefix):], t
