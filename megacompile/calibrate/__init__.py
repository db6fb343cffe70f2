"""Measuring this machine into a hardware profile. It sits above the engine: fitting the cpu
backend's cost per schedule node trains a small model. The cost model only reads what is
measured here (a profile.json, or the cached cpu profile).

    cpu.py            the host: matmul, copy, in-place update, host AdamW rate, per-op overhead
    gpu.py            the GPU and its links, with the host (`megacompile calibrate --device cuda`)
    node_overhead.py  the cpu backend's cost per schedule node, from a small model's steps
    cache.py          cpu_profile(): the cached cpu profile, or measured once and written there
    backend.py        profile_for(backend): the profile plans on that backend are timed with
"""
from .backend import profile_for
from .cache import cpu_profile
from .cpu import host_adam_rate, measure
from .gpu import measure_gpu

__all__ = ["cpu_profile", "profile_for", "host_adam_rate", "measure", "measure_gpu"]
