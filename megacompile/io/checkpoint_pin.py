"""A checkpoint pinned against keep_last while it is read by another process.

`megacompile export` reads a checkpoint of a run that may go on training in the same folder; the
run's keep_last (save_total_limit) would remove the checkpoint half read. The reader holds a
shared lock on `.<name>.pin` beside the checkpoint (`pinned`); rotation takes an exclusive lock on
it before it removes the checkpoint (`remove_unless_pinned`) and leaves a pinned one, which the
next rotation after the pin's release removes. The locks are the kernel's (flock, as
train/run_lock.py's): a pin ends with its process however that ends, and the file a dead reader
left pins nothing. Several readers may pin one checkpoint at once.

The pin file is removed by whoever holds it exclusively (the last reader, or the rotation that
removes its checkpoint). A lock taken on a file that was removed meanwhile pins nothing, so both
sides check, once locked, that the file they locked is still the one at its name: while a reader
holds a checked pin, its file stays at its name and no rotation can lock it exclusively.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from typing import Callable

_BUSY = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)


def pin_path(checkpoint: str) -> str:
    """`.<name>.pin` beside the checkpoint: a hidden name, which no listing of checkpoints reads."""
    parent, name = os.path.split(os.path.abspath(checkpoint))
    return os.path.join(parent, f".{name}.pin")


@contextlib.contextmanager
def pinned(checkpoint: str):
    """While inside, no keep_last rotation removes `checkpoint`. Yields whether it is pinned: False
    where its folder cannot be written (read-only: no process of this user removes it either) or is
    not there. The caller checks, once inside, that the checkpoint is still there: a rotation may
    have removed it just before."""
    path = pin_path(checkpoint)
    fd = _locked(path)
    try:
        yield fd is not None
    finally:
        if fd is not None:
            os.close(fd)
            _remove_if_free(path)


def remove_unless_pinned(checkpoint: str, remove: Callable[[str], None]) -> bool:
    """remove(checkpoint) unless a live process pins it; whether it was removed. A pin file whose
    process is gone is removed with it."""
    path = pin_path(checkpoint)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        remove(checkpoint)
        return True
    except OSError:
        return False        # a pin file it cannot read: kept, as pinned
    try:
        if not _try(fd, fcntl.LOCK_EX) or not _same(fd, path):
            return False        # pinned, or its pin file changed hands just now: the next rotation decides
        remove(checkpoint)
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        return True
    finally:
        os.close(fd)


def _locked(path: str) -> int | None:
    """A descriptor holding a shared lock on the pin file at `path` (made if missing), checked to
    be the file at that name; None where the folder takes no file."""
    while True:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
        except OSError as e:
            if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENOTDIR):
                return None
            raise
        # Blocks only while a rotation or a last reader holds it exclusively: a removal under way.
        fcntl.flock(fd, fcntl.LOCK_SH)
        if _same(fd, path):
            return fd
        os.close(fd)        # locked a file removed meanwhile: take the one at the name now


def _remove_if_free(path: str) -> None:
    """After this reader's lock is released: the pin file removed unless another reader holds it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        if _try(fd, fcntl.LOCK_EX) and _same(fd, path):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
    finally:
        os.close(fd)


def _try(fd: int, kind: int) -> bool:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in _BUSY:
            raise
        return False
    return True


def _same(fd: int, path: str) -> bool:
    """Whether the file `fd` holds is the one at `path` now."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)
