"""A resume on the model the checkpoint trained, told from its config.

load_checkpoint refuses weights of other shapes, but many changes keep every shape: the heads a
projection splits into (8 heads of 32 against 4 of 64), rope_theta, the norm's eps, an activation,
the sliding window. Trained on from a checkpoint, such a model computes something else with the
saved weights, and the run would go on silently wrong. Every checkpoint keeps the model's config
(`saved`), and a resume whose model's config differs in anything that computes is refused, naming
the values, before anything of the run folder is written (`check`).
"""
from __future__ import annotations

import dataclasses
import json

import torch.nn as nn

from ..errors import ArgumentError

KEY = "model_config"
# A config's entries that say where the model came from or how it is read, not what it computes.
NOT_COMPUTED = frozenset({
    "_name_or_path", "name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache", "architectures",
    "_attn_implementation", "_attn_implementation_autoset", "_commit_hash", "output_attentions",
    "output_hidden_states", "return_dict", "use_return_dict", "auto_map", "_experts_implementation",
})


def saved(model: nn.Module) -> dict:
    """The model's config as a checkpoint keeps it: a Hugging Face config's values (its nested
    configs too), or the bundled model's fields; what does not compute left out."""
    config = getattr(model, "config", None)
    if config is None and dataclasses.is_dataclass(getattr(model, "c", None)):
        config = model.c        # the bundled model's
    if config is None:
        return {}
    values = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else config.to_dict()
    return json.loads(json.dumps(_computed(values), default=str))


def _computed(values):
    if isinstance(values, dict):
        return {k: _computed(v) for k, v in values.items() if k not in NOT_COMPUTED}
    return values


def check(path: str, extra: dict, model: nn.Module) -> None:
    """Refuse a resume whose model's config differs from the one its checkpoint trained. A
    checkpoint saved without one (an earlier release's) is taken as before."""
    before = extra.get(KEY)
    if not isinstance(before, dict) or not before:
        return
    changed = changes(before, saved(model))
    if changed:
        shown = ", ".join(changed[:4]) + (f", ... ({len(changed) - 4} more)" if len(changed) > 4 else "")
        raise ArgumentError(f"{path} was saved by a run of a model configured otherwise ({shown}): its weights would "
                            "compute something else here; resume it with the model it trained (the same model "
                            "folder's config.json, bundled_model and rope_scaling), or start a new run_dir")


def changes(before: dict, now: dict, prefix: str = "") -> list[str]:
    """The entries both configs hold with other values. An entry one of them lacks is a release of
    transformers writing another set of defaults (a field added), not a model changed."""
    changed = []
    for k in sorted(set(before) & set(now)):
        a, b = before.get(k), now.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            changed += changes(a, b, f"{prefix}{k}.")
        elif a != b:
            changed.append(f"{prefix}{k} {a!r} -> {b!r}")
    return changed
