"""A dict another program saved, read back for an import: a JSON object (trainer_state.json, a
config.json), or a torch.save'd one read with torch's weights_only loader through a memory map
(tensors, numbers and containers; nothing in the pickle runs, and a tensor's pages are read only
when it is copied out). A file that cannot be read, or holds something else, is named."""
from __future__ import annotations

import json

import torch

from ..errors import WeightsFileError


def json_object(path: str, what: str = "a JSON object") -> dict:
    """The JSON object in `path`; `what`: what it should be, for the refusal."""
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, ValueError) as e:
        raise WeightsFileError(f"cannot read {path}: {e}; nothing was loaded") from e
    if not isinstance(value, dict):
        raise WeightsFileError(f"{path} holds {type(value).__name__}, not {what}; nothing was loaded")
    return value


def torch_dict(path: str, what: str = "a state_dict") -> dict:
    """The dict torch.save wrote to `path`, memory-mapped; `what`: what it should be, for the refusal."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file: name it
        raise WeightsFileError(f"cannot read {path}: {e}; nothing was loaded") from e
    if not isinstance(saved, dict):
        raise WeightsFileError(f"{path} holds {type(saved).__name__}, not {what}; nothing was loaded")
    return saved
