"""megacompile.from_pretrained: a Hugging Face model folder straight into the host masters.

The model is built from config.json with its parameters on the meta device (no weight memory)
and its buffers real (io/hf_load.py). The shards' headers are checked against the model before
the engine exists; the tensors themselves stream into the masters when the first step builds
the host state (io/source.py), one at a time, cast to fp32.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch.nn as nn

from ..errors import WeightsFileError
from ..io.hf_load import build_model, plan_items, shard_map
from ..io.source import PendingLoad
from .engine import Engine


def from_pretrained(path: str, hbm_budget: float, **compile_kwargs: Any) -> Engine:
    """Compile the causal LM in the Hugging Face folder `path` (config.json and model.safetensors
    or sharded model.safetensors.index.json); compile_kwargs as megacompile.compile."""
    if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
        raise WeightsFileError(f"from_pretrained takes a local model folder (config.json + safetensors); {path!r} "
                               "is not a folder")
    path = os.fspath(path)
    return compile_folder(build_model(path), path, hbm_budget, **compile_kwargs)


def compile_folder(model: nn.Module, path: str, hbm_budget: float, file_key: Callable[[str], str] | None = None,
                   unused: tuple[str, ...] = (), grown=None, edits: tuple = (), **compile_kwargs: Any) -> Engine:
    """from_pretrained, for the module build_model(path) made (a caller that planned on it first:
    megacompile train). file_key: a state_dict key's name in the folder's files, where the module
    wraps the folder's model (a PEFT model); its parameters that are not on meta (the adapters)
    are the module's own and load from it. unused: tensors of the files the module leaves out on
    purpose (io/hf_load.py's plan_items). grown: a vocabulary grown past the folder's
    (io/grown_vocab.py): its tensors' rows made as they stream in. edits: what else a run makes of
    some tensors as they stream in, each routing their items through a source of its own
    (`route(items) -> (items, memory)`): PiSSA's residual base (train/methods/pissa.py)."""
    shards = shard_map(path)
    engine = Engine(model, hbm_budget, **compile_kwargs)
    state = engine.state
    canonical = state.canonical if file_key is None else {file_key(k): n for k, n in state.canonical.items()}
    own = tuple(n for n, p in model.named_parameters() if not p.is_meta)
    items, memory = plan_items(canonical, model, path, shards, unused, grown=grown), None
    for edit in (grown, *edits) if grown is not None else edits:
        items, routed = edit.route(items)
        memory = {**(memory or {}), **routed}
    state.weights_arrive(PendingLoad(items, own_buffers=True, own_params=own, describe=f"the weights in {path}",
                                     memory=memory), source_dir=path)
    return engine
