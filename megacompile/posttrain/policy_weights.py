"""The trained policy's weights out of the engine, one tensor at a time, under the policy's own
Hugging Face names: what a generation copy (a bf16 transformers model, a vLLM engine) loads after
each optimizer step.

The engine trains an objective (the policy + a loss, `posttrain/dpo.py`, `grpo.py`) or the policy
itself; its state_dict keys are the objective's, `policy.model.layers.0...`. The policy is the
Hugging Face model inside it (a `PreTrainedModel`); its prefix is stripped. Each tensor is a view
of the fp32 master (io/unbuilt.py: never a copy of the whole state); a tied weight is given once,
under its first name, as transformers saves it.

A policy trained with LoRA adapters (PEFT's LoRA layers on the model's Linear modules) is given
as the plain model a copy is built as: each adapted weight merged, W + scaling B A in float32,
under the base model's name (no `base_layer`, no adapters), made one tensor at a time when the
consumer asks for it, as TRL merges a PEFT policy before it hands vLLM the weights. With DoRA's
magnitude m beside the adapter, that sum is scaled row by row to m, m / ||W + scaling B A|| (each
output's norm over its inputs), as PEFT merges DoRA. The adapters' dropout is a training-time mask
and plays no part. A PEFT layer of another tuner, or of several adapters, is refused, and so are
adapters on a mixture-of-experts' fused expert weights (PEFT's target_parameters).
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
            adapters(module)            # a PEFT layer a merge would not reproduce: refused here
            return module, f"{name}." if name else ""
    raise ArgumentError(
        f"a generation copy is built from a Hugging Face model's config, and the engine trains "
        f"{type(engine.state.model).__name__}, which holds none: compile a transformers model (or an objective "
        "around one), or sample with EngineGenerator")


def adapters(policy: nn.Module) -> dict[str, float]:
    """Each LoRA-adapted module under the policy (its name) -> the scaling its adapter's B A is
    added with; {} for a policy without adapters."""
    out = {}
    for name, module in policy.named_modules():
        if not hasattr(module, "base_layer"):
            continue
        if hasattr(module, "parameter_name"):
            raise ArgumentError(
                f"{name} carries LoRA adapters on the routed experts' fused {module.parameter_name} (PEFT's "
                "target_parameters): a generation copy takes the weights merged, which is done for adapters on "
                "Linear modules alone; sample with EngineGenerator, or leave the experts out of lora_target")
        names = list(getattr(module, "active_adapters", None) or [])
        if not hasattr(module, "lora_A") or len(names) != 1 or names[0] not in module.lora_A:
            raise ArgumentError(
                f"{name} is a PEFT layer ({type(module).__name__}) other than one LoRA adapter (another tuner, "
                "several adapters): a generation copy takes the weights merged, which is done for one LoRA or "
                "DoRA adapter alone; sample with EngineGenerator")
        out[name] = float(module.scaling[names[0]])
    return out


def tied_names(engine, prefix: str) -> dict[str, str]:
    """Each tied alias under the policy -> the name its weight is given under (both prefix-free)."""
    return {key[len(prefix):]: name[len(prefix):] for key, name in engine.state.canonical.items()
            if key != name and key.startswith(prefix)}


def policy_weights(engine, prefix: str, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name without the prefix, tensor) for every weight and persistent buffer of the policy, one
    at a time: the master itself where `dtype` is None or its own, else that tensor alone cast to
    `dtype` (floating tensors only), made when the consumer asks for it. An adapted weight is
    merged (float32, or `dtype`)."""
    canonical = engine.state.canonical
    policy = engine.state.model.get_submodule(prefix[:-1]) if prefix else engine.state.model
    scaling = adapters(policy)
    tied = [o for o in scaling if canonical.get(f"{prefix}{o}.base_layer.weight", "") not in
            ("", f"{prefix}{o}.base_layer.weight")]
    if tied:
        raise ArgumentError(f"{tied[0]} carries a LoRA adapter on a weight tied to another "
                            f"({canonical[prefix + tied[0] + '.base_layer.weight'][len(prefix):]}): a generation copy "
                            "keeps the two tied, and cannot hold one of them merged; leave it out of lora_target, or "
                            "sample with EngineGenerator")
    factors = {}           # the adapters' A, B and DoRA magnitudes (small), read before the weights they go into
    if scaling:
        factors = {key[len(prefix):]: t for key, t in unbuilt.state_tensors(engine.state)
                   if key.startswith(prefix) and any(f in key for f in _FACTORS)}
    for key, t in unbuilt.state_tensors(engine.state):
        if canonical.get(key, key) != key or not key.startswith(prefix):
            continue          # a tied alias, or the objective's own tensors
        name = key[len(prefix):]
        if any(f in name for f in _FACTORS):
            continue
        if ".base_layer." in name:
            owner = name.split(".base_layer.")[0]
            name = name.replace(".base_layer.", ".")
            if name == f"{owner}.weight" and owner in scaling:
                a_key, b_key = _factor_keys(owner, factors)
                t = t.float() + scaling[owner] * (factors[b_key].float() @ factors[a_key].float())
                magnitude = factors.get(a_key.replace(".lora_A.", ".lora_magnitude_vector.", 1))
                if magnitude is not None:       # DoRA
                    t = t * (magnitude.float() / t.norm(dim=1)).unsqueeze(1)
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        yield name, t


_FACTORS = (".lora_A.", ".lora_B.", ".lora_magnitude_vector.")


def _factor_keys(owner: str, factors: dict) -> tuple[str, str]:
    """The names of `owner`'s adapter A and B weights (PEFT's `<owner>.lora_A.<adapter>.weight`)."""
    a = next(k for k in factors if k.startswith(f"{owner}.lora_A.") and k.endswith(".weight"))
    return a, a.replace(".lora_A.", ".lora_B.", 1)
