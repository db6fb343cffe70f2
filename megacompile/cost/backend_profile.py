"""The profile a backend's plans are timed with when none is given.

A GPU's is the named profile its device name matches. The simulated device is this machine, whose
profile is measured (megacompile/calibrate: it trains a small model, so it sits above the
engine) and cached (cpu_cache.py). The measuring room hands its measurement to this module when
megacompile is imported (`measure_cpu_with`), so a first plan on the cpu backend, in the engine
or in plan(), can measure the machine without any room below calibrate importing it: the import
arrows point one way, and only this call goes up.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..errors import MegacompileError
from .cpu_cache import cached_cpu_profile, cpu_profile_path
from .hardware import HardwareProfile
from .profiles import get_profile

_measure_cpu: Callable[[], HardwareProfile] | None = None


def measure_cpu_with(measure: Callable[[], HardwareProfile]) -> None:
    """How this machine's cpu profile is measured (and cached) when it is not cached yet."""
    global _measure_cpu
    _measure_cpu = measure


def profile_for(backend: str) -> HardwareProfile:
    if backend == "cpu":
        cached = cached_cpu_profile()
        if cached is not None:
            return cached
        if _measure_cpu is None:
            raise MegacompileError(f"this machine's cpu profile is not measured yet (no {cpu_profile_path()}): "
                                   "import megacompile (which measures it when a plan needs it), or measure it "
                                   "with megacompile.calibrate.cpu_profile()")
        return _measure_cpu()
    name = torch.cuda.get_device_name().lower() if torch.cuda.is_available() else ""
    return get_profile(profile_name(name))


# Substrings of torch.cuda.get_device_name(), most specific first.
_DEVICE_NAMES = (("gh200", "gh200"), ("h200", "h200"), ("h100", "h100"), ("b200", "b200"), ("a100", "a100"),
                 ("rtx 6000 ada", "rtx6000-ada"), ("l40s", "l40s"), ("rtx 5090", "rtx5090"),
                 ("rtx 4090", "rtx4090"), ("rtx 3090", "rtx3090"), ("rtx a6000", "rtx-a6000"), ("a10", "a10"),
                 ("l4", "l4"))


def profile_name(device_name: str) -> str:
    """The datasheet profile for a CUDA device name, e.g. "NVIDIA A100-SXM4-40GB" -> "a100-40gb";
    an unknown device is planned as an h100."""
    name = device_name.lower()
    for part, key in _DEVICE_NAMES:
        if part in name:
            if key == "h100" and "pcie" in name:
                return "h100-pcie"
            if key == "a100" and "40gb" in name:
                return "a100-40gb"
            return key
    return "h100"
