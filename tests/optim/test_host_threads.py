"""The host update's threads come from the cores this process may use, shared among the local
ranks, never from OMP_NUM_THREADS (which torchrun sets to 1 when it starts several ranks)."""
from __future__ import annotations

import pytest
import torch

from megacompile.errors import MegacompileError
from megacompile.runtime.backend import Timeline
from megacompile.optim.host_threads import host_threads, local_ranks, usable_cores
from megacompile.runtime.stream import ThreadStream


@pytest.mark.parametrize("cores, ranks, threads", [
    (16, 1, 16), (16, 8, 2), (16, 3, 5),     # a remainder stays unused rather than oversubscribed
    (16, 16, 1), (16, 32, 1),                # never below one
    (2, 1, 2), (2, 2, 1),
])
def test_the_cores_are_divided_among_the_local_ranks(cores, ranks, threads):
    assert host_threads(cores, ranks) == threads


def test_the_local_ranks_come_from_local_world_size(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")        # read by nobody here
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert (usable_cores(), local_ranks(), host_threads()) == (16, 1, 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert (local_ranks(), host_threads()) == (4, 4)


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_bad_local_world_size_is_named(monkeypatch, value):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
    with pytest.raises(MegacompileError, match=f"LOCAL_WORLD_SIZE.*{value!r}"):
        host_threads()


def test_the_host_stream_takes_the_share_and_leaves_the_compute_thread_alone(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(6)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    before = torch.get_num_threads()
    stream = ThreadStream("host", Timeline(), threads=None)
    seen = []
    try:
        stream.submit(lambda: seen.append(torch.get_num_threads()), "").wait()
    finally:
        stream.close()
    assert stream.threads == 3 and seen == [3]
    assert torch.get_num_threads() == before
