"""The gradients' reduce on the cuda backend's network stream, on a stubbed torch.cuda and
torch.distributed: the order of the stream waits, event records and collectives that makes the
reduce follow the backward that produced the gradients and precede the copy of the shard."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from megacompile.distributed import grad_reduce
from megacompile.distributed.group import Ranks
from megacompile.errors import DistributedError

GiB = 2 ** 30


class _Stream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_event(self, event):
        self.log.append(("wait", self.name, event.id))


@pytest.fixture
def cuda(monkeypatch):
    """One 80 GiB GPU; every stream wait, event record and collective lands in `log`."""
    log, made = [], []
    compute = _Stream("compute", log)
    current = [compute]

    class Event:
        count = 0

        def __init__(self, enable_timing=False):
            Event.count += 1
            self.id = Event.count

        def record(self, stream):
            log.append(("record", stream.name, self.id))

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return 0.0

    @contextlib.contextmanager
    def stream(s):
        before, current[0] = current[0], s
        try:
            yield
        finally:
            current[0] = before

    def new_stream(device):
        made.append(_Stream(("h2d", "d2h", "network")[len(made)], log))
        return made[-1]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=80 * GiB))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device: None)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0, raising=False)
    monkeypatch.setattr(torch.cuda, "Stream", new_stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: log.append(("record_stream", s.name)))
    from megacompile.runtime.cuda import CudaBackend
    backend = CudaBackend(40 * GiB, torch.device("cuda", 0))
    yield SimpleNamespace(backend=backend, log=log, made=made, current=current)
    backend.close()


def _ranks(rank, log):
    def group(device):
        log.append(("group", device.type))
        return "nccl"
    return SimpleNamespace(rank=rank, size=2, members=[0, 1], device_group=group, call=lambda what, fn: fn())


def test_the_reduce_follows_the_backward_on_its_own_stream_and_the_copy_follows_the_reduce(cuda, monkeypatch):
    log, backend = cuda.log, cuda.backend

    def reduce(t, dst, group, async_op):
        assert async_op and group == "nccl"
        log.append(("reduce", cuda.current[0].name, dst, t.numel()))
        return SimpleNamespace(wait=lambda: log.append(("work.wait", cuda.current[0].name)))
    monkeypatch.setattr(grad_reduce.dist, "reduce", reduce)
    mine = torch.full((4, 3), 6.0).t()            # dense, transposed: reduced as its storage run
    theirs = torch.full((5,), 2.0)
    loose = torch.full((4, 4), 8.0)[:, :2]        # not dense: a contiguous copy is reduced
    event, sent = grad_reduce.reduce_to_holders(_ranks(1, log), backend, [mine, theirs, loose], [1, 0, 1], "block.1")
    assert sent[0] is mine and sent[1] is theirs and sent[2] is not loose and sent[2].is_contiguous()
    # rank 1 holds the first and the last: divided by the 2 ranks, on the network stream
    assert torch.equal(mine, torch.full((3, 4), 3.0)) and torch.equal(sent[2], torch.full((4, 2), 4.0))
    assert torch.equal(theirs, torch.full((5,), 2.0))
    produced = next(e for op, s, e in (x for x in log if x[0] == "record") if s == "compute")
    at = {entry: i for i, entry in enumerate(log)}
    assert at[("wait", "network", produced)] < at[("reduce", "network", 1, 12)]
    assert [x[2:] for x in log if x[0] == "reduce"] == [(1, 12), (0, 5), (1, 8)]   # in order, to each holder
    waits = [i for i, x in enumerate(log) if x[0] == "work.wait"]
    assert len(waits) == 3 and all(log[i][1] == "network" for i in waits)
    done = event.event.id
    assert at[("record", "network", done)] > max(waits)
    assert log.count(("record_stream", "network")) == 3
    # the copy of the shard waits on the compute stream's producer and on the reduce
    log.clear()
    landed = []
    copied = backend.offload([sent[0], sent[2]], landed.extend, "offload block.1", after=event)
    copied.landed.wait()
    assert ("wait", "d2h", done) in log
    d2h_done = copied.copied.event.id
    assert log.index(("wait", "d2h", done)) < log.index(("record", "d2h", d2h_done))
    assert len(landed) == 2
    assert [s.name for s in cuda.made] == ["h2d", "d2h", "network"]
    grad_reduce.reduce_to_holders(_ranks(0, log), backend, [theirs], [0], "block.0")
    assert len(cuda.made) == 3, "one network stream, made at the first reduce"


def test_without_a_reduce_the_offload_waits_only_on_the_producer(cuda):
    cuda.log.clear()
    cuda.backend.offload([torch.ones(2)], lambda _: None, "offload block.0").landed.wait()
    waits = [x for x in cuda.log if x[0] == "wait"]
    assert len(waits) == 1 and waits[0][1] == "d2h"
    assert [s.name for s in cuda.made] == ["h2d", "d2h"], "one process makes no network stream"


def test_gradients_on_a_gpu_are_summed_over_nccl_and_on_the_simulated_device_over_gloo():
    ranks = SimpleNamespace(grads="gloo group", nccl="nccl group", rank=1, size=2)
    assert Ranks.device_group(ranks, torch.device("cpu")) == "gloo group"
    assert Ranks.device_group(ranks, torch.device("cuda", 0)) == "nccl group"
    ranks.nccl = None
    with pytest.raises(DistributedError, match="NCCL.*CUDA build"):
        Ranks.device_group(ranks, torch.device("cuda", 0))
