"""The node's shared compute copy in one process (a node of one rank; the spawned ranks of
test_data_parallel.py share it for real): its layout, its page-locking with CUDA stubbed out, and
that no failure leaves a file behind."""
from __future__ import annotations

import errno
import os
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from megacompile.distributed import node
from megacompile.distributed.node import ALIGN, NodeCopy, group_by_node
from megacompile.errors import ArgumentError, HostMemoryError


def _ranks(names=("here",)):
    """Rank 0 of ranks on these nodes, whose gathers return the node names and else its own object."""
    return SimpleNamespace(rank=0, size=len(names), members=list(range(len(names))), timeout=timedelta(seconds=5),
                           groups=[], gather_objects=lambda obj, what: list(names) if isinstance(obj, str) else [obj] * len(names))


@pytest.fixture
def shm(tmp_path, monkeypatch):
    monkeypatch.setattr(node, "shm_dir", lambda: str(tmp_path))
    return tmp_path


def test_each_owner_has_its_own_pages_and_the_file_is_gone_once_mapped(shm):
    copy = NodeCopy(_ranks(), {0: 3000, 3: 10}, torch.bfloat16, pin=False)
    assert list(shm.iterdir()) == []                       # unlinked: nothing to leak from here on
    a, b = copy.view(0), copy.view(3)
    assert a.dtype == b.dtype == torch.bfloat16 and (a.numel(), b.numel()) == (3000, 10)
    assert (b.data_ptr() - a.data_ptr()) == 2 * ALIGN and copy.nbytes == 3 * ALIGN
    b.fill_(2.0)
    assert a.abs().sum() == 0 and copy.segment.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()


def test_the_segment_is_page_locked_once_on_cuda(shm, monkeypatch):
    calls = []
    cudart = SimpleNamespace(cudaHostRegister=lambda ptr, size, flags: calls.append((ptr, size, flags)) or 0,
                             cudaHostUnregister=lambda ptr: calls.append(("unregister", ptr)))
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    copy = NodeCopy(_ranks(), {0: 5000}, torch.float32, pin=True)
    assert copy.pinned and calls == [(copy.segment.data_ptr(), copy.nbytes, 1)]
    ptr = copy.segment.data_ptr()
    del copy
    assert calls[-1] == ("unregister", ptr)


def test_a_copy_that_cannot_be_page_locked_warns_and_stays_pageable(shm, monkeypatch):
    cleared = []
    cudart = SimpleNamespace(cudaHostRegister=lambda ptr, size, flags: 2,
                             cudaGetLastError=lambda: cleared.append(True))
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    with pytest.warns(UserWarning, match="could not be page-locked"):
        copy = NodeCopy(_ranks(), {0: 100}, torch.float32, pin=True)
    assert not copy.pinned and cleared == [True]


def test_a_full_shared_memory_is_named_and_leaves_no_file(shm, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(HostMemoryError, match="shm-size"):
        NodeCopy(_ranks(), {0: 100}, torch.float32, pin=False)
    assert list(shm.iterdir()) == []


def test_a_rank_that_cannot_map_the_copy_leaves_no_file(shm, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("mmap failed")
    monkeypatch.setattr(torch, "from_file", broken)
    with pytest.raises(HostMemoryError, match="cannot map"):
        NodeCopy(_ranks(), {0: 100}, torch.float32, pin=False)
    assert list(shm.iterdir()) == []


def test_nodes_of_unequal_ranks_are_refused(shm):
    with pytest.raises(ArgumentError, match="same number of processes per node"):
        NodeCopy(_ranks(("a", "a", "b")), {0: 100}, torch.float32, pin=False)
    assert list(shm.iterdir()) == []


def test_ranks_are_grouped_by_node_in_order_of_their_first_rank():
    assert group_by_node(["b", "a", "b", "a"]) == [[0, 2], [1, 3]]
