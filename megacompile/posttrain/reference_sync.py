"""TR-DPO's reference updates (Gorbatovski et al., 2024), as TRL's `sync_ref_model` makes them for
DPO and GRPO: every `ref_model_sync_steps` optimizer steps the reference engine's weights become
(1 - alpha) * reference + alpha * policy, parameter by parameter (buffers stay), in float32 on the
masters, one tensor at a time.

The reference then differs from the model as loaded, so a resumed run cannot rebuild it: each
update is written to the run folder (`reference/step-NNNNNN.safetensors`, whole and on the disk
before the step's checkpoint), and a resume loads the one its checkpoint's step was trained against.
"""
from __future__ import annotations

import os
import re

from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import ArgumentError
from ..io import durable, unbuilt

FOLDER = "reference"


def _parameters(engine) -> set[str]:
    """The state_dict keys of the module's parameters, trained or frozen, tied names included."""
    return {name for name, _ in engine.state.model.named_parameters(remove_duplicate=False)}


def mix(reference, policy, alpha: float) -> None:
    """reference <- (1 - alpha) * reference + alpha * policy, as TRL's sync_target_model computes it
    (`mul_(1 - alpha).add_(policy, alpha=alpha)`); a tied weight once. One tensor at a time: the
    two engines' states are read side by side (they were built from the same model), each mixed
    tensor loaded into the reference's masters before the next is made."""
    keys, seen = _parameters(reference), set()
    for (key, weight), (same, trained) in zip(unbuilt.state_tensors(reference.state),
                                              unbuilt.state_tensors(policy.state)):
        if key != same:
            raise ArgumentError(f"sync_ref_model: the reference's weight {key} meets the policy's {same}: the two "
                                "engines were not built from the same model")
        name = reference.state.canonical[key]
        if key in keys and name not in seen:
            seen.add(name)
            reference.load_state_dict({key: weight.mul(1.0 - alpha).add_(trained, alpha=alpha)}, strict=False)


def path(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, FOLDER, f"step-{step:06d}.safetensors")


def keep(reference, run_dir: str, step: int) -> None:
    """The reference's parameters after the update of `step`, written whole and on the disk; a
    failed write leaves no file and names the disk's state."""
    target = path(run_dir, step)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    keys, seen, tensors = _parameters(reference), set(), {}
    for key, weight in unbuilt.state_tensors(reference.state):
        name = reference.state.canonical[key]
        if key in keys and name not in seen:
            seen.add(name)
            tensors[key] = weight.contiguous()
    try:
        save_file(tensors, target + ".tmp", metadata={"step": str(step)})
        durable.fsync_file(target + ".tmp")
        os.replace(target + ".tmp", target)
        durable.fsync_dir(os.path.dirname(target))
    except (OSError, RuntimeError) as e:
        if os.path.exists(target + ".tmp"):
            os.remove(target + ".tmp")
        raise durable.write_failed("updated reference", target, e,
                                   needed=sum(t.numel() * t.element_size() for t in tensors.values())) from e


def load(reference, run_dir: str, step: int) -> None:
    """The reference as the update of `step` left it, read a tensor at a time."""
    source = path(run_dir, step)
    if not os.path.isfile(source):
        raise ArgumentError(f"resume: {source} is missing: it holds the reference as sync_ref_model updated it at "
                            f"step {step}, which the checkpoint's later steps were trained against; resume from a "
                            "checkpoint whose reference is kept, or start a new run_dir")
    with safe_open(source, framework="pt") as f:
        for key in f.keys():
            reference.load_state_dict({key: f.get_tensor(key)}, strict=False)


def prune(run_dir: str, newest: int, needed: set[int]) -> None:
    """Drop the kept references older than `newest` that no checkpoint in `needed` (the update
    steps the run folder's checkpoints were trained against) reads."""
    folder = os.path.join(run_dir, FOLDER)
    for entry in os.listdir(folder):
        found = re.fullmatch(r"step-(\d{6})\.safetensors", entry)
        if found and int(found.group(1)) < newest and int(found.group(1)) not in needed:
            os.remove(os.path.join(folder, entry))
