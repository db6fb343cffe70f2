"""LoRA on a mixture-of-experts' routed experts (finetuning_type: lora, lora.py): their projections
are fused 3-D weights in transformers 5 (gate_up_proj, down_proj), which PEFT adapts as
`target_parameters`, turning the projections' transformers-4 names onto them per model family.
Which weights a lora_target adapts, and the refusals where PEFT could not hold the adapters."""
from __future__ import annotations

import re

import torch.nn as nn

from ...errors import ArgumentError
from .names import ALL

# A PEFT wrapper's path step (PEFT wraps a module once per adapted weight).
WRAPPERS = re.compile(r"(?:[.]base_layer)+[.]")

# The fused weights of transformers 5's routed experts (stacked 3-D parameters, no Linear modules) ->
# the projections each holds.
_FUSED = {"gate_up_proj": 2, "up_proj": 1, "down_proj": 1}


def pre_fusion(model: nn.Module) -> dict[str, str]:
    """The names the routed experts' projections had as Linear modules (transformers 4) -> the fused
    weight that holds each, as PEFT's transformers_weight_conversion turns a LoRA on those names onto
    it for the model's family (Qwen3-MoE's gate_proj, up_proj, down_proj; Mixtral's w1, w3, w2); {}
    for a family PEFT turns none of (its names adapt Linear modules alone). The router (`gate`, which
    PEFT turns onto gate.weight) is left out: it takes no adapter here."""
    try:
        from peft.utils.transformers_weight_conversion import _MODEL_TO_CONVERSION_PATTERN, _MOE_TARGET_MODULE_MAPPING
    except ImportError:
        if not _experts_present(model):
            return {}
        import peft      # the table is PEFT's own: without it the experts' names would quietly adapt nothing
        raise ArgumentError(f"{type(model).__name__}'s routed experts are fused weights, which take adapters through "
                            "PEFT's transformers-5 weight conversion (peft.utils.transformers_weight_conversion); "
                            f"peft {peft.__version__} has none: pip install -U peft") from None
    pattern = _MODEL_TO_CONVERSION_PATTERN.get(getattr(getattr(model, "config", None), "model_type", None))
    return {old: new for old, new in _MOE_TARGET_MODULE_MAPPING.get(pattern, {}).items() if new in _FUSED}


_IN_BLOCK = re.compile(r"^.*?[.][0-9]+[.]")     # model.layers.0.: where a block's own path starts


def _experts_present(model: nn.Module) -> dict[str, int]:
    """The model's fused expert weights by name (3-D parameters of modules other than Linear) ->
    the projections each holds."""
    return {p: _FUSED[p] for _, m in model.named_modules() if not isinstance(m, nn.Linear)
            for p, t in m.named_parameters(recurse=False) if p in _FUSED and t.dim() == 3}


def expert_weights(model: nn.Module, target: list[str] | str, key: str = "lora_target") -> dict[str, int]:
    """The routed experts' fused weights that `target` adapts (PEFT's target_parameters) -> the
    projections each holds: under `all` every one; else those its projections' names stand for
    (Qwen3-MoE's gate_proj, up_proj, down_proj, Mixtral's w1, w3, w2), both of a fused pair named."""
    present = _experts_present(model)
    if target == ALL:
        return present
    mapping = pre_fusion(model)
    named = {mapping[n] for n in target if n in mapping and mapping[n] in present}
    if "gate_up_proj" in named:
        pair = [n for n, w in mapping.items() if w == "gate_up_proj"]
        given = [n for n in pair if n in target]
        if len(given) == 1:
            other = pair[1 - pair.index(given[0])]
            raise ArgumentError(f"{key}: {given[0]} names the routed experts' gate_up_proj, which holds {other} "
                                f"too (one fused weight takes one adapter): name both {given[0]} and {other}, "
                                "or neither")
    return {w: present[w] for w in sorted(named)}


def experts_adapted(model: nn.Module) -> bool:
    """Whether `model` carries adapters on fused expert weights (PEFT's ParamWrapper)."""
    return any(hasattr(m, "parameter_name") and hasattr(m, "lora_A") for m in model.modules())


def check_expert_settings(key: str, experts: dict[str, int], dropout: float, dora: bool, initialised: bool) -> None:
    """What PEFT's adapters on a bare parameter (its ParamWrapper) do not take, refused by name."""
    what = (f"{key} adapts the routed experts' fused weights ({', '.join(experts)}), whose adapters (PEFT's "
            "target_parameters) take")
    leave = "; or leave the experts' names out of " + key + " (all takes them in)"
    if dropout:
        raise ArgumentError(f"{what} no dropout: set lora_dropout: 0{leave}")
    if dora:
        raise ArgumentError(f"{what} no DoRA: leave use_dora out{leave}")
    if not initialised:
        raise ArgumentError(f"{what} no PiSSA start: leave pissa_init out{leave}")


def fused_weights(model: nn.Module, names: list[str]) -> list[str]:
    """The fused experts' parameters (by their path within a block) that `names` stand for."""
    mapping = pre_fusion(model)
    wanted = {mapping[n] for n in names if n in mapping}
    return sorted({_IN_BLOCK.sub("", WRAPPERS.sub(".", f"{n}.{p}"))
                   for n, m in model.named_modules() if not isinstance(m, nn.Linear)
                   for p, _ in m.named_parameters(recurse=False) if p in wanted})


def family(model: nn.Module) -> str:
    return getattr(getattr(model, "config", None), "model_type", "this model")


def whose(model: nn.Module, names: list[str]) -> str:
    """Where the Linear modules of these last names sit: a shared expert, or else (a dense MLP layer)
    the first of them by path."""
    paths = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in names]
    if paths and all("shared_expert" in n for n in paths):
        return "of its shared expert"
    return f"outside its routed experts (e.g. {paths[0].rsplit('.', 1)[0]}, a dense MLP layer)" if paths else ""


def refuse_unknown(model: nn.Module, key: str, unknown: list[str], everywhere: list[str], vision: bool) -> None:
    mapping = pre_fusion(model)
    present = _experts_present(model)
    fused = [t for t in unknown if t in mapping and fused_weights(model, [t])]
    working = [n for n, w in mapping.items() if w in present]
    own = [t for t in unknown if t in present and not vision]
    raise ArgumentError(
        f"{key}: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} no Linear module of "
        f"{type(model).__name__}; its Linear modules are {', '.join(everywhere)} (or all: every Linear of the "
        "decoder blocks)"
        + (f". {', '.join(fused)} name the routed experts' fused weights ({', '.join(fused_weights(model, fused))}),"
           " which take no adapters in a vision-language model here" if vision and fused else "")
        + (f". Its routed experts' fused weights ({', '.join(sorted(present))}) take adapters by their projections' "
           f"names, as PEFT turns them for {family(model)}: {', '.join(working)}" if working and not vision else "")
        + (f" ({', '.join(own)}: the fused weight's own name, which PEFT's target_modules match nothing by)"
           if own and working else ""))


def refuse_collision(model: nn.Module, key: str, target: list[str], colliding: list[str]) -> None:
    mapping = pre_fusion(model)
    others = [t for t in target if t not in mapping]
    raise ArgumentError(
        f"{key}: {', '.join(colliding)} name Linear modules {whose(model, colliding)} and also the routed experts' "
        f"fused weights ({', '.join(fused_weights(model, colliding))}): PEFT turns these names of {family(model)} "
        "onto the fused weights alone, when it adapts the model and when it loads an adapter, so one adapter cannot "
        f"hold both. Name the Linear modules to adapt without {', '.join(colliding)} (the routed experts then take "
        "none)" + (f", e.g. {key}: {','.join(others)}" if others else "")
        + "; or give all (the routed experts, those Linear modules left out)")
