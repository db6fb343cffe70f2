"""The loader of the one-file checkpoints (megacompile-checkpoint/1) written before checkpoints
became folders (megacompile/io/checkpoint.py); kept so that those resume for one more release.

The file holds the masters, moments and (saved mid-step) gradient sums by parameter name,
counters, the learning rate and the CPU random state. On an engine with no host state yet the
tensors wait, in memory as torch.load read them, until the first step or prepare() builds it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..errors import MegacompileError

if TYPE_CHECKING:
    from ..state import TrainingState

FORMAT = "megacompile-checkpoint/1"


def load(state: "TrainingState", path: str) -> None:
    """Restore a checkpoint; checks every name and shape before changing anything."""
    from .state_dict import checker
    from ..runtime import HostState
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - unreadable, truncated or foreign: one clear error
        raise MegacompileError(f"cannot read the checkpoint {path}: {e}") from e
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise MegacompileError(f"{path} is not a megacompile checkpoint ({FORMAT})")
    state.wait_updates()
    trainable, _ = state.layout()
    problems = []
    for table in ("masters", "exp_avg", "exp_avg_sq"):
        names = set(payload[table])
        missing, unexpected = set(trainable) - names, names - set(trainable)
        if missing or unexpected:
            problems.append(f"{table}: missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}")
        for name in names & set(trainable):
            if tuple(payload[table][name].shape) != trainable[name]:
                problems.append(f"{table}[{name}] has shape {tuple(payload[table][name].shape)}, "
                                f"the model has {trainable[name]}")
    problems += _accumulation_problems(state, payload, trainable)
    weights = {**payload["masters"], **payload["buffers"]}
    own = state.host if state.host is not None else checker(state, trainable)
    problems += HostState.load_problems(own, weights)
    if problems:
        raise MegacompileError(f"the checkpoint {path} does not match this model: {'; '.join(problems[:4])}; "
                               "nothing was loaded")
    # Written into the host state now, or when the first step builds it. The format kept no
    # per-parameter counts (each is steps_done), no skipped steps and no run id (the engine's stays).
    state.restore(_Payload(payload), {"steps_done": payload["steps_done"], "micro_batches": payload["micro_batches"],
                                      "missed_steps": {}}, param_group={"lr": payload["lr_handle"]})
    torch.set_rng_state(payload["rng"])


class _Payload:
    """A checked payload, written into host state now or when it is built."""

    def __init__(self, payload: dict):
        self.payload = payload

    def apply(self, host, model=None) -> None:
        payload = self.payload
        with torch.no_grad():
            host.load({**payload["masters"], **payload["buffers"]})
            for name in host.slots:
                host.view("exp_avg", name).copy_(payload["exp_avg"][name])
                host.view("exp_avg_sq", name).copy_(payload["exp_avg_sq"][name])
                if "grads" in payload:
                    host.view("grad", name).copy_(payload["grads"][name])
            if "grads" in payload:     # the format kept no per-parameter reach: the sums are whole
                host.resume_mid_step(set(host.slots))


def _accumulation_problems(state: "TrainingState", payload: dict, trainable: dict) -> list[str]:
    """A checkpoint saved between the micro-batches of a step carries their gradient sum; it
    resumes only where a step has the same number of micro-batches."""
    saved_k = payload.get("grad_accum", 1)
    if payload["micro_batches"] % saved_k == 0:
        return []
    if "grads" not in payload:
        return [f"it was saved after micro-batch {payload['micro_batches'] % saved_k} of {saved_k} of a step "
                "without their gradients (an older format): resume from a checkpoint saved at a step boundary"]
    if saved_k != state.grad_accum:
        return [f"it was saved mid-step with grad_accum={saved_k}, this engine has grad_accum={state.grad_accum}: "
                f"compile with grad_accum={saved_k} to resume it"]
    grads = payload["grads"]
    return [f"grads[{name}] is missing" if name not in grads else
            f"grads[{name}] has shape {tuple(grads[name].shape)}, the model has {trainable[name]}"
            for name in trainable if name not in grads or tuple(grads[name].shape) != trainable[name]]
