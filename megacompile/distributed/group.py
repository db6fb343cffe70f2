"""The ranks of a data-parallel run and the collectives between them, with failures named.

Host state lives in host RAM, so its collectives (the all-gather of the updated compute copies,
the clip norm) run on gloo groups over the ranks of the user's process group, whatever that
group's own backend is (NCCL under torchrun on GPUs). Two such groups: one for the compute
thread, one for the host stream, which gathers an owner's new weights while the next step
already runs on the other. The gradients are summed on the device, on a third group (gloo on the
cpu backend, NCCL on GPUs) that only the network stream uses. Each group's collectives come in
the same order on every rank because every rank runs the same plan.

A rank that raises inside a step leaves a note in the process group's store before it goes; a
rank waiting on it gets a DistributedError naming that rank and its error, rather than hanging:
every collective has a timeout (MEGACOMPILE_DIST_TIMEOUT seconds, default 600).
"""
from __future__ import annotations

import atexit
import contextlib
import os
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from ..errors import ArgumentError, DistributedError

NOTE = "megacompile/failed/{}"


def timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get("MEGACOMPILE_DIST_TIMEOUT", "600")))


class Ranks:
    """This process's place among the ranks, and the gloo groups the host state talks over."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.members = dist.get_process_group_ranks(group)   # global ranks, by rank in the group
        self.timeout = timeout()
        # new_group is collective over the default group: every process calls compile().
        self.main = dist.new_group(self.members, backend="gloo", timeout=self.timeout)
        self.stream = dist.new_group(self.members, backend="gloo", timeout=self.timeout)
        # Gradients are summed where the backward leaves them, on the network stream
        # (distributed/grad_reduce.py): gloo for the cpu backend's device, NCCL for a GPU's (the
        # user's group when it is NCCL, else one made here: new_group is collective, so now).
        self.grads = dist.new_group(self.members, backend="gloo", timeout=self.timeout)
        self.nccl = None
        if torch.cuda.is_available() and dist.is_nccl_available():
            self.nccl = (group if dist.get_backend(group) == "nccl"
                         else dist.new_group(self.members, backend="nccl", timeout=self.timeout))
        try:
            self._store = dist.distributed_c10d._get_default_store()
        except (RuntimeError, AttributeError, ValueError):
            self._store = None
        # A rank whose script ends or raises outside a step says so too (a killed one cannot).
        atexit.register(self._note_exit)

    def call(self, what: str, fn: Callable[[], object]):
        """Run one collective; a failure becomes a DistributedError naming the rank to blame."""
        try:
            return fn()
        except (RuntimeError, dist.DistBackendError) as e:
            raise DistributedError(self.explain(what, e)) from e

    def explain(self, what: str, e: BaseException) -> str:
        head = f"rank {self.rank} of {self.size}: {what} failed"
        for rank, note in self.notes().items():
            return f"{head}: rank {rank} failed first: {note}"
        return (f"{head}: another rank died or did not answer within {self.timeout.total_seconds():.0f} s "
                f"(MEGACOMPILE_DIST_TIMEOUT) ({str(e).splitlines()[0] if str(e) else type(e).__name__})")

    def notes(self) -> dict[int, str]:
        """The failure notes ranks left in the store, by rank."""
        found = {}
        if self._store is None:
            return found
        for rank in range(self.size):
            key = NOTE.format(rank)
            try:
                if self._store.check([key]):
                    found[rank] = self._store.get(key).decode(errors="replace")
            except (RuntimeError, dist.DistStoreError):
                break
        return found

    def note_failure(self, e: BaseException) -> None:
        """Tell the other ranks why this one stops (they are, or will be, waiting on it)."""
        if self._store is None or isinstance(e, DistributedError):
            return
        try:
            self._store.set(NOTE.format(self.rank), f"{type(e).__name__}: {e}"[:2000])
        except (RuntimeError, dist.DistStoreError):
            pass

    def _note_exit(self) -> None:
        if self._store is not None and not self.notes().get(self.rank):
            with contextlib.suppress(Exception):
                self._store.set(NOTE.format(self.rank), "its process exited (its script ended or raised "
                                                        "outside a step) while others were still training")

    def device_group(self, device: torch.device) -> dist.ProcessGroup:
        """The group that sums tensors on `device`."""
        if device.type == "cpu":
            return self.grads
        if self.nccl is None:
            raise DistributedError(f"rank {self.rank} of {self.size}: gradients on {device} are summed over NCCL, "
                                   "which this torch build lacks; install a CUDA build of torch")
        return self.nccl

    # -- collectives ---------------------------------------------------------------------
    def sum_(self, t: torch.Tensor, what: str) -> torch.Tensor:
        self.call(what, lambda: dist.all_reduce(t, group=self.main))
        return t

    def broadcast_(self, t: torch.Tensor, src: int, what: str, stream: bool = False) -> None:
        # gloo moves bytes: a bfloat16 tensor travels as int16
        t = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
        self.call(what, lambda: dist.broadcast(t, src=self.members[src], group=self.stream if stream else self.main))

    def gather_objects(self, obj, what: str) -> list:
        out = [None] * self.size
        self.call(what, lambda: dist.all_gather_object(out, obj, group=self.main))
        return out

    def barrier(self, what: str) -> None:
        self.call(what, lambda: dist.barrier(group=self.main))


def ranks_for(process_group) -> Ranks | None:
    """The ranks of `process_group` (default: the initialised default group, if any); None when
    there is nothing to spread over (no group, or a group of one)."""
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        process_group = dist.group.WORLD
    elif not isinstance(process_group, dist.ProcessGroup):
        raise ArgumentError(f"process_group must be a torch.distributed ProcessGroup (or None: the default "
                            f"group, once torch.distributed.init_process_group ran), got {type(process_group).__name__}")
    if dist.get_world_size(process_group) == 1:
        return None
    return Ranks(process_group)
