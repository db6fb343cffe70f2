"""What the path given to load_checkpoint is, when it is not a checkpoint folder.

A file of a checkpoint (its manifest.json, COMMITTED or a safetensors file of it), another trainer's
checkpoint folder (io/foreign_checkpoint.py), a Hugging Face model folder or its weights file, or any
other file is refused with what to pass instead, before
anything is read: the one-file format of earlier releases is a torch zip archive, and only such a
file goes to its loader (whose torch.load would otherwise answer with its own weights_only text).
The folder of a manifest is not taken in its place: the caller's path is kept to what it names.
"""
from __future__ import annotations

import os
import zipfile

from ..errors import WeightsFileError
from .durable import MARKER
from .foreign_checkpoint import describe as describe_foreign
from .hf_layout import INDEX, SINGLE
from .manifest import NAME as MANIFEST

HF_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json")


def refusal(path: str) -> WeightsFileError | None:
    """Why `path` is no checkpoint load_checkpoint can read (None: a folder, or a one-file checkpoint
    of the earlier format, which their own checks take from here)."""
    folder, name = os.path.split(os.path.abspath(path))
    start = f"cannot load the checkpoint {path}: "
    if os.path.isdir(path):
        foreign = describe_foreign(path) if not os.path.isfile(os.path.join(path, MARKER)) else None
        if foreign:
            return WeightsFileError(start + f"it is {foreign}; nothing was loaded")
        if not os.path.isfile(os.path.join(path, MANIFEST)) and any(
                os.path.isfile(os.path.join(path, f)) for f in (INDEX, SINGLE)):
            return WeightsFileError(start + "it is a Hugging Face model folder, not a checkpoint: load it with "
                                    f"megacompile.from_pretrained({path!r}, hbm_budget=...) (or its weights with "
                                    "engine.load_state_dict); nothing was loaded")
        return None
    if not os.path.isfile(path):
        return None                  # the folder checks say there is nothing there
    if os.path.isfile(os.path.join(folder, MANIFEST)) or name in (MANIFEST, MARKER):
        return WeightsFileError(start + f"it is the file {name} of a checkpoint: pass the checkpoint folder, "
                                f"load_checkpoint({folder!r}); nothing was loaded")
    if name in HF_FILES or name.endswith((".safetensors", ".safetensors.index.json")):
        return WeightsFileError(start + f"it is a weights file, not a checkpoint: load a Hugging Face model folder "
                                f"with megacompile.from_pretrained({folder!r}, hbm_budget=...), or its tensors "
                                "with engine.load_state_dict; nothing was loaded")
    if not zipfile.is_zipfile(path):
        return WeightsFileError(start + "it is a file, not a checkpoint: pass the folder that save_checkpoint "
                                "wrote (it holds manifest.json and COMMITTED); nothing was loaded")
    return None
