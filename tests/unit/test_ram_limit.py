"""The RAM a process may fill (cost/ram_limit.py): the lowest memory limit of its cgroup and the
cgroups above it, cgroup v1's and v2's files, a cgroup namespace's own root; none where no limit
is set or the files cannot be read."""
from __future__ import annotations

import os

import pytest

from megacompile.cost.ram_limit import cgroup_memory_limit

GiB = 2 ** 30
NONE_V1 = "9223372036854771712"     # what v1 writes where no limit is set


def _tree(root, files: dict[str, str]) -> str:
    for path, text in files.items():
        os.makedirs(os.path.dirname(root / path), exist_ok=True)
        (root / path).write_text(text + "\n")
    return str(root)


def _proc(tmp_path, text: str) -> str:
    (tmp_path / "cgroup").write_text(text)
    return str(tmp_path / "cgroup")


@pytest.mark.parametrize("proc, files, limit", [
    # v1: a SLURM job's step under its job; the job's limit binds
    ("4:memory:/slurm/job_7/step_0\n3:cpuset:/\n", {"memory/slurm/job_7/step_0/memory.limit_in_bytes": NONE_V1,
                                                    "memory/slurm/job_7/memory.limit_in_bytes": str(200 * GiB),
                                                    "memory/memory.limit_in_bytes": NONE_V1}, 200 * GiB),
    # v2: "max" in the leaf, a limit above it
    ("0::/kubepods/pod1/c1\n", {"kubepods/pod1/c1/memory.max": "max", "kubepods/pod1/memory.max": str(64 * GiB),
                                "kubepods/memory.max": str(96 * GiB)}, 64 * GiB),
    # a cgroup namespace: the process's path is "/", the files at the mount's root are its own
    ("0::/\n", {"memory.max": str(8 * GiB)}, 8 * GiB),
    # the host's path with the container's cgroup mounted at the root: the root's file
    ("0::/system.slice/docker-abc.scope\n", {"memory.max": str(16 * GiB)}, 16 * GiB),
    # hybrid: v2's unified hierarchy mounted at unified/
    ("0::/user.slice\n", {"unified/user.slice/memory.max": str(12 * GiB)}, 12 * GiB),
    # no limit anywhere
    ("4:memory:/a\n0::/a\n", {"memory/a/memory.limit_in_bytes": NONE_V1, "a/memory.max": "max"}, None),
])
def test_the_lowest_limit_of_the_cgroup_and_its_ancestors_binds(tmp_path, proc, files, limit):
    root = _tree(tmp_path / "fs", files)
    assert cgroup_memory_limit(_proc(tmp_path, proc), root) == limit


def test_nothing_readable_is_no_limit(tmp_path):
    assert cgroup_memory_limit(str(tmp_path / "missing"), str(tmp_path)) is None
    assert cgroup_memory_limit(_proc(tmp_path, "garbage\n"), str(tmp_path)) is None
