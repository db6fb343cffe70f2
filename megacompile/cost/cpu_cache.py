"""Where the measured `cpu` profile is kept, and reading it back.

The simulated device is this machine, so its profile is measured (megacompile/calibrate, which
writes this file) and cached in MEGACOMPILE_CACHE_DIR (default ~/.cache/megacompile), keyed by
the CPU, torch's thread count and the host AdamW's (optim/host_threads.py). The cost model only
reads it: it never measures.
"""
from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import torch

from ..optim.host_threads import host_threads
from .hardware import HardwareProfile


def cpu_profile_path() -> Path:
    root = Path(os.environ.get("MEGACOMPILE_CACHE_DIR", Path.home() / ".cache" / "megacompile"))
    key = (f"{platform.machine()}-{platform.processor() or 'cpu'}-{os.cpu_count()}"
           f"-t{torch.get_num_threads()}-h{host_threads()}")
    return root / f"cpu_profile-v4-{key.replace(' ', '_').replace('/', '_')}.json"


def cached_cpu_profile() -> HardwareProfile | None:
    """This machine's measured profile, or None when none is cached (or the file is stale or foreign)."""
    path = cpu_profile_path()
    if not path.exists():
        return None
    try:
        return HardwareProfile(**json.loads(path.read_text()))
    except (ValueError, TypeError):
        return None
