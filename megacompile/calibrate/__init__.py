"""Measuring this machine into a hardware profile. It sits above the engine: fitting the cpu
backend's cost per schedule node trains a small model. The cost model only reads what is
measured here (a profile.json, or the cached cpu profile); importing this room hands cost/ the
cpu measurement, for a first plan on the cpu backend (cost/backend_profile.py).

    cpu.py            the host: matmul, copy, in-place update, host AdamW rate, per-op overhead
    gpu.py            the GPU and its links, with the host (`megacompile calibrate --device cuda`)
    node_overhead.py  the cpu backend's cost per schedule node, from a small model's steps
    cache.py          cpu_profile(): the cached cpu profile, or measured once and written there
"""
from ..cost.backend_profile import measure_cpu_with, profile_for
from .cache import cpu_profile
from .cpu import host_adam_rate, measure
from .gpu import measure_gpu

measure_cpu_with(cpu_profile)

__all__ = ["cpu_profile", "profile_for", "host_adam_rate", "measure", "measure_gpu"]
