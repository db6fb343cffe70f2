"""Profiles by name: the datasheet ones (hardware.py), a saved profile.json, or "cpu", this
machine's measured profile read from its cache (cpu_cache.py)."""
from __future__ import annotations

from .cpu_cache import cached_cpu_profile, cpu_profile_path
from .hardware import PROFILES, HardwareProfile


def get_profile(name: str) -> HardwareProfile:
    """A named profile, or a profile saved as JSON by `megacompile calibrate` (a path ending in
    .json); "cpu" is the profile measured on this machine, which must have been measured before
    (megacompile.calibrate.cpu_profile; planning for the cpu backend measures it when missing)."""
    key = name.lower()
    if key.endswith(".json"):
        import json

        from ..errors import MegacompileError
        try:
            with open(name) as f:
                return HardwareProfile(**json.load(f))
        except (OSError, ValueError, TypeError) as e:
            raise MegacompileError(f"cannot read the hardware profile {name}: {e}") from e
    if key == "cpu":
        profile = cached_cpu_profile()
        if profile is None:
            from ..errors import MegacompileError
            raise MegacompileError(f"this machine's cpu profile is not measured yet (no {cpu_profile_path()}): "
                                   "measure it with megacompile.calibrate.cpu_profile(); compile() on the cpu "
                                   "backend and megacompile.plan(..., hardware=\"cpu\") measure it when missing")
        return profile
    if key not in PROFILES:
        from ..errors import MegacompileError
        raise MegacompileError(f"unknown hardware '{name}': choose one of {', '.join(sorted(PROFILES) + ['cpu'])}, "
                               "or a profile.json written by `megacompile calibrate`")
    return PROFILES[key]
