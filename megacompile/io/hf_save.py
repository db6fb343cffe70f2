"""engine.save_pretrained: the masters as a Hugging Face model folder, one tensor at a time.

Tensors go under the model's state_dict names, a tied weight once (under its first name, as
transformers writes it), fused experts one view per expert under the names transformers' own
save_pretrained gives them (io/hf_layout.py), in shards of at most `max_shard_size` bytes (a
tensor larger than that gets a shard of its own), each written in the safetensors layout (io/header.py) by this module:
a tensor is cast to `dtype` into a buffer of its own size, written and dropped (an fp32 export
writes the masters' own memory), so the export adds one tensor to the host's memory, never a
shard. config.json says `dtype`; the tokenizer and generation files of the folder the engine was
loaded from are copied.

What is the user's is never lost: an export writes its own files only (those above), and replaces
only those. A new folder is written as `.<name>.<pid>.partial` beside it and renamed into place.
In a folder that exists, whatever else it holds (README.md, LICENSE, .gitattributes, .git/, the
user's files) is never touched, overwrite or not, and the export goes beside it, as transformers'
save_pretrained writes into a clone of a Hub repository. If the folder holds files the export
would replace (its weights, index, config, tokenizer or generation files), or weights of a
previous export that it would remove (model.safetensors or model-*-of-*.safetensors and an index
the new export does not have: stale, they would shadow or contradict it), it is refused before
anything is written, naming them, unless overwrite=True. The new files are staged in the folder
and swapped in once all are written (durable.replace_files): a failure or a kill while writing
leaves the previous export whole; a kill during the swap (a few renames) is finished by the next
save_pretrained into the folder.
"""
from __future__ import annotations

import copy
import json
import os
import re
import shutil
import struct
from typing import TYPE_CHECKING

import torch

from ..errors import ArgumentError, CheckpointError, MegacompileError
from . import durable, model_params, unbuilt
from .header import CODES
from .hf_layout import INDEX, SINGLE, DiskLayout

if TYPE_CHECKING:
    from ..state import TrainingState

# a PEFT adapter export (io/lora_save.py)
ADAPTER = ("adapter_config.json", "adapter_model.safetensors")
COPIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
          "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")
# beside an adapter: the base model's generation config is not the adapter's
TOKENIZER_FILES = tuple(f for f in COPIED if f != "generation_config.json")
_SHARD = re.compile(r"model-\d+-of-\d+\.safetensors")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def shard_bytes(size: int | str) -> int:
    """"5GB" (10**9 bytes, as transformers counts), "500MiB" (2**20) or a number of bytes."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(size).upper()) if isinstance(size, str) else None
    if m is None or m[2] not in _UNITS or float(m[1]) <= 0:
        raise ArgumentError(f"max_shard_size is a number of bytes or a size such as '5GB' or '500MiB'; got {size!r}")
    return int(float(m[1]) * _UNITS[m[2]])


def is_weights(name: str) -> bool:
    """A weights file of a safetensors export: model.safetensors, a model-NNNNN-of-NNNNN shard, the index."""
    return name in (SINGLE, INDEX) or _SHARD.fullmatch(name) is not None


def export_files(path: str) -> list[str]:
    """The files of a model export in the folder `path` (weights, index, config.json, tokenizer and
    generation files): those an export into it might replace."""
    if not os.path.isdir(path):
        return []
    return sorted(f for f in os.listdir(path) if is_weights(f) or f in ("config.json",) + COPIED + ADAPTER)


def save_pretrained(state: "TrainingState", path: str, dtype: torch.dtype = torch.float32,
                    max_shard_size: int | str = "5GB", overwrite: bool = False) -> None:
    check_export_arguments(dtype, overwrite)
    limit = shard_bytes(max_shard_size)
    config = getattr(state.model, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        raise MegacompileError("save_pretrained writes a Hugging Face model folder and needs a transformers model "
                               f"(one with a .config); {type(state.model).__name__} has none: use save_checkpoint")
    unbuilt.refuse_missing_weights(state)
    host = state.host       # None before the first step: the tensors come from where they wait
    path = os.fspath(path)
    durable.prepare_parent(path, "model folder")       # refused before the weights are gathered
    model_params.synchronize(state)
    tensors = []   # (name on disk, host tensor or unbuilt.Lazy)
    layout = DiskLayout(state.model)
    if host is not None:
        masters, consts = {n: host.master(n) for n in host.slots}, host.consts
    else:
        trainable, consts = unbuilt.tables(state)
        masters = trainable["master"]
    for key, name in state.canonical.items():
        if key != name:
            continue   # a tied alias: transformers restores it from the first name
        source = masters.get(name, consts.get(name))
        if source is not None:
            tensors += _pieces(layout, key, source)      # per-expert views of a fused weight, as transformers saves
    shards = _shards(tensors, dtype, limit)
    names = [SINGLE] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                              for i in range(len(shards))]
    copied = source_files(state)
    new = set(names + copied + ["config.json"] + [INDEX] * (len(shards) > 1)
              + ["generation_config.json"] * (getattr(state.model, "generation_config", None) is not None))

    def write(folder: str) -> None:
        weight_map = {}
        for file, shard in zip(names, shards):
            _write_shard(os.path.join(folder, file), shard, dtype)
            weight_map.update({key: file for key, _ in shard})
        if len(shards) > 1:
            total = sum(t.numel() * dtype.itemsize for shard in shards for _, t in shard)
            durable.write_text(os.path.join(folder, INDEX), json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        _write_config(state, config, dtype, folder)
        copy_source_files(state, folder, copied)
        durable.fsync_dir(folder)

    write_export(path, new, overwrite, write)


def check_export_arguments(dtype: torch.dtype, overwrite: bool) -> None:
    if not isinstance(dtype, torch.dtype) or dtype not in CODES or not dtype.is_floating_point:
        raise ArgumentError(f"dtype must be a floating torch dtype (torch.float32, torch.bfloat16, torch.float16); "
                            f"got {dtype!r}")
    if not isinstance(overwrite, bool):
        raise ArgumentError(f"overwrite is True or False (replace the files of an export already in the folder); "
                            f"got {overwrite!r}")


def source_use_cache(source_dir: str | None) -> bool:
    """use_cache as the config.json of the folder the model came from says (True without one): the
    engine turns the KV cache off for training only."""
    source = os.path.join(source_dir or "", "config.json")
    if source_dir and os.path.isfile(source):
        with open(source) as f:
            return json.load(f).get("use_cache", True)
    return True


def write_export(path: str, new: set[str], overwrite: bool, write) -> None:
    """The one writer of a model folder: `write(folder)` makes the export's files, `new` their
    names, which replace a previous export's (refused unless `overwrite`, refuse_replacing). A new
    folder is written beside `path` and renamed into place; into one that exists (an export into
    it killed mid-swap finished first) they are staged and swapped in, nothing else of it touched."""
    parent = durable.prepare_parent(path, "model folder")
    durable.clean_leftovers(parent)
    exists = os.path.isdir(path)
    if exists:
        durable.recover_files(path)
    write_files(path, parent, exists, write, refuse_replacing(path, new, overwrite))


def source_files(state: "TrainingState", names: tuple[str, ...] = COPIED) -> list[str]:
    """Of `names`, the tokenizer and generation files the folder the model came from (from_pretrained's)
    holds: an export carries them, so the folder loads with its tokenizer."""
    return [f for f in names if state.source_dir and os.path.isfile(os.path.join(state.source_dir, f))]


def copy_source_files(state: "TrainingState", folder: str, names: list[str]) -> None:
    """Copy `names` (source_files') from the source folder into `folder`, each synced; a file the
    export wrote itself is kept."""
    for name in names:
        if not os.path.exists(os.path.join(folder, name)):
            shutil.copyfile(os.path.join(state.source_dir, name), os.path.join(folder, name))
            durable.fsync_file(os.path.join(folder, name))


def finish_export(folder: str, tokenizer) -> None:
    """The tokenizer's files written beside an export transformers or PEFT wrote into `folder`,
    and every file of it, and the folder, synced to disk."""
    tokenizer.save_pretrained(folder)
    for name in os.listdir(folder):
        durable.fsync_file(os.path.join(folder, name))
    durable.fsync_dir(folder)


def refuse_replacing(path: str, new: set[str], overwrite: bool) -> list[str]:
    """The export files in `path` that an export bringing `new` replaces or removes (any weights
    of another export go too); refused, naming them, unless overwrite."""
    replaced = [f for f in export_files(path) if f in new or is_weights(f)]
    if replaced and not overwrite:
        raise CheckpointError(
            f"cannot write the model folder {path}: it holds a model export whose files would be replaced or "
            f"removed ({_listed(replaced)}); pass overwrite=True to replace them (the folder's other files are "
            "kept either way), or give another path")
    return replaced


def write_files(path: str, parent: str, exists: bool, write, replaced: list[str]) -> None:
    """write(folder) makes an export's files: in a new folder written beside `path` and renamed into
    place, or, in a folder that exists, staged in it and swapped in for `replaced`, nothing else
    of it touched."""
    tmp = durable.partial_path(path)
    try:
        if exists:      # beside what else the folder holds: staged in it, then swapped in
            durable.replace_files(path, write, replaced)
        else:
            os.makedirs(tmp)
            write(tmp)
            os.rename(tmp, path)
            durable.fsync_dir(parent)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception) and not isinstance(e, MegacompileError):
            raise durable.write_failed("model folder", path, e) from e
        raise


def _listed(names: list[str], most: int = 6) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _pieces(layout: DiskLayout, key: str, source) -> list[tuple[str, object]]:
    """layout.on_disk for a host tensor, or for a Lazy one: each piece made when written, the whole
    tensor read once for all its pieces (they are written one after another)."""
    if not isinstance(source, unbuilt.Lazy):
        return layout.on_disk(key, source)
    shapes = layout.on_disk(key, torch.empty(source.shape, device="meta"))
    if [k for k, _ in shapes] == [key]:
        return [(key, source)]
    held: list = []

    def piece(i: int) -> torch.Tensor:
        if not held:
            held.append(layout.on_disk(key, source()))
        out = held[0][i][1]
        if i == len(shapes) - 1:
            held.clear()
        return out
    return [(k, unbuilt.Lazy(m.shape, source.dtype, lambda i=i: piece(i))) for i, (k, m) in enumerate(shapes)]


def _shards(tensors: list, dtype: torch.dtype, limit: int) -> list[list]:
    shards, current, size = [], [], 0
    for key, t in tensors:
        n = t.numel() * dtype.itemsize
        if current and size + n > limit:
            shards.append(current)
            current, size = [], 0
        current.append((key, t))
        size += n
    return shards + [current] if current else shards


def write_safetensors(target: str, tensors, dtype: torch.dtype) -> None:
    """One safetensors file of (name, tensor) pairs, each cast to `dtype` alone as it is written."""
    _write_shard(target, list(tensors), dtype)


def _write_shard(target: str, shard: list, dtype: torch.dtype) -> None:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for key, t in shard:
        n = t.numel() * dtype.itemsize
        header[key] = {"dtype": CODES[dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)            # the data starts 8-byte aligned, as safetensors writes it
    with open(target, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, t in shard:
            t = t() if isinstance(t, unbuilt.Lazy) else t
            out = t if t.dtype == dtype else t.to(dtype)       # one tensor's cast copy at most
            f.write(memoryview(out.contiguous().view(-1).view(torch.uint8).numpy()))
            del out
        f.flush()
        os.fsync(f.fileno())


def _write_config(state: "TrainingState", config, dtype: torch.dtype, folder: str) -> None:
    config = copy.deepcopy(config)
    config.use_cache = source_use_cache(state.source_dir)
    config.dtype = dtype
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config     # the weights written are full precision, whatever the config said
    config.to_json_file(os.path.join(folder, "config.json"))
    durable.fsync_file(os.path.join(folder, "config.json"))
    generation = getattr(state.model, "generation_config", None)
    if generation is not None and not (state.source_dir and os.path.isfile(
            os.path.join(state.source_dir, "generation_config.json"))):
        generation.to_json_file(os.path.join(folder, "generation_config.json"))
        durable.fsync_file(os.path.join(folder, "generation_config.json"))
