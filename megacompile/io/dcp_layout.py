"""An FSDP checkpoint's shards read back as whole tensors: each parameter's master and AdamW
moments, by its fully qualified name.

    checkpoint-N/
        pytorch_model_fsdp_0/     torch.distributed.checkpoint of {"model": the model's state_dict}
        optimizer_0/              ... of {"optimizer": the optimizer's state_dict keyed by name}
                                  (get_optimizer_state_dict, FSDP.optim_state_dict)
      or
        pytorch_model_fsdp.bin    torch.save of the same state_dicts, gathered whole (Whole)
        optimizer.bin

That is what Accelerate's FSDP writes with SHARDED_STATE_DICT (FULL_STATE_DICT for the .bin
files), FSDP1 and FSDP2 alike, so a Trainer's (LlamaFactory's, TRL's). Every rank wrote its shard of each tensor (__R_0.distcp) and
.metadata says where each piece lies; torch.distributed.checkpoint reads a named tensor back
whole in one process, from its pieces, without a process group. The sharded parameters FSDP's
AdamW stepped are the masters (fp32 under FSDP's mixed precision: it computes in bf16 copies).
A parameter with no optimizer state was frozen (a LoRA run's base).
"""
from __future__ import annotations

import os
import warnings

import torch

from ..errors import WeightsFileError
from . import pages
from .saved_dict import torch_dict

MODEL, OPTIMIZER = "pytorch_model_fsdp_0", "optimizer_0"
WHOLE_MODEL, WHOLE_OPTIMIZER = "pytorch_model_fsdp.bin", "optimizer.bin"
_MOMENTS = ("exp_avg", "exp_avg_sq")


def holds(path: str) -> bool:
    """Whether `path` holds an FSDP checkpoint in the sharded layout (module docstring)."""
    return all(os.path.isfile(os.path.join(path, folder, ".metadata")) for folder in (MODEL, OPTIMIZER))


def holds_whole(path: str) -> bool:
    """Whether `path` holds one in the gathered layout (FULL_STATE_DICT: the .bin files)."""
    return all(os.path.isfile(os.path.join(path, f)) for f in (WHOLE_MODEL, WHOLE_OPTIMIZER))


def _reader(folder: str):
    """torch's reader of the folder, its .metadata unpickled once: torch's loader reads it again on
    every call, which is most of the cost of reading one tensor (some 77 ms of 93 for a 543-parameter
    model's optimizer folder, so an import of a few hundred parameters took minutes)."""
    from torch.distributed.checkpoint import FileSystemReader

    class Reader(FileSystemReader):
        _read_once = None

        def read_metadata(self, *args, **kwargs):
            if self._read_once is None:
                self._read_once = super().read_metadata(*args, **kwargs)
            return self._read_once
    return Reader(folder)


def _metadata(reader) -> dict:
    try:
        return reader.read_metadata().state_dict_metadata
    except Exception as e:  # noqa: BLE001 - any unreadable folder: name it
        raise WeightsFileError(f"cannot read {reader.path} as a torch.distributed.checkpoint: {e}") from e


def _read(reader, keys: set[str]) -> dict:
    """The entries `keys` of a torch.distributed.checkpoint folder (its _reader), each read whole, in
    this process."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
    folder = reader.path
    try:
        with warnings.catch_warnings():       # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            return _load_state_dict_from_keys(keys, storage_reader=reader)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - a shard missing or unreadable: name it
        # (CheckpointException, what a missing shard raises, is a BaseException)
        why = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__   # not every rank's traceback
        raise WeightsFileError(f"cannot read {sorted(keys)[0]} from {folder}: {why}; nothing was loaded") from e


class _ByName:
    """What both layouts share once their names are known: which parameters trained (those with
    AdamW state) and which froze, their param groups and steps (sharded_checkpoint.py's source)."""

    def _named(self, weights: dict[str, tuple], tables: dict[str, set[str]], where: str) -> None:
        if not weights or not tables:
            raise WeightsFileError(f"{self.path}: {where} hold no model state_dict and no optimizer state keyed by "
                                   "parameter name (as Accelerate's FSDP saves them); nothing was loaded")
        odd = sorted(n for n, t in tables.items() if not set(_MOMENTS) <= t or n not in weights)
        if odd:
            raise WeightsFileError(f"{self.describe}: the optimizer state of {odd[0]} is not AdamW's (exp_avg and "
                                   "exp_avg_sq), or names no weight of its model state_dict; nothing was loaded")
        self.shapes = {n: weights[n] for n in tables}
        self.frozen = {n: shape for n, shape in weights.items() if n not in tables}

    def _grouped(self, optimizer: dict) -> None:
        self.param_groups = optimizer["param_groups"]
        self._steps = {n: int(entry["step"]) for n, entry in optimizer.get("state", {}).items() if "step" in entry}
        self.first_group = self.param_groups[0]
        self.global_steps = max(self._steps.values(), default=0)
        if any(g.get("amsgrad") for g in self.param_groups):
            raise WeightsFileError(f"{self.describe} was written by AdamW with amsgrad=True, which megacompile's AdamW "
                                   "does not run; nothing was loaded")

    def step(self, name: str) -> int | None:
        return self._steps.get(name)

    def weight_decay(self, name: str) -> float:
        return self._group(name)["weight_decay"]

    def lr(self, name: str) -> float | None:
        return self._group(name).get("lr")

    def _group(self, name: str) -> dict:
        group = next((g for g in self.param_groups if name in g.get("params", ())), None)
        if group is None:
            raise WeightsFileError(f"{self.describe}: no param group of its optimizer names {name}; nothing was loaded")
        return group


class Shards(_ByName):
    """The two folders of a sharded save, read as whole tensors per parameter (tensor())."""

    def __init__(self, path: str):
        self.path = path
        self.describe = f"the FSDP checkpoint {path}"
        self.model_reader, self.optimizer_reader = (_reader(os.path.join(path, f)) for f in (MODEL, OPTIMIZER))
        weights = {k.removeprefix("model."): tuple(m.size) for k, m in _metadata(self.model_reader).items()
                   if k.startswith("model.") and hasattr(m, "size")}
        tables: dict[str, set[str]] = {}
        for key in _metadata(self.optimizer_reader):
            if key.startswith("optimizer.state."):
                name, _, table = key.removeprefix("optimizer.state.").rpartition(".")
                tables.setdefault(name, set()).add(table)
        self._named(weights, tables, f"{MODEL}/ and {OPTIMIZER}/")
        self._grouped(_read(self.optimizer_reader, {"optimizer.param_groups"} |
                            {f"optimizer.state.{n}.step" for n, t in tables.items() if "step" in t})["optimizer"])

    def tensor(self, table: str, name: str) -> torch.Tensor:
        """The whole fp32 `table` of the parameter `name`, read from every rank's shard."""
        if table == "master":
            return _read(self.model_reader, {f"model.{name}"})["model"][name].float()
        return _read(self.optimizer_reader, {f"optimizer.state.{name}.{table}"})["optimizer"]["state"][name][table].float()


class Whole(_ByName):
    """The two files of a gathered save (FULL_STATE_DICT), memory-mapped, a tensor copied out at a
    time and its pages given back (pages.py)."""

    def __init__(self, path: str):
        self.path = path
        self.describe = f"the FSDP checkpoint {path}"
        self.model = torch_dict(os.path.join(path, WHOLE_MODEL))
        optimizer = torch_dict(os.path.join(path, WHOLE_OPTIMIZER))
        if not isinstance(optimizer.get("state"), dict) or not isinstance(optimizer.get("param_groups"), list):
            raise WeightsFileError(f"{path}/{WHOLE_OPTIMIZER} is not an optimizer state_dict keyed by parameter name; "
                                   "nothing was loaded")
        self.state = optimizer["state"]
        weights = {n: tuple(t.shape) for n, t in self.model.items() if isinstance(t, torch.Tensor)}
        self._named(weights, {n: set(entry) for n, entry in self.state.items()}, f"{WHOLE_MODEL} and {WHOLE_OPTIMIZER}")
        self._grouped(optimizer)

    def tensor(self, table: str, name: str) -> torch.Tensor:
        """The fp32 `table` of the parameter `name`: a copy of the process's own."""
        source = self.model[name] if table == "master" else self.state[name][table]
        out = source.float().clone()
        pages.drop(source)
        return out
