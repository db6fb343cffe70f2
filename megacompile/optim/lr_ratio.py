"""Learning rates per parameter: AdamW's `lr_ratios`, each named parameter stepped at lr x its ratio.

torch.optim.AdamW gives each param group its own lr. A recipe such as LoRA+ (LlamaFactory's
`loraplus_lr_ratio`: each adapter's B, and the 1-D trained parameters, at 16x the lr of the A
matrices) makes groups whose lr is a multiple of one base lr, and a torch scheduler scales every
group's lr by the same factor each step. megacompile has one AdamW over all masters, so those groups
are a ratio per parameter name: the host update steps each run of neighbouring parameters of one
ratio at the step's lr x that ratio (runtime/host.py schedule_updates), and a schedule moves the
one lr, so every group's with it.
"""
from __future__ import annotations

import math
import numbers
from typing import Callable, Mapping, Union

import torch.nn as nn

from ..errors import OptimizerInputError

# {parameter name: ratio}, or a function of the model that returns it.
LrRatios = Union[Mapping[str, float], Callable[[nn.Module], Mapping[str, float]]]
# A ratio moves lr by orders of magnitude at most (LoRA+ suggests 2 to 2**8).
MAX_RATIO = 1e6


def check_lr_ratios(value: object) -> Union[tuple, Callable]:
    """AdamW's `lr_ratios` as it keeps it: a function as given, a mapping as sorted (name, ratio)
    pairs (AdamW is frozen and hashable)."""
    if callable(value):
        return value
    if isinstance(value, tuple):      # kept already
        value = dict(value)
    if not isinstance(value, Mapping):
        raise OptimizerInputError(
            f"AdamW lr_ratios takes {{parameter name: ratio}} (e.g. {{'lm_head.weight': 0.1}}) or a function of "
            f"the model that returns it, got {value!r}")
    return tuple(sorted(_checked(value, "AdamW lr_ratios").items()))


def _checked(ratios: Mapping, what: str) -> dict[str, float]:
    out = {}
    for name, ratio in ratios.items():
        if not isinstance(name, str):
            raise OptimizerInputError(f"{what} holds {name!r}, not a parameter name (a string)")
        if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or not 0 < ratio <= MAX_RATIO \
                or math.isnan(ratio):
            raise OptimizerInputError(f"{what} gives {name} the ratio {ratio!r}; a ratio is a number in "
                                      f"(0, {MAX_RATIO:g}]: that parameter's lr is lr x the ratio")
        out[name] = float(ratio)
    return out


def parameter_ratios(lr_ratios: Union[tuple, Callable], model: nn.Module) -> dict[str, float]:
    """The ratio of each parameter `lr_ratios` names other than 1, under its named_parameters() name
    (a tied weight may be named by any of its names). A name that is no parameter of the model is
    refused: a misspelt one would quietly step at lr."""
    given = lr_ratios(model) if callable(lr_ratios) else dict(lr_ratios)
    if not isinstance(given, Mapping):
        raise OptimizerInputError(f"AdamW lr_ratios' function returned {type(given).__name__}, not "
                                  "{parameter name: ratio}")
    given = _checked(given, "AdamW lr_ratios")
    first = {id(p): n for n, p in model.named_parameters()}
    every = dict(model.named_parameters(remove_duplicate=False))
    unknown = [n for n in given if n not in every]
    if unknown:
        raise OptimizerInputError(
            f"AdamW lr_ratios names {len(unknown)} of {len(given)} that are no parameter of the model "
            f"({', '.join(map(repr, unknown[:3]))}); give each as model.named_parameters() spells it")
    out: dict[str, float] = {}
    for name, ratio in given.items():
        canonical = first[id(every[name])]
        if out.get(canonical, ratio) != ratio:
            raise OptimizerInputError(f"AdamW lr_ratios gives the tied weight {canonical} two ratios, "
                                      f"{out[canonical]:g} and {ratio:g}")
        out[canonical] = ratio
    return {n: r for n, r in out.items() if r != 1.0}
