"""The ranks of a data-parallel run and the collectives between them, with failures named.

Host state lives in host RAM, so its collectives (the all-gather of the updated compute copies,
the clip norm) run on gloo groups over the ranks of the user's process group, whatever that
group's own backend is (NCCL under torchrun on GPUs). Two such groups: one for the compute
thread, one for the host stream, which gathers an owner's new weights while the next step
already runs on the other. The gradients are summed on the device, on a third group (gloo on the
cpu backend, NCCL on GPUs) that only the network stream uses. Each group's collectives come in
the same order on every rank: the ranks run the same plan, or, where their micro-batches reach
different parts of the model (an image on one rank only), settle first what each sums where
(reach.py).

A rank that raises inside a step leaves a note in the process group's store before it goes; a
rank waiting on it gets a DistributedError naming that rank and its error, rather than hanging.
A rank that dies without a word (killed, out of memory) or hangs is named by a roll call
(liveness.py). Every collective has a timeout that follows the step (timeouts.py), and the error
says how the run goes on: every rank stops, and the ranks started again resume from the last
checkpoint this run committed or loaded.
"""
from __future__ import annotations

import atexit
import contextlib
import threading
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from ..errors import ArgumentError, DistributedError
from . import liveness, timeouts

NOTE = "megacompile/failed/{}"
BLAMED = "megacompile/blamed"      # the first roll call's verdict: every rank that stops names the same one


class Ranks:
    """This process's place among the ranks, and the gloo groups the host state talks over."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.members = dist.get_process_group_ranks(group)   # global ranks, by rank in the group
        self.timeout = timeouts.long()     # until a plan has run a step here (pace)
        self.checkpoint: tuple[str, int] | None = None     # (path, step): the last committed or loaded
        self.failure: str | None = None        # why the first collective that failed did (explain)
        self._explaining = threading.Lock()
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
        # The groups this run made, whose timeout follows the step (pace); node.py adds its own.
        # A group of the user's (an NCCL one the gradients are summed on) keeps the user's timeout.
        self.groups = [self.main, self.stream, self.grads]
        if self.nccl is not None and self.nccl is not group:
            self.groups.append(self.nccl)
        try:
            self._store = dist.distributed_c10d._get_default_store()
        except (RuntimeError, AttributeError, ValueError):
            self._store = None
        self.progress = None if self._store is None else liveness.progress(self._store, dist.get_rank())
        # A rank whose script ends or raises outside a step says so too (a killed one cannot).
        atexit.register(self._note_exit)

    def call(self, what: str, fn: Callable[[], object]):
        """Run one collective; a failure becomes a DistributedError naming the rank to blame.
        After one, every collective of these ranks fails at once with the same words: the others
        that the threads have queued would each wait for the rank that is gone."""
        if self.failure is not None:
            raise DistributedError(f"rank {self.rank} of {self.size}: {what} not run: {self.failure}")
        with (contextlib.nullcontext(0) if self.progress is None else self.progress.collective(what)) as entered:
            try:
                return fn()
            except (RuntimeError, dist.DistBackendError) as e:
                raise DistributedError(self.explain(what, e, entered)) from e

    def explain(self, what: str, e: BaseException, entered: int = 0) -> str:
        head = f"rank {self.rank} of {self.size}: {what} failed"
        with self._explaining:          # one roll call, whichever threads fail at once
            if self.failure is None:
                self.failure = self._blame(e, entered)
        return f"{head}: {self.failure}"

    def _blame(self, e: BaseException, entered: int) -> str:
        cause = str(e).splitlines()[0] if str(e) else type(e).__name__
        notes = self.notes()
        if notes:
            rank, note = next(iter(notes.items()))
            return f"rank {rank} failed first: {note}; {self.resume_hint()}"
        blamed = self._shared(BLAMED)
        if blamed is None and self._store is not None:
            answers = liveness.roll_call(self._store, self.members, dist.get_rank())
            blamed = liveness.blame(answers, threading.current_thread().name, entered,
                                    {g: r for r, g in enumerate(self.members)})
            if blamed is not None and answers is not None:
                with contextlib.suppress(Exception):
                    self._store.set(BLAMED, blamed)
        blamed = blamed or "another rank died or did not answer"
        return (f"{blamed} (waited up to {self.timeout.total_seconds():.0f} s, {timeouts.ENV} sets it: {cause}); "
                f"{self.resume_hint()}")

    def resume_hint(self) -> str:
        start = f"every rank stops; start all {self.size} ranks again"
        if self.checkpoint is None:
            return f"{start}: no checkpoint was written or loaded by this run, so it starts from the beginning"
        path, step = self.checkpoint
        return (f"{start} and, on each, engine.load_checkpoint({path!r}) before the first step: the last "
                f"checkpoint this run committed or loaded (step {step}); with {self.size} ranks the run goes on "
                "exactly as it would have")

    # -- how long a collective waits (timeouts.py) ----------------------------------------
    def pace(self, timeout: timedelta) -> None:
        """Every collective of this run's groups waits `timeout` from now on."""
        if timeout == self.timeout:
            return
        self.timeout = timeout
        for group in self.groups:
            dist.distributed_c10d._set_pg_timeout(timeout, group)

    @contextlib.contextmanager
    def patient(self):
        """The long wait (at least the steps') while every rank writes or reads its share of a
        checkpoint or an export; the steps' wait again after."""
        before = self.timeout
        self.pace(max(timeouts.long(), before))
        try:
            yield
        finally:
            self.pace(before)

    def notes(self) -> dict[int, str]:
        """The failure notes ranks left in the store, by rank."""
        found = {}
        for rank in range(self.size):
            note = self._shared(NOTE.format(rank))
            if note is not None:
                found[rank] = note
        return found

    def _shared(self, key: str) -> str | None:
        """The store's value at `key`, None when absent or when the store cannot be read."""
        try:
            if self._store is not None and self._store.check([key]):
                return self._store.get(key).decode(errors="replace")
        except (RuntimeError, dist.DistStoreError):
            pass
        return None

    def note_failure(self, e: BaseException) -> None:
        """Tell the other ranks why this one stops (they are, or will be, waiting on it)."""
        if self._store is None or isinstance(e, DistributedError):
            return
        try:
            self._store.set(NOTE.format(self.rank), f"{type(e).__name__}: {e}"[:2000])
        except (RuntimeError, dist.DistStoreError):
            pass

    def _note_exit(self) -> None:
        # A rank that stopped on another's failure (self.failure) is no cause: it leaves no note.
        if self._store is not None and self.failure is None and not self.notes().get(self.rank):
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

    def gather_(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """Every rank's `t` (the same shape on each), stacked in rank order."""
        out = [torch.empty_like(t) for _ in range(self.size)]
        self.call(what, lambda: dist.all_gather(out, t, group=self.main))
        return torch.stack(out)

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
