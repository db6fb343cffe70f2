"""The profile a backend's plans are timed with when none is given: the simulated device's is
measured on this machine (cached, cache.py); a GPU's is the named profile its name matches. The
callers at the top (the Engine, plan(), `megacompile plan`) resolve it and hand it to the planner,
which never measures."""
from __future__ import annotations

import torch

from ..cost import HardwareProfile, get_profile
from .cache import cpu_profile


def profile_for(backend: str) -> HardwareProfile:
    if backend == "cpu":
        return cpu_profile()
    name = torch.cuda.get_device_name().lower() if torch.cuda.is_available() else ""
    for key in ("gh200", "h200", "h100", "a100"):
        if key in name:
            return get_profile("h100-pcie" if key == "h100" and "pcie" in name else key)
    return get_profile("h100")
