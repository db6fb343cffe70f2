"""A Hugging Face model folder read for megacompile.from_pretrained (engine/from_pretrained.py).

The model is built from config.json with its parameters on the meta device (no weight memory)
and its buffers real: buffers that are not saved (rotary `inv_freq`) are computed by the
model's own constructor from the config, as in an eager build. The shards' headers are checked
against the model (every parameter present, shapes, no tensor the model has no place for,
no file cut short) before the engine exists; the tensors themselves stream into the masters
when the first step builds the host state (io/source.py), one at a time, cast to fp32.
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Callable

import torch
import torch.nn as nn

from ..errors import WeightsFileError
from .header import read_header
from .hf_layout import INDEX, SINGLE, DiskLayout, inner_model, part_shape
from .source import CONST, WEIGHT, Item



@contextlib.contextmanager
def parameters_on_meta():
    """Every parameter registered inside is moved to the meta device; buffers stay real. The
    initializers are skipped (transformers' no_init_weights): an uninitialised CPU tensor is
    only reserved address space, never touched, until it moves to meta."""
    from transformers.initialization import no_init_weights
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)
    nn.Module.register_parameter = on_meta
    try:
        with no_init_weights():
            yield
    finally:
        nn.Module.register_parameter = register


def build_model(path: str, edit: Callable | None = None) -> nn.Module:
    """The model of the folder `path` with its weights on meta, as its config.json builds it
    (`edit`: called with the config first, a run's changes to it)."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise WeightsFileError(f"{path} has no config.json: from_pretrained builds the model from it")
    from transformers import AutoConfig
    from ..planner.from_config import check_attention_shape
    from ..planner.quantized import refuse_quantized_weights
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - transformers' own message, with the file named
        raise WeightsFileError(f"cannot read {config_path}: {str(e).splitlines()[0][:300]}") from e
    check_attention_shape(config)
    refuse_quantized_weights(config, path)
    config.use_cache = False
    if edit is not None:
        edit(config)
    with parameters_on_meta():
        model = auto_class(config).from_config(config, dtype=torch.float32)
        # no_init_weights also skips the tying that init_weights does (tie_word_embeddings)
        model.tie_weights()
    return model


def auto_class(config):
    """The transformers class a folder's model is built as: a vision-language model (a config with
    a vision_config, as LLaVA's) as an image-text-to-text model, any other as a causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    return AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM


def shard_map(path: str) -> dict[str, list[str] | None]:
    """file -> the tensor names the index places in it (None: the file's own header says)."""
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise WeightsFileError(f"cannot read {index}: {e}") from e
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(os.path.join(path, file), []).append(name)
        return files
    single = os.path.join(path, SINGLE)
    if os.path.isfile(single):
        return {single: None}
    raise WeightsFileError(f"{path} has neither {SINGLE} nor {INDEX}: no safetensors weights to load "
                           "(.bin checkpoints are not read; convert them to safetensors)")


def stored_keys(path: str, model: nn.Module, names: set[str]) -> dict[str, str]:
    """Each of the model's tensors `names` (its own state_dict names) -> the key the folder's files
    store it under: the name itself, or an older layout's key transformers renames to it (a
    vision-language checkpoint's `model.embed_tokens.weight` for `model.language_model.embed_tokens.weight`).
    A name no file holds is left out."""
    inner = inner_model(model)
    layout = DiskLayout(inner)
    shapes = {n: tuple(t.shape) for n, t in inner.state_dict(keep_vars=True).items()}
    found = {}
    for file, listed in shard_map(path).items():
        for key in (listed if listed is not None else read_header(file)):
            name = key if key in names else (layout.place(key, shapes) or (None, None))[0]
            if name in names:
                found[name] = key
    return found


def plan_items(canonical: dict[str, str], model: nn.Module, path: str,
               shards: dict[str, list[str] | None], unused: tuple[str, ...] = (),
               on_meta: bool = False, grown=None) -> list[Item]:
    """What to stream from where, after checking every file's header against the model.
    canonical: state_dict key -> the parameter or buffer it names (TrainingState.canonical);
    unused: tensors of the files the model leaves out on purpose (a reward model's, the causal
    LM's head its own head replaces), passed over. on_meta: the model is wholly on meta, a check
    before any is built: the buffers it computes and does not save are not asked of the files.
    grown: the run's GrownVocab (io/grown_vocab.py), whose tensors may have fewer rows than the
    model's: they grow as they stream in (its route())."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    items, loaded = [], set()
    # Buffers the model computes and does not save (rotary inv_freq): older files still hold them,
    # per layer; the model's own values are used, as transformers does.
    computed = {n.rsplit(".", 1)[-1] for n in buffers if n not in canonical}
    # Per-expert tensors of fused experts, transformers' renamings: the wrapped model's (a PEFT
    # model's base), placed by the keys `canonical` names, then mapped to the module's own names.
    layout = DiskLayout(inner_model(model))
    shapes = {n: tuple(t.shape) for n, t in list(params.items()) + list(buffers.items())}
    key_shapes = {k: shapes[n] for k, n in canonical.items() if n in shapes}
    parts: dict[str, set] = {}
    stored_as: dict[str, str] = {}      # a fused tensor's module name -> its name in the files' terms
    for file, listed in shards.items():
        if not os.path.isfile(file):
            raise WeightsFileError(f"the shard {file} is missing; {INDEX} places {len(listed or [])} tensors in it "
                                   f"({', '.join((listed or [])[:3])}); nothing was loaded")
        header = read_header(file)
        for name in listed or []:
            if name not in header:
                raise WeightsFileError(f"{file} lacks {name}, which {INDEX} places in it")
        for key, entry in header.items():
            if listed is not None and key not in listed:
                continue
            name, part = canonical.get(key), None
            if name is None:
                placed, part = layout.place(key, key_shapes) or (None, None)
                name = canonical.get(placed, placed)
                if part is not None:
                    stored_as[name] = placed     # the layout's converters know the files' names alone
            if name is None and key.rsplit(".", 1)[-1] in computed:
                continue
            own = params.get(name) if name is not None else None
            own = own if own is not None else buffers.get(name) if name is not None else None
            if own is None and (key in unused or name in unused):
                continue
            if own is None:
                raise WeightsFileError(f"{file} holds {key}, which the {type(model).__name__} built from "
                                       f"{path}/config.json has no place for: the weights are of another model")
            expected = tuple(own.shape) if part is None else part_shape(tuple(own.shape), part)
            if entry.shape != expected and not (grown is not None and grown.holds(key, entry.shape, expected)):
                raise WeightsFileError(f"{file}: {key} has shape {entry.shape}, the model built from config.json "
                                       f"has {expected}" + (f" for it (a part of {name})" if part else "")
                                       + ": the weights are of another model or config")
            if entry.torch_dtype.is_floating_point != own.dtype.is_floating_point:
                raise WeightsFileError(f"{file}: {key} has dtype {entry.dtype}, the model's is {own.dtype}")
            items.append(Item(file, key, WEIGHT if name in params else CONST, name, part))
            if part is None:
                loaded.add(name)
            else:
                parts.setdefault(name, set()).add(part)
    torn = []
    for name, got in parts.items():
        whole = layout.parts_of(stored_as[name], shapes[name])
        if len(got) == whole:
            loaded.add(name)
        elif name not in loaded:
            torn.append(f"{name} ({len(got)} of its {whole} per-expert tensors)")
    if torn:
        raise WeightsFileError(f"the weights in {path} hold only some of the per-expert tensors of "
                               f"{', '.join(torn[:3])}; nothing was loaded")
    missing = [n for n, p in params.items() if n not in loaded and p.is_meta]     # a real one is the module's own
    saved = set(canonical.values())
    missing += [n for n, b in buffers.items() if b.is_meta and n not in loaded and (n in saved or not on_meta)]
    if missing:
        raise WeightsFileError(f"the weights in {path} lack {len(missing)} tensors of the model "
                               f"({', '.join(missing[:4])}); nothing was loaded")
    return items
