"""Profiles by name: the datasheet ones (hardware.py), a saved profile.json, or "cpu", measured here
(calibrate.py). Kept apart from both so that neither imports the other back."""
from __future__ import annotations

from .calibrate import cpu_profile
from .hardware import PROFILES, HardwareProfile


def get_profile(name: str) -> HardwareProfile:
    """A named profile, or a profile saved as JSON by `megacompile calibrate` (a path ending in
    .json); "cpu" is measured on this machine (once, then cached)."""
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
        return cpu_profile()
    if key not in PROFILES:
        from ..errors import MegacompileError
        raise MegacompileError(f"unknown hardware '{name}': choose one of {', '.join(sorted(PROFILES) + ['cpu'])}, "
                               "or a profile.json written by `megacompile calibrate`")
    return PROFILES[key]
