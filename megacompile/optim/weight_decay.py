"""Which parameters AdamW's weight decay skips: the `no_decay` option resolved against the model,
and Hugging Face Trainer's rule for it.

torch.optim.AdamW decays every parameter of a group; a recipe that exempts biases and norm weights
makes two groups, weight_decay w and 0. megacompile has one AdamW over all masters, so the
exemption is a set of names: the host update steps those parameters with weight_decay 0 and
everything else alike (runtime/host.py schedule_updates cuts each owner's update there).
"""
from __future__ import annotations

import re
import sys
from typing import Callable, Collection, Iterable, Union

import torch.nn as nn

from ..errors import OptimizerInputError

# Parameter names, or a function of the model that returns them.
NoDecay = Union[Collection[str], Callable[[nn.Module], Iterable[str]]]

# transformers 5's Trainer.get_decay_parameter_names: a lowercased name that matches any of these
# is not decayed (searched in the full dotted name: each pattern's `^` there is a `.` here).
_HF_NAME_PATTERNS = [re.compile(p) for p in
                     (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")]


def hf_no_decay(model: nn.Module) -> list[str]:
    """The parameters Hugging Face's Trainer (and so TRL and LlamaFactory) trains with weight decay
    0: those inside a layer-norm module (transformers' ALL_LAYERNORM_LAYERS: nn.LayerNorm and any
    a model file registered), and those whose lowercased name holds 'bias', 'layernorm', 'rmsnorm',
    a component 'norm' or one ending in '_norm' (Trainer.get_decay_parameter_names). In
    named_parameters() order, a tied weight once."""
    norms = _layer_norm_types()
    out = []
    for name, _ in model.named_parameters():
        path = name.split(".")[:-1]
        inside_norm = any(isinstance(model.get_submodule(".".join(path[:i])), norms) for i in range(1, len(path) + 1))
        if inside_norm or any(p.search(name.lower()) for p in _HF_NAME_PATTERNS):
            out.append(name)
    return out


def _layer_norm_types() -> tuple[type, ...]:
    # A model file registers its own norms into the list when transformers imports it: without
    # transformers imported no model's norm can be on it, and importing it here would cost seconds.
    if "transformers" not in sys.modules:
        return (nn.LayerNorm,)
    try:
        from transformers.pytorch_utils import ALL_LAYERNORM_LAYERS
    except ImportError:     # a release without the list matches norms by name alone
        return (nn.LayerNorm,)
    return tuple(ALL_LAYERNORM_LAYERS) or (nn.LayerNorm,)


def check_no_decay(value: object) -> Union[frozenset, Callable]:
    """AdamW's `no_decay` as it keeps it: a function as given, names as a frozenset."""
    if callable(value):
        return value
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise OptimizerInputError(
            f"AdamW no_decay takes parameter names (a list, e.g. ['model.norm.weight']) or a function of the "
            f"model that returns them (megacompile.hf_no_decay: Hugging Face Trainer's rule), got {value!r}")
    names = list(value)
    wrong = [n for n in names if not isinstance(n, str)]
    if wrong:
        raise OptimizerInputError(f"AdamW no_decay holds {wrong[0]!r}, not a parameter name (a string)")
    return frozenset(names)


def exempt_parameters(no_decay: Union[frozenset, Callable], model: nn.Module) -> frozenset[str]:
    """The parameters `no_decay` names, each under its named_parameters() name (a tied weight may be
    named by any of its names). A name that is no parameter of the model is refused: a misspelt one
    would quietly decay."""
    names = no_decay(model) if callable(no_decay) else no_decay
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise OptimizerInputError(f"AdamW no_decay's function returned {type(names).__name__}, not parameter names")
    first = {id(p): n for n, p in model.named_parameters()}
    every = dict(model.named_parameters(remove_duplicate=False))
    names = list(names)
    unknown = [n for n in names if not isinstance(n, str) or n not in every]
    if unknown:
        # a name given without its module path: the full ones it ends
        close = [n for n in every if isinstance(unknown[0], str) and n.endswith("." + unknown[0])][:3]
        raise OptimizerInputError(
            f"AdamW no_decay names {len(unknown)} of {len(names)} that are no parameter of the model "
            f"({', '.join(map(repr, unknown[:3]))}); give each as model.named_parameters() spells it"
            + (f": {unknown[0]!r} is {' or '.join(map(repr, close))}?" if close else ""))
    return frozenset(first[id(every[n])] for n in names)
