"""What a user hands megacompile, checked where it comes in: compile()'s and plan()'s arguments
and step()'s inputs. Each check names the argument, what it got and what it takes, before
anything is built or written; nothing here reads more than a tensor's min and max.
"""
from __future__ import annotations

import math
import numbers
import os
import shutil
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from .errors import ArgumentError, InputMismatchError, MegacompileError

GiB = 2 ** 30
# Tokens in one step: int32 indexing in kernels, and no step of this size fits any device.
MAX_TOKENS = 2 ** 31 - 1


BUDGETS = {"hbm_budget": "the device memory the plan may use", "host_budget": "the host RAM the plan may use",
           "nvme_budget": "the disk space the disk tier may take in nvme_dir"}
# The largest budget taken, in GiB: 1 PiB, more than any device, host or disk tier of one machine
# holds (a figure above it is a slip, e.g. bytes given as GiB).
MAX_BUDGET_GIB = 2 ** 20
_HOLDER = {"hbm_budget": "device", "host_budget": "machine's RAM", "nvme_budget": "machine's disks"}


def budget_bytes(name: str, gib: Any, *, optional: bool = False) -> int | None:
    """A memory budget given in GiB (2**30 bytes), as bytes: positive, finite, not a bool."""
    if gib is None and optional:
        return None
    if isinstance(gib, bool) or not isinstance(gib, numbers.Real) or not math.isfinite(gib) or gib <= 0:
        raise ArgumentError(f"{name} is {BUDGETS.get(name, 'a memory budget')}, in GiB (2**30 bytes), and must be "
                            f"a positive number, finite and not a bool{' (or None)' if optional else ''}; got {gib!r}")
    if gib > MAX_BUDGET_GIB:
        raise ArgumentError(f"{name} of {gib:g} GiB is more than any {_HOLDER.get(name, 'machine')} holds: budgets "
                            f"are at most {MAX_BUDGET_GIB:,} GiB (1 PiB). Give {BUDGETS.get(name, 'the budget')} in "
                            f"GiB (2**30 bytes), e.g. 80 for an 80 GB device")
    return int(gib * GiB)


def disk_folder(name: str, path: Any) -> str | None:
    """folder(), for a disk tier: the nearest folder that exists must be writable and on a disk,
    not on a filesystem with no space at all such as /proc or /sys."""
    path = folder(name, path)
    if path is None:
        return None
    existing = os.path.abspath(path)
    while not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    if shutil.disk_usage(existing).total == 0:
        raise ArgumentError(f"{name} {path} is not on a disk: {existing} is on a filesystem of 0 bytes (such as "
                            "/proc or /sys), where the disk tier cannot write; give a folder on an NVMe or other disk")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ArgumentError(f"{name} {path} is not writable: {existing} does not let this user create files; give "
                            "a folder on a disk this user may write to")
    return path


def count(name: str, value: Any, *, minimum: int = 1, maximum: int | None = None, what: str = "") -> int:
    """An int (not a bool) in [minimum, maximum]."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum
            or (maximum is not None and value > maximum)):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ArgumentError(f"{name}{what} must be an int {bound}; got {value!r}")
    return int(value)


def number(name: str, value: Any, *, minimum: float = 0.0, strict: bool = False) -> float:
    """A finite real (not a bool, not a string) >= minimum (> with `strict`)."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
            or value < minimum or (strict and value == minimum)):
        raise ArgumentError(f"{name} must be a finite number {'>' if strict else '>='} {minimum:g}; got {value!r}")
    return float(value)


def flag(name: str, value: Any, *, optional: bool = False) -> bool | None:
    if value is None and optional:
        return None
    if not isinstance(value, bool):
        raise ArgumentError(f"{name} must be True or False{' (or None)' if optional else ''}; got {value!r}")
    return value


def device(value: Any) -> torch.device | None:
    """'cpu' (the simulated device), 'cuda' or 'cuda:N', or a torch.device of those."""
    if value is None:
        return None
    message = f"device must be 'cuda', 'cuda:N' or 'cpu' (the simulated device), or None for the default; got {value!r}"
    if not isinstance(value, (str, torch.device)):
        raise ArgumentError(message)
    try:
        parsed = torch.device(value)
    except RuntimeError as e:
        raise ArgumentError(message) from e
    if parsed.type not in ("cpu", "cuda"):
        raise ArgumentError(message)
    return parsed


def callable_or_none(name: str, value: Any) -> None:
    if value is not None and not callable(value):
        raise ArgumentError(f"{name} must be a function (or None); got {type(value).__name__} {value!r}")


def folder(name: str, path: Any, *, optional: bool = True) -> str | None:
    """A folder megacompile may create and write into: not an existing file, not under one."""
    if path is None and optional:
        return None
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ArgumentError(f"{name} must be a folder path; got {path!r}")
    path = os.fspath(path)
    blocker = file_in_the_way(path)
    if blocker is not None:
        where = "is a file" if blocker == path else f"lies under the file {blocker}"
        raise ArgumentError(f"{name} {path} {where}; give a folder path")
    return path


def file_in_the_way(folder: str) -> str | None:
    """The existing file that keeps `folder` from being created (itself or an ancestor), if any."""
    parent = os.path.abspath(folder)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    return None if os.path.isdir(parent) else (folder if parent == os.path.abspath(folder) else parent)


def tokens(batch: Any, seq: Any) -> tuple[int, int]:
    """plan()'s batch and seq: positive ints whose product a step can index."""
    batch = count("batch", batch, what=" (sequences per step)")
    seq = count("seq", seq, what=" (tokens per sequence)")
    if batch * seq > MAX_TOKENS:
        raise ArgumentError(f"batch x seq = {batch} x {seq} = {batch * seq:,} tokens in one step is more than "
                            f"{MAX_TOKENS:,} (int32 indexing); lower batch or seq")
    return batch, seq


# -- step() inputs -------------------------------------------------------------------------
IDS = ("input_ids", "idx", "ids", "tokens")
LABELS = ("labels", "targets")
IGNORED_LABELS = (-100, -1)   # torch's and Hugging Face's ignore_index, and nanoGPT's


class InputLimits:
    """What the model's embeddings accept, read once from the module: the vocabulary of its token
    embedding and, with learned positions, the longest sequence."""

    def __init__(self, model: nn.Module):
        try:
            embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        except NotImplementedError:
            embed = None
        named = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
        if not isinstance(embed, nn.Embedding):
            # the token table is the largest one (a segment or type embedding is far smaller)
            embed = max((m for n, m in named if not _positional(n)), key=lambda m: m.num_embeddings, default=None)
        self.vocab = embed.num_embeddings if isinstance(embed, nn.Embedding) else None
        # Only the token path's tables limit the ids: those beside the token embedding (GPT-2's
        # wpe beside wte). A vision tower's patch-position table elsewhere in the model (LLaVA's
        # CLIP) counts image patches, not tokens.
        home = _parent_path(next((n for n, m in named if m is embed), ""))
        positions = [m.num_embeddings for n, m in named if _positional(n) and m is not embed
                     and (not home or n.startswith(home + "."))]
        self.max_seq = min(positions) if positions else None
        self.causal_lm = _causal_lm(model)

    def check(self, args: tuple, kwargs: dict, device_type: str, train: bool = True) -> None:
        if train and torch.is_inference_mode_enabled():
            raise MegacompileError("step() trains, and was called under torch.inference_mode(), where no tensor "
                                   "it makes may be updated later; leave inference mode, or call engine(...) "
                                   "for the forward only")
        leaves = pytree.tree_leaves((args, kwargs))
        for x in leaves:
            if isinstance(x, torch.Tensor) and x.device.type not in ("cpu", device_type):
                raise InputMismatchError(f"an input tensor {tuple(x.shape)} is on {x.device}; pass inputs on the "
                                         f"host (cpu) or on the engine's device ({device_type})")
            if isinstance(x, torch.Tensor) and x.numel() == 0:
                raise InputMismatchError(f"an input tensor has shape {tuple(x.shape)}, with no elements: an empty "
                                         "batch has no loss to train on")
        if self.causal_lm:
            _check_causal_lm_labels(kwargs)
        if self.vocab is None:
            return
        # By name; positionally, only integer tensors (a float first input or a mask is not token ids).
        positional = [a for a in args if isinstance(a, torch.Tensor) and not a.is_floating_point()
                      and a.dtype != torch.bool]
        ids = [(k, kwargs[k]) for k in IDS if isinstance(kwargs.get(k), torch.Tensor)]
        labels = [(k, kwargs[k]) for k in LABELS if isinstance(kwargs.get(k), torch.Tensor)]
        if positional:
            ids.append(("the first input", positional[0]))
        if len(positional) > 1:
            labels.append(("the second input", positional[1]))
        for name, t in ids:
            self._check_ids(name, t, allowed=())
            if self.max_seq is not None and t.dim() >= 2 and t.shape[1] > self.max_seq:
                raise InputMismatchError(f"{name} has {t.shape[1]} tokens per sequence, more than the model's "
                                         f"{self.max_seq} learned positions; cut the sequences to {self.max_seq}")
        for name, t in labels:
            self._check_ids(name, t, allowed=IGNORED_LABELS)

    def _check_ids(self, name: str, t: torch.Tensor, allowed: tuple[int, ...]) -> None:
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise InputMismatchError(f"{name} must hold integer token ids, got {str(t.dtype).replace('torch.', '')}")
        low, high = (int(v) for v in torch.aminmax(t))
        bad = high if high >= self.vocab else None
        if bad is None and low < 0:
            negative = t[t < 0]
            for ignored in allowed:
                negative = negative[negative != ignored]
            bad = int(negative[0]) if negative.numel() else None
        if bad is not None:
            ignored = f" (or {' or '.join(map(str, allowed))}, ignored)" if allowed else ""
            raise InputMismatchError(f"{name} holds token id {bad}, outside the model's vocabulary of {self.vocab}; "
                                     f"ids must lie in [0, {self.vocab}){ignored}")


def _causal_lm(model: nn.Module) -> bool:
    """A transformers causal LM (or PEFT's wrapper of one): its loss shifts `labels` against the
    logits of `input_ids`, so the two have one shape, and takes them as int64 class indices."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    return type(base).__name__.endswith("ForCausalLM") and type(base).__module__.startswith("transformers")


def _check_causal_lm_labels(kwargs: dict) -> None:
    """labels a causal LM's loss would fail on, refused before capture (where the failure would
    read as a trace's): another shape than input_ids', or integers other than int64. int32
    input_ids are taken, as the embedding takes them in eager transformers; floats and bools are
    _check_ids' to refuse."""
    ids, labels = kwargs.get("input_ids"), kwargs.get("labels")
    if not isinstance(labels, torch.Tensor):
        return
    if isinstance(ids, torch.Tensor) and labels.shape != ids.shape:
        raise InputMismatchError(f"labels has shape {tuple(labels.shape)} and input_ids {tuple(ids.shape)}: a causal "
                                 "LM's labels are one per input token (the model shifts them itself); pass labels "
                                 "of input_ids' shape, -100 where a token is not trained on")
    if labels.dtype not in (torch.int64, torch.bool) and not (labels.is_floating_point() or labels.is_complex()):
        raise InputMismatchError(f"labels must be int64 token ids (the loss's cross_entropy takes no other integers), "
                                 f"got {str(labels.dtype).replace('torch.', '')}; pass labels.long()")


def _parent_path(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _positional(name: str) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return leaf in ("wpe", "pos_emb") or "position" in leaf or "positions" in leaf
