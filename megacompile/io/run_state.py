"""What a checkpoint holds besides tensors, as JSON: counters, the optimizer's settings, the
learning-rate schedule's state, random states, and the user's own `extra` state."""
from __future__ import annotations

import base64
import gc
import json
import math
import warnings
from typing import TYPE_CHECKING, Any

import torch

from ..errors import CheckpointError, MegacompileError

if TYPE_CHECKING:
    from ..state import TrainingState


def counters(state: "TrainingState") -> dict:
    """The manifest's counters, under its own keys and in its order (the run's id is `run`)."""
    saved = state.counters.state_dict()
    return {"run": saved["run_id"], "steps_done": saved["steps_done"], "micro_batches": saved["micro_batches"],
            "skipped_steps": saved["skipped_steps"], "missed_steps": saved["missed_steps"]}


def saved_counters(manifest: dict) -> dict:
    """counters() read back, for Counters.load_state_dict. A manifest written before it named its
    run keeps the engine's own id; one without skipped_steps or missed_steps counts none."""
    values = {"steps_done": manifest["steps_done"], "micro_batches": manifest["micro_batches"],
              "skipped_steps": manifest.get("skipped_steps", 0), "missed_steps": manifest.get("missed_steps", {})}
    if "run" in manifest:
        values["run_id"] = manifest["run"]
    return values


def optimizer_settings(state: "TrainingState") -> dict:
    opt = state.optimizer
    return {"lr": "callable" if callable(opt.lr) else opt.lr, "betas": list(opt.betas), "eps": opt.eps,
            "weight_decay": opt.weight_decay, "max_grad_norm": opt.max_grad_norm, "kernel": opt.kernel,
            "grad_accum": state.grad_accum, "compute_dtype": str(state.compute_dtype).replace("torch.", ""),
            "no_decay": sorted(state.no_decay), "lr_ratios": dict(sorted(state.lr_ratios.items()))}


def setting_differences(saved: dict, state: "TrainingState") -> list[str]:
    """Each setting but no_decay (no_decay_difference) in which the engine differs from the run
    that saved the checkpoint."""
    own = optimizer_settings(state)
    # A checkpoint saved before lr_ratios was recorded stepped every parameter at lr.
    saved = {"lr_ratios": {}, **saved}
    return [f"{key}: the checkpoint has {saved.get(key)!r}, this engine {value!r}"
            for key, value in own.items() if key != "no_decay" and saved.get(key) != value]


def no_decay_difference(saved: dict, state: "TrainingState") -> str | None:
    """The parameters AdamW no_decay exempts from weight decay in this engine and not in the run
    that saved the checkpoint, or the other way round; None when they agree, or when the
    checkpoint predates recording them."""
    if "no_decay" not in saved:
        return None
    before, now = set(saved["no_decay"]), set(state.no_decay)
    if before == now:
        return None
    moved = [f"{what}: {', '.join(names[:4])}" + (f" and {len(names) - 4} more" if len(names) > 4 else "")
             for what, names in (("decayed now", sorted(before - now)), ("exempt now", sorted(now - before)))
             if names]
    return (f"no_decay: the checkpoint's run stepped {len(before)} parameters with weight decay 0, this engine "
            f"{len(now)} ({'; '.join(moved)})")


def lr_schedulers(state: "TrainingState") -> list:
    """The torch LR schedulers attached to `engine.torch_optimizer` and still alive, in a fixed
    order (by class name). A scheduler holds the optimizer, never the other way round, so they
    are found among its referrers (one hop further where the referrer is an instance's dict)."""
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau
    handle = state.torch_optimizer
    found = {}
    for ref in gc.get_referrers(handle):
        owners = [ref] if not isinstance(ref, dict) else gc.get_referrers(ref)
        for obj in owners:
            if isinstance(obj, (LRScheduler, ReduceLROnPlateau)) and getattr(obj, "optimizer", None) is handle:
                found[id(obj)] = obj
    return sorted(found.values(), key=lambda s: type(s).__name__)


def schedule_state(state: "TrainingState") -> dict:
    handle = state.torch_optimizer
    group = {k: v for k, v in handle.param_groups[0].items() if k != "params"}
    schedulers = [{"class": type(s).__name__, "state": s.state_dict()} for s in lr_schedulers(state)]
    return {"param_group": _jsonable(group), "schedulers": _jsonable(schedulers)}


# What the handle's param group gives back at a load, per optimizer setting: the values a scheduler
# (OneCycleLR cycles betas[0]) or the user left there, which the next step reads.
_RESTORED = {"lr": ("lr", "initial_lr"), "betas": ("betas",), "eps": ("eps",), "weight_decay": ("weight_decay",)}


def saved_param_group(manifest: dict, state: "TrainingState") -> dict:
    """The handle's lr (with initial_lr), betas, eps and weight_decay as saved (for
    TrainingState.restore); none of a setting in which this engine differs from the saving run,
    whose own value then wins (the caller warns)."""
    own, saved = optimizer_settings(state), manifest["schedule"]["param_group"]
    return {key: saved[key] for setting, keys in _RESTORED.items()
            if manifest["optimizer"].get(setting) == own[setting] for key in keys if key in saved}


def restore_schedulers(state: "TrainingState", saved: dict) -> list[str]:
    """Put every attached scheduler back; returns notes on what could not be matched."""
    notes = []
    attached = lr_schedulers(state)
    kept = list(saved["schedulers"])
    for scheduler in attached:
        match = next((s for s in kept if s["class"] == type(scheduler).__name__), None)
        if match is None:
            notes.append(f"the attached {type(scheduler).__name__} has no state in the checkpoint; it starts afresh")
            continue
        kept.remove(match)
        scheduler.load_state_dict(match["state"])
    for s in kept:
        notes.append(f"the checkpoint holds the state of a {s['class']} LR scheduler, but none is attached to "
                     "engine.torch_optimizer: make it before load_checkpoint so that it resumes where it was")
    return notes


def rng_state() -> dict:
    out = {"cpu": _b64(torch.get_rng_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def restore_rng(saved: dict) -> None:
    torch.set_rng_state(_unb64(saved["cpu"]))
    if "cuda" in saved and torch.cuda.is_available():
        states = [_unb64(s) for s in saved["cuda"]]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
        else:
            warnings.warn(f"the checkpoint holds the random states of {len(states)} GPUs, this machine has "
                          f"{torch.cuda.device_count()}: dropout will not repeat the saved run's masks", stacklevel=4)


def extra_json(extra: Any) -> Any:
    """The user's extra state, checked to round-trip through JSON before anything is written."""
    if extra is None:
        return None
    try:
        text = json.dumps(extra, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"save_checkpoint(extra=...) must be JSON: {e} (numbers, strings, lists and "
                              "dicts; turn tensors into lists)") from e
    return json.loads(text)


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return value   # json writes Infinity/NaN and reads them back
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise MegacompileError(f"an LR scheduler's state holds a {type(value).__name__}, which a checkpoint "
                           "cannot keep (its lr functions are remade by its constructor, not saved)")


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)
