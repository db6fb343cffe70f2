"""The RAM this process may fill: the machine's, or its memory cgroup's limit where that is lower.

A container (Docker's --memory, a Kubernetes pod's limit) or a SLURM job (--mem) runs in a cgroup
whose memory limit is below the machine's RAM; past it the kernel kills the process, hours into a
run. sysconf's page count is the machine's all the same, so a host budget taken from it alone would
place the masters and moments in memory the process can never have. The limit is read from the
cgroup of this process and each of its ancestors (the lowest binds): cgroup v2's `memory.max`
("max": none), or v1's memory controller's `memory.limit_in_bytes` (2^63 rounded to a page: none).
Inside a cgroup namespace the process's path is "/" and the files at the mount's root are its own.
"""
from __future__ import annotations

import os

PROC_CGROUP = "/proc/self/cgroup"
CGROUP_ROOT = "/sys/fs/cgroup"
_UNLIMITED = 2 ** 62        # v1 writes 2^63 - 1 rounded down to a page where no limit is set


def cgroup_memory_limit(proc: str = PROC_CGROUP, root: str = CGROUP_ROOT) -> int | None:
    """The lowest memory limit, in bytes, of this process's cgroup and its ancestors; None where
    none is set or none can be read."""
    try:
        with open(proc) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":                       # v2: the unified hierarchy
            mounts, name = (root, os.path.join(root, "unified")), "memory.max"
        elif "memory" in controllers.split(","):    # v1: the memory controller's own hierarchy
            mounts, name = (os.path.join(root, "memory"),), "memory.limit_in_bytes"
        else:
            continue
        for mount in mounts:
            for folder in _ancestors(mount, path):
                limit = _read_limit(os.path.join(folder, name))
                if limit is not None:
                    limits.append(limit)
    return min(limits) if limits else None


def _ancestors(mount: str, path: str) -> list[str]:
    """The cgroup's folder under `mount` and each one above it, up to the mount itself."""
    parts = [p for p in path.strip("/").split("/") if p]
    return [os.path.join(mount, *parts[:k]) for k in range(len(parts), -1, -1)]


def _read_limit(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if not text.isdigit():          # "max", or nothing
        return None
    value = int(text)
    return value if 0 < value < _UNLIMITED else None


def machine_ram() -> int:
    """Bytes of RAM this machine has."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

