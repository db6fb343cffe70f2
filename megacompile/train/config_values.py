"""A run.yaml value checked: a string, a flag, one of some choices, a whole number, a number in a
range (YAML reads 2e-5 and inf as strings: taken as numbers), a path that exists, a warmup, the
loggers, a pixel count. Each refusal names the key, what it got and what it takes."""
from __future__ import annotations

import math
import os
from typing import Any

from ..errors import ArgumentError

LOGGERS = ("csv", "tensorboard", "wandb")


def text(key: str, value: Any, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise ArgumentError(f"{key} must be a string{' or null' if optional else ''}; got {value!r}")
    return value


def flag(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ArgumentError(f"{key} must be true or false; got {value!r}")
    return value


def choice(key: str, value: Any, allowed: tuple) -> str:
    if value not in allowed:
        raise ArgumentError(f"{key} must be one of {', '.join(allowed)}; got {value!r}")
    return value


def integer(key: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ArgumentError(f"{key} must be a whole number >= {minimum}; got {value!r}")
    return value


def numeric(value: Any) -> Any:
    """A string YAML did not read as a number (1e3, inf) as a float; anything else as it is."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return value


def number(key: str, value: Any, minimum: float, *, strict: bool = False, below: float | None = None) -> float:
    """A number; YAML reads 2e-5 (no dot) as a string, so numeric strings are taken too."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and (value > minimum if strict else value >= minimum) and (below is None or value < below))
    if not ok:
        bound = f"{'>' if strict else '>='} {minimum:g}" + (f" and < {below:g}" if below is not None else "")
        raise ArgumentError(f"{key} must be a number {bound}; got {value!r}")
    return float(value)


def weight_or_off(key: str, value: Any) -> float | None:
    """A weight >= 0 where null and 0 both mean off (None), as transformers' and LlamaFactory's
    coefficients do."""
    return (None if value is None else number(key, value, 0.0)) or None


def folder_or_file(key: str, path: str, what: str) -> None:
    if not os.path.exists(path):
        raise ArgumentError(f"{key}: {path} does not exist; give {what}")


def warmup(value: Any) -> int | float:
    """Steps, or a fraction of the run's steps below 1 (transformers' warmup_ratio, and its
    warmup_steps below 1): schedule.warmup_steps makes it steps once the steps are known."""
    n = numeric(value)
    ok = isinstance(n, (int, float)) and not isinstance(n, bool) and math.isfinite(n) and n >= 0
    if ok and (n < 1 or float(n).is_integer()):
        return float(n) if n < 1 else int(n)
    raise ArgumentError(f"warmup is a number of steps (a whole n >= 0) or a fraction of the steps below 1 "
                        f"(warmup_ratio: 0.1); got {value!r}")


def loggers(value: Any) -> list[str]:
    """csv (always written) and any of tensorboard, wandb; `none` and `all` as in transformers'
    report_to (all: every one whose package is installed)."""
    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(x, str) for x in names):
        raise ArgumentError(f"log is a list (or a comma-separated string) of {', '.join(LOGGERS)}, none or all; "
                            f"got {value!r}")
    names = [x.strip() for x in names if x.strip()]
    if "all" in names:
        names = [x for x in LOGGERS if x == "csv" or _installed(x)]
    elif "none" in names:
        if len(names) > 1:
            raise ArgumentError(f"log: none goes alone (csv is always written); got {value!r}")
        names = []
    bad = [x for x in names if x not in LOGGERS]
    if bad:
        raise ArgumentError(f"log is a list of {', '.join(LOGGERS)}, none or all (csv is always written); got "
                            f"{', '.join(map(repr, bad))}")
    for name in names:
        if name != "csv" and not _installed(name):
            raise ArgumentError(f"log: {name} needs `pip install {name}`; or leave it out")
    return ["csv"] + [x for x in dict.fromkeys(names) if x != "csv"]


def _installed(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None


def pixels(key: str, value: Any) -> int:
    """A pixel count (width x height): a whole n >= 1 (YAML reads 768*768 as text: write the
    product, 589824)."""
    n = numeric(value)
    if isinstance(n, float) and n.is_integer():
        n = int(n)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ArgumentError(f"{key} is a number of pixels (width x height), a whole n >= 1, e.g. 262144 for "
                            f"512 x 512; got {value!r}")
    return n
