"""Durable directories: written under a temporary name, fsynced, renamed into place.

A folder being written is `.<name>.<pid>.partial` beside its final name (`.old`: the folder it
replaces, moved aside; `.removed`: one being deleted). A process killed mid-write leaves one
behind; the next save or load in that parent folder removes those whose writer is gone (a live
pid is another writer's, and is left alone).
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil

from ..errors import CheckpointError

_PARTIAL = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.(partial|old|removed)$")
_CHUNK = 8 << 20     # bytes per read when hashing: a fixed buffer, so hashing adds no resident memory


def partial_path(path: str) -> str:
    parent, name = os.path.split(os.path.abspath(path))
    return os.path.join(parent, f".{name}.{os.getpid()}.partial")


def clean_leftovers(parent: str) -> list[str]:
    """Remove the partial folders of writers that are gone (killed mid-save); returns them. A
    folder moved aside for a replacement that never arrived goes back to its name."""
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.listdir(parent):
            m = _PARTIAL.match(entry)
            if m is None or (int(m["pid"]) != os.getpid() and _alive(int(m["pid"]))):
                continue
            final = os.path.join(parent, m["name"])
            if entry.endswith(".old") and not os.path.lexists(final):
                os.rename(os.path.join(parent, entry), final)   # killed between the two renames: put it back
                continue
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
            removed.append(entry)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Make the folder's entries (new names, renames) durable, not only the files' bytes."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buffer)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def rename_into_place(tmp: str, path: str) -> None:
    """Atomically put the finished folder `tmp` at `path`. A folder already there is moved aside
    first and removed after: a crash in between leaves it as `.<name>.<pid>.old`, which the next
    save or load removes."""
    parent = os.path.dirname(os.path.abspath(path))
    aside = None
    if os.path.lexists(path):
        aside = os.path.join(parent, f".{os.path.basename(os.path.abspath(path))}.{os.getpid()}.old")
        os.rename(path, aside)
    os.rename(tmp, path)
    fsync_dir(parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def prepare_parent(path: str, what: str) -> str:
    """The folder `path` will be written in, made if needed; a CheckpointError when it cannot be."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise CheckpointError(f"a {what} path must be a folder path, got {path!r}")
    path = os.fspath(path)
    if os.path.isfile(path):
        raise CheckpointError(f"cannot write the {what} {path}: it is a file; a {what} is a folder, give a new path")
    from ..arguments import file_in_the_way
    parent = os.path.dirname(os.path.abspath(path))
    blocker = file_in_the_way(parent)
    if blocker is not None:
        raise CheckpointError(f"cannot write the {what} {path}: it lies under the file {blocker}")
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot write the {what} {path}: {e.strerror or e}") from e
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CheckpointError(f"cannot write the {what} {path}: the folder {parent} is not writable "
                              "(Permission denied); choose a folder you can write to")
    return parent


def write_failed(what: str, path: str, e: BaseException) -> CheckpointError:
    cause = (e.strerror if isinstance(e, OSError) and e.strerror
             else str(e).splitlines()[0] if str(e) else type(e).__name__)
    if (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "os error 28" in str(e):
        cause = f"the disk is full ({cause})"
    elif not isinstance(e, OSError):
        cause = f"the write failed (is the disk full?): {cause}"
    previous = f"the previous {what} there is untouched" if os.path.exists(path) else "nothing was written"
    return CheckpointError(f"cannot write the {what} {path}: {cause}; {previous}")
