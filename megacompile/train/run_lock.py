"""One run at a time in a run folder.

Two `megacompile train` processes on one run_dir (a job submitted twice, a SLURM requeue while the
first copy still runs, a run started again in another terminal) would tokenise into the same
files, resume from each other's checkpoints and remove each other's: both may exit 0 with the
folder holding neither run. The run holds an exclusive lock on `run_dir/.lock` from its first
check to its end; a second process is refused, naming the holder. The lock is the kernel's
(flock), so it ends with its process however that ends (SIGKILL, OOM): a requeued job takes it
again without anyone removing a stale file. The file keeps the holder's host and pid for the
refusal to name; it is never removed, so two processes always lock the same file.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket

from ..errors import ArgumentError

LOCK = ".lock"


class RunFolderBusyError(ArgumentError):
    """Another process is training in this run folder."""


class Held:
    """The lock a run holds; `created`: its file is new (a run refused before it commits anything
    removes it again: `leave`, so a folder it found is left as it was)."""

    def __init__(self, path: str, created: bool):
        self.path, self.created = path, created

    def leave(self) -> None:
        if self.created:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)


@contextlib.contextmanager
def holding(run_dir: str):
    """While inside, this process alone trains in `run_dir` (made if missing: the caller removes it
    again if the run ends before it commits anything). Yields a Held."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, LOCK)
    created = not os.path.exists(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise RunFolderBusyError(
                f"run_dir {run_dir} is in use by another run ({_holder(fd)}): two runs in one folder would "
                "resume from and remove each other's checkpoints; wait for it to end (resume: auto then goes "
                "on from its latest checkpoint), stop it, or give this run another run_dir") from None
        me = f"{socket.gethostname()} {os.getpid()}\n".encode()
        if os.pread(fd, 256, 0) != me:      # written only when another holder's: the folder is left as it was
            os.ftruncate(fd, 0)
            os.pwrite(fd, me, 0)
        yield Held(path, created)
    finally:
        os.close(fd)        # releases the lock


def _holder(fd: int) -> str:
    """Who holds the lock, as its file says: 'pid N on HOST'."""
    try:
        host, pid = os.pread(fd, 256, 0).decode().split()
    except (OSError, ValueError, UnicodeDecodeError):
        return "its process wrote no name yet"
    return f"pid {pid} on {host}"
