"""The schema of a checkpoint's manifest.json, checked field by field when it is loaded.

Checksums prove that the files are the ones the manifest lists, not that the manifest holds what
a save writes: one edited by hand (and re-signed) could hold `"steps_done": "3"`, which would load
and fail at the next step, far from its cause. Every field's type (and range, where one is
obvious) is checked here, before anything is loaded, and a wrong one is named with what was
expected and what was found.
"""
from __future__ import annotations

import base64
import os
from typing import Any, Callable

import torch

NAME = "manifest.json"     # the name of a checkpoint folder's manifest (io/checkpoint.py)

# A check takes a value and returns what is wrong with it (None: nothing).
Check = Callable[[Any], "str | None"]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def count(at_least: int = 0) -> Check:
    return lambda v: None if _is_int(v) and v >= at_least else f"an int >= {at_least}"


def number(at_least: float | None = None, optional: bool = False) -> Check:
    def check(v):
        if optional and v is None:
            return None
        if _is_number(v) and (at_least is None or v >= at_least):
            return None
        return ("a number" + (f" >= {at_least}" if at_least is not None else "")
                + (" or null" if optional else ""))
    return check


def of_type(kind: type, optional: bool = False) -> Check:
    name = {str: "a string", dict: "an object", list: "a list"}[kind]
    return lambda v: None if isinstance(v, kind) or (optional and v is None) else name + " or null" * optional


def lr(v: Any) -> str | None:
    return None if v == "callable" or (_is_number(v) and v >= 0) else 'a number >= 0 or "callable"'


def betas(v: Any) -> str | None:
    ok = isinstance(v, list) and len(v) == 2 and all(_is_number(b) and 0 <= b < 1 for b in v)
    return None if ok else "a list of two numbers in [0, 1)"


def missed_steps(v: Any) -> str | None:
    ok = isinstance(v, dict) and all(isinstance(k, str) and _is_int(n) and n >= 1 for k, n in v.items())
    return None if ok else "an object of parameter names to ints >= 1"


def names(v: Any) -> str | None:
    return None if v is None or (isinstance(v, list) and all(isinstance(n, str) for n in v)) \
        else "a list of parameter names or null"


def file_name(v: Any) -> str | None:
    """A file of the checkpoint folder itself: never a path that leads out of it."""
    ok = isinstance(v, str) and v not in ("", ".", "..") and os.path.basename(v) == v and "\\" not in v
    return None if ok else "a file name inside the checkpoint folder"


def rng_state(v: Any) -> str | None:
    """torch's CPU generator state as base64: set_rng_state takes nothing else, and a load must
    not fail there, after the weights and counters have changed."""
    expected = torch.get_rng_state().numel()
    try:
        ok = isinstance(v, str) and len(base64.b64decode(v, validate=True)) == expected
    except ValueError:
        ok = False
    return None if ok else f"a CPU random state ({expected} bytes in base64)"


OPTIMIZER: dict[str, Check] = {
    "lr": lr, "betas": betas, "eps": number(0), "weight_decay": number(0), "max_grad_norm": number(0, optional=True),
    "kernel": of_type(str), "grad_accum": count(1), "compute_dtype": of_type(str),
}
# absent from a manifest of an earlier release: which parameters were exempt is not known
OPTIMIZER_OPTIONAL: dict[str, Check] = {"no_decay": lambda v: None if isinstance(v, list) and names(v) is None
                                        else "a list of parameter names"}
FILE: dict[str, Check] = {"bytes": count(0), "sha256": of_type(str)}
SCHEDULE: dict[str, Check] = {"param_group": of_type(dict), "schedulers": of_type(list)}
SCHEDULER: dict[str, Check] = {"class": of_type(str), "state": of_type(dict)}
RNG: dict[str, Check] = {"cpu": rng_state}
MANIFEST: dict[str, Check] = {
    "format": of_type(str), "steps_done": count(0), "micro_batches": count(0), "optimizer": of_type(dict),
    "schedule": of_type(dict), "rng": of_type(dict), "files": of_type(dict),
}
# Fields a save writes but a manifest of an earlier release may lack, and what they mean then.
# missed_steps absent: every parameter's AdamW count is steps_done; step_reached absent (saved
# mid-step): every parameter's gradient sum holds the step's earlier micro-batches.
OPTIONAL: dict[str, Check] = {"skipped_steps": count(0), "missed_steps": lambda v: missed_steps(v),
                              "step_reached": lambda v: names(v)}


def problems(manifest: Any) -> list[str]:
    """Each field of `manifest` that does not hold what a save writes, as 'FIELD: expected ..., found ...'."""
    if not isinstance(manifest, dict):
        return [f"the manifest: expected an object, found {_found(manifest)}"]
    out = _fields(manifest, MANIFEST, "")
    out += _fields(manifest, OPTIONAL, "", required=False)
    if isinstance(manifest.get("optimizer"), dict):
        out += _fields(manifest["optimizer"], OPTIMIZER, "optimizer.")
        out += _fields(manifest["optimizer"], OPTIMIZER_OPTIONAL, "optimizer.", required=False)
    if isinstance(manifest.get("schedule"), dict):
        schedule = manifest["schedule"]
        out += _fields(schedule, SCHEDULE, "schedule.")
        for i, s in enumerate(schedule.get("schedulers") if isinstance(schedule.get("schedulers"), list) else []):
            out += _nested(s, SCHEDULER, f"schedule.schedulers[{i}]")
    if isinstance(manifest.get("rng"), dict):
        rng = manifest["rng"]
        out += _fields(rng, RNG, "rng.")
        if "cuda" in rng and not (isinstance(rng["cuda"], list) and all(isinstance(s, str) for s in rng["cuda"])):
            out.append(f"rng.cuda: expected a list of strings, found {_found(rng['cuda'])}")
    if isinstance(manifest.get("files"), dict):
        for name, info in manifest["files"].items():
            wrong = file_name(name)
            if wrong:
                out.append(f"files: expected {wrong}, found {name!r}")
            else:
                out += _nested(info, FILE, f"files[{name!r}]")
    return out


def _nested(value: Any, schema: dict[str, Check], where: str) -> list[str]:
    if not isinstance(value, dict):
        return [f"{where}: expected an object, found {_found(value)}"]
    return _fields(value, schema, where + ".")


def _fields(values: dict, schema: dict[str, Check], prefix: str, required: bool = True) -> list[str]:
    out = []
    for field, check in schema.items():
        if field not in values:
            if required:
                out.append(f"{prefix}{field}: missing")
            continue
        expected = check(values[field])
        if expected:
            out.append(f"{prefix}{field}: expected {expected}, found {_found(values[field])}")
    return out


def _found(v: Any) -> str:
    text = repr(v)
    return f"{type(v).__name__} {text if len(text) <= 40 else text[:37] + '...'}"
