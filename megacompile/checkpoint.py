"""Checkpoints: the fp32 masters, AdamW moments and step counters, written atomically.

A checkpoint saved between the micro-batches of a step (grad_accum > 1) also holds their
gradient sum, so the resumed step adds the remaining micro-batches to it.

One file per checkpoint, holding tensors by the model's parameter names (not by megacompile's
flat per-stage buffers), so a checkpoint outlives a change of plan, budget or input shape. The
file is written under a temporary name and renamed into place: a crash mid-write leaves the
previous checkpoint intact, never a half-written one.
"""
from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

import torch

from .arguments import file_in_the_way
from .errors import CheckpointError, MegacompileError

if TYPE_CHECKING:
    from .engine import Engine

FORMAT = "megacompile-checkpoint/1"


def save(engine: "Engine", path: str) -> None:
    host = engine._host_or_error()
    engine.synchronize()
    moments = {}
    for name in host.slots:
        moments[name] = (host.view("exp_avg", name).clone(), host.view("exp_avg_sq", name).clone())
    payload = {
        "format": FORMAT,
        "masters": {name: host.master(name).clone() for name in host.slots},
        "buffers": {name: t.clone() for name, t in host.consts.items()},
        "exp_avg": {name: m for name, (m, _) in moments.items()},
        "exp_avg_sq": {name: v for name, (_, v) in moments.items()},
        "steps_done": engine.steps_done,
        "micro_batches": engine.micro_batches,
        "lr_handle": engine.torch_optimizer.state_dict()["param_groups"][0]["lr"],
        "rng": torch.get_rng_state(),
        "grad_accum": engine.grad_accum,
    }
    if engine.micro_batches % engine.grad_accum:
        # Saved mid-step: the gradients of the step's micro-batches so far resume with it.
        payload["grads"] = {name: host.view("grad", name).clone() for name in host.slots}
    write_atomically(payload, path)


def write_atomically(payload: dict, path: str) -> None:
    """torch.save under a temporary name, then a rename: on any failure (the path is a folder or
    lies under a file, no permission, disk full) a CheckpointError names the path and the cause,
    the temporary file is gone and a previous checkpoint at `path` is untouched."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise CheckpointError(f"a checkpoint path must be a file path, got {path!r}")
    path = os.fspath(path)
    if os.path.isdir(path):
        raise CheckpointError(f"cannot write the checkpoint {path}: it is a folder; give a file path inside it")
    directory = os.path.dirname(os.path.abspath(path))
    blocker = file_in_the_way(directory)
    if blocker is not None:
        raise CheckpointError(f"cannot write the checkpoint {path}: it lies under the file {blocker}")
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        os.makedirs(directory, exist_ok=True)
        torch.save(payload, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        # torch.save reports a failed write (ENOSPC, EIO) as a RuntimeError from its zip writer
        cause = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
        if isinstance(e, RuntimeError) and "write" in cause:
            cause = f"the write failed (is the disk full?): {cause}"
        previous = "the previous checkpoint there is untouched" if os.path.exists(path) else "nothing was written"
        raise CheckpointError(f"cannot write the checkpoint {path}: {cause}; {previous}") from e
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)


def load(engine: "Engine", path: str) -> None:
    """Restore a checkpoint; checks every name and shape before changing anything."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - unreadable, truncated or foreign: one clear error
        raise MegacompileError(f"cannot read the checkpoint {path}: {e}") from e
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise MegacompileError(f"{path} is not a megacompile checkpoint ({FORMAT})")
    host = engine._host_or_error()
    engine.synchronize()
    problems = []
    for table in ("masters", "exp_avg", "exp_avg_sq"):
        names = set(payload[table])
        missing, unexpected = set(host.slots) - names, names - set(host.slots)
        if missing or unexpected:
            problems.append(f"{table}: missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}")
        for name in names & set(host.slots):
            if tuple(payload[table][name].shape) != host.slots[name].shape:
                problems.append(f"{table}[{name}] has shape {tuple(payload[table][name].shape)}, "
                                f"the model has {host.slots[name].shape}")
    problems += _accumulation_problems(engine, payload, host)
    problems += host.load_problems({**payload["masters"], **payload["buffers"]})
    if problems:
        raise MegacompileError(f"the checkpoint {path} does not match this model: {'; '.join(problems[:4])}; "
                               "nothing was loaded")
    with torch.no_grad():
        host.load({**payload["masters"], **payload["buffers"]})
        for name in host.slots:
            host.view("exp_avg", name).copy_(payload["exp_avg"][name])
            host.view("exp_avg_sq", name).copy_(payload["exp_avg_sq"][name])
            if "grads" in payload:
                host.view("grad", name).copy_(payload["grads"][name])
    engine.steps_done = payload["steps_done"]
    engine.micro_batches = payload["micro_batches"]
    engine.torch_optimizer.param_groups[0]["lr"] = payload["lr_handle"]
    torch.set_rng_state(payload["rng"])
    engine._materialized = True


def _accumulation_problems(engine: "Engine", payload: dict, host) -> list[str]:
    """A checkpoint saved between the micro-batches of a step carries their gradient sum; it
    resumes only where a step has the same number of micro-batches."""
    saved_k = payload.get("grad_accum", 1)
    if payload["micro_batches"] % saved_k == 0:
        return []
    if "grads" not in payload:
        return [f"it was saved after micro-batch {payload['micro_batches'] % saved_k} of {saved_k} of a step "
                "without their gradients (an older format): resume from a checkpoint saved at a step boundary"]
    if saved_k != engine.grad_accum:
        return [f"it was saved mid-step with grad_accum={saved_k}, this engine has grad_accum={engine.grad_accum}: "
                f"compile with grad_accum={saved_k} to resume it"]
    grads = payload["grads"]
    return [f"grads[{name}] is missing" if name not in grads else
            f"grads[{name}] has shape {tuple(grads[name].shape)}, the model has {host.slots[name].shape}"
            for name in host.slots if name not in grads or tuple(grads[name].shape) != host.slots[name].shape]
