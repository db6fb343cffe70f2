"""How many threads the host AdamW (and the host side of offloads) runs on.

The cores this process may use (its CPU affinity: a container's or a job scheduler's cpuset,
`taskset`) shared out among the ranks of this machine (LOCAL_WORLD_SIZE, which torchrun sets).
OMP_NUM_THREADS is not read: torchrun sets it to 1 for every rank when it starts several, to keep
their intra-op teams from fighting, and the host update would then run on one thread while the
rest of the machine's cores sat idle. The compute thread's count is left as torch has it; only the
host stream's own thread takes this count (runtime/stream.py).
"""
from __future__ import annotations

import os

from ..errors import MegacompileError

LOCAL_RANKS_ENV = "LOCAL_WORLD_SIZE"


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask; every core where none is kept)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):     # no affinity call on this platform
        return os.cpu_count() or 1


def local_ranks() -> int:
    """The processes of this job sharing this machine: LOCAL_WORLD_SIZE, or 1 without it."""
    value = os.environ.get(LOCAL_RANKS_ENV)
    if value is None or value.strip() == "":
        return 1
    try:
        ranks = int(value)
    except ValueError:
        ranks = 0
    if ranks < 1:
        raise MegacompileError(f"{LOCAL_RANKS_ENV} must be a whole number >= 1 (the ranks on this "
                               f"machine; torchrun sets it), got {value!r}; unset it or fix it")
    return ranks


def host_threads(cores: int | None = None, ranks: int | None = None) -> int:
    """Threads for this rank's host update: its share of the cores, at least one.

    cores: the usable cores (default: this process's affinity); ranks: the local ranks sharing
    them (default: LOCAL_WORLD_SIZE). A share is whole cores; a remainder goes unused rather than
    oversubscribing a core two ranks would then fight for."""
    cores = usable_cores() if cores is None else cores
    ranks = local_ranks() if ranks is None else ranks
    return max(1, cores // max(1, ranks))
