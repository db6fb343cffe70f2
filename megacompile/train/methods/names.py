"""Module names as run.yaml gives them: a comma string or a list, or `all`."""
from __future__ import annotations

from typing import Any

from ...errors import ArgumentError

ALL = "all"


def names(key: str, value: Any, allow_all: bool = True) -> list[str] | str:
    """A comma string or a list of module names, or `all`."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(v, str) and v.strip() for v in items):
        raise ArgumentError(f"{key} is a comma-separated string or a list of module names"
                            f"{' (or all)' if allow_all else ''}, e.g. q_proj,v_proj; got {value!r}")
    items = [v.strip() for v in items]
    if ALL in items:
        if not allow_all or len(items) > 1:
            raise ArgumentError(f"{key}: {'all is not taken here' if not allow_all else 'all stands alone'}; "
                                f"got {value!r}")
        return ALL
    return items
