"""The `cpu` profile: read from its cache (cost/cpu_cache.py) or measured once and written there."""
from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

from ..cost.cpu_cache import cached_cpu_profile, cpu_profile_path
from ..cost.hardware import HardwareProfile
from .cpu import measure
from .node_overhead import fit_node_overhead


def cpu_profile(refresh: bool = False) -> HardwareProfile:
    """This machine's profile for the cpu backend: the cached one, else (or with refresh) measured,
    its node overhead fitted, and cached. Only a complete profile is ever written."""
    profile = None if refresh else cached_cpu_profile()
    if profile is not None:
        return profile
    profile = measure()
    profile = replace(profile, node_overhead_s=fit_node_overhead(profile))
    _save(cpu_profile_path(), profile)
    return profile


def _save(path: Path, profile: HardwareProfile) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(profile.to_dict()))
    os.replace(tmp, path)
