"""Durable directories: written under a temporary name, fsynced, renamed into place.

A folder being written is `.<name>.<pid>.partial` beside its final name (`.old`: the folder it
replaces, moved aside; `.removed`: one being deleted). A process killed mid-write leaves one
behind; the next save or load in that parent folder removes those whose writer is gone (a live
pid is another writer's, and is left alone), and puts a folder moved aside back where its
replacement never arrived: a committed folder (one holding `COMMITTED`) is at its name or, for
the moment between two renames, moved aside beside it; never nowhere.

Files replaced inside a folder the user owns (replace_files: a model export beside a README or a
`.git/`) are staged in `.export.<pid>.partial` inside it; once complete it becomes
`.export.<pid>.ready` (the replacement is decided), the files it replaces go to
`.export.<pid>.replaced`, the staged ones are renamed into place, and both are removed. The next
replacement in that folder finishes one whose writer was killed (recover_files).
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import time

from ..errors import CheckpointError
from ..ir import fmt_bytes

MARKER = "COMMITTED"    # a folder holding it is complete (io/checkpoint.py writes it last, before its rename)
_PARTIAL = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.(partial|old|removed)$")
_STAGED = re.compile(r"^\.export\.(?P<pid>\d+)\.(?P<state>partial|ready|replaced)$")
_PLAN = ".plan.json"    # in a ready staging folder: the files it brings and the files it replaces
_CHUNK = 8 << 20     # bytes per read when hashing: a fixed buffer, so hashing adds no resident memory


def partial_path(path: str) -> str:
    parent, name = os.path.split(os.path.abspath(path))
    return os.path.join(parent, f".{name}.{os.getpid()}.partial")


def clean_leftovers(parent: str) -> list[str]:
    """Remove the partial folders of writers that are gone (killed mid-save); returns them. A
    folder moved aside for a replacement that never arrived goes back to its name (and a committed
    one also where an uncommitted folder took its name)."""
    removed = []
    with contextlib.suppress(OSError):
        for entry in sorted(os.listdir(parent), key=lambda e: not e.endswith(".old")):   # put back first
            m = _PARTIAL.match(entry)
            if m is None or (int(m["pid"]) != os.getpid() and _alive(int(m["pid"]))):
                continue
            final, full = os.path.join(parent, m["name"]), os.path.join(parent, entry)
            if entry.endswith(".old") and _put_back(full, final):
                continue
            shutil.rmtree(full, ignore_errors=True)
            removed.append(entry)
    return removed


def _put_back(aside: str, final: str) -> bool:
    """A folder moved aside by a replacement cut short goes back to `final` if nothing is there, or
    if it is committed and what is there is not (left by a writer that committed after its rename)."""
    if os.path.lexists(final):
        if not committed(aside) or committed(final):
            return False
        parent, name = os.path.split(final)
        trash = os.path.join(parent, f".{name}.{os.getpid()}.removed")
        os.rename(final, trash)
        os.rename(aside, final)
        fsync_dir(parent)
        shutil.rmtree(trash, ignore_errors=True)
        return True
    os.rename(aside, final)
    fsync_dir(os.path.dirname(final))
    return True


def committed(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, MARKER))


def settle(path: str, wait: float = 5.0) -> None:
    """Before reading the folder `path`: a replacement of it cut short is undone (clean_leftovers),
    and one under way, whose folder is moved aside for the instant between its two renames, is
    waited for; if its new folder never arrives (the writer is stopped), the committed folder
    moved aside goes back to `path` (the writer's own rename then fails, and its save with it)."""
    parent, name = os.path.split(os.path.abspath(path))
    deadline = time.monotonic() + wait
    while True:
        clean_leftovers(parent)
        if os.path.lexists(path):
            return
        aside = [os.path.join(parent, e) for e in _listdir(parent) if _aside_of(e) == name]
        aside = [a for a in aside if committed(a)]
        if not aside:
            return
        if time.monotonic() > deadline:
            with contextlib.suppress(OSError):
                _put_back(aside[0], path)
            return
        time.sleep(0.01)


def _aside_of(entry: str) -> str | None:
    """The name of the folder `entry` was moved aside from, if it is one (`.<name>.<pid>.old`)."""
    m = _PARTIAL.match(entry)
    return m["name"] if m is not None and entry.endswith(".old") else None


def _listdir(folder: str) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


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
    with open(path, "w", encoding="utf-8") as f:     # whatever the locale: the readers read UTF-8
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def replace_text(path: str, text: str) -> None:
    """The file `path` replaced whole by `text`: written and fsynced as `path`.tmp, then renamed
    over it, so that a reader, or a run killed meanwhile, finds the old file or the new one, never
    part of one."""
    tmp = path + ".tmp"
    try:
        write_text(tmp, text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def rename_into_place(tmp: str, path: str) -> None:
    """Atomically put the finished folder `tmp` at `path`. A folder already there is moved aside
    first and removed after: a crash between the two renames leaves it as `.<name>.<pid>.old` with
    nothing at `path`, which the next save or load puts back (clean_leftovers); a crash after them,
    which the next save or load removes. A folder committed before this (COMMITTED in `tmp`) is thus
    committed at every instant, at `path` or beside it."""
    parent = os.path.dirname(os.path.abspath(path))
    aside = None
    if os.path.lexists(path):
        aside = os.path.join(parent, f".{os.path.basename(os.path.abspath(path))}.{os.getpid()}.old")
        os.rename(path, aside)
    try:
        os.rename(tmp, path)
    except BaseException:
        if aside is not None and not os.path.lexists(path):
            os.rename(aside, path)        # the new one cannot take its place: the old one stays
        raise
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


def write_failed(what: str, path: str, e: BaseException, needed: int | None = None) -> CheckpointError:
    """The error of a write that failed, its partial folder already removed. needed: the bytes the
    write takes, named beside the folder's free space when the disk is full."""
    cause = (e.strerror if isinstance(e, OSError) and e.strerror
             else str(e).splitlines()[0] if str(e) else type(e).__name__)
    if (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "os error 28" in str(e):
        cause = f"the disk is full ({cause})"
        if needed is not None:
            folder = os.path.dirname(os.path.abspath(path))
            free = shutil.disk_usage(folder).free
            cause += f": the {what} needs about {_amount(needed)} and {folder} has {_amount(free)} free; " + (
                f"free {_amount(needed - free)} or more there" if free < needed
                else "free space there (a quota or another writer may have taken it)") + ", or write it to another disk"
    elif not isinstance(e, OSError):
        cause = f"the write failed (is the disk full?): {cause}"
    previous = f"the previous {what} there is untouched" if os.path.exists(path) else "nothing was written"
    return CheckpointError(f"cannot write the {what} {path}: {cause}; {previous}")


def _amount(n: int) -> str:
    return f"{fmt_bytes(n)} ({n:,} bytes)"


def replace_files(folder: str, write, replaced: list[str]) -> None:
    """Put the files that write(staging) makes into `folder`, replacing those named in `replaced`
    (the ones of the same names and any others that must go), and touching nothing else in it.

    They are written and fsynced in `.export.<pid>.partial` inside `folder` (a failure or a kill
    there leaves the folder as it was); then the staging folder becomes `.export.<pid>.ready`
    (decided: a kill from here on is finished by the next replacement in this folder, see
    recover_files), the replaced files are moved to `.export.<pid>.replaced`, the new ones
    renamed into place, and both staging folders removed."""
    pid = os.getpid()
    staging = os.path.join(folder, f".export.{pid}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    try:
        write(staging)
        new = sorted(os.listdir(staging))
        write_text(os.path.join(staging, _PLAN), json.dumps({"new": new, "replaced": sorted(replaced)}))
        fsync_dir(staging)
        ready = os.path.join(folder, f".export.{pid}.ready")
        os.rename(staging, ready)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    fsync_dir(folder)
    _finish(folder, ready)


def _finish(folder: str, ready: str) -> None:
    """Carry out the decided replacement `ready` (fresh, or left half done by a killed writer):
    each replaced file still in `folder` is moved aside (one whose name a new file took already is
    that new file: every replaced file goes before any new one comes), the new files are renamed
    into place, then what was replaced and the staging folder are removed."""
    with open(os.path.join(ready, _PLAN)) as f:
        plan = json.load(f)
    aside = ready[:-len(".ready")] + ".replaced"
    os.makedirs(aside, exist_ok=True)
    for name in plan["replaced"]:
        here = os.path.join(folder, name)
        if os.path.lexists(here) and (name not in plan["new"] or os.path.lexists(os.path.join(ready, name))):
            os.rename(here, os.path.join(aside, name))
    for name in plan["new"]:
        if os.path.lexists(os.path.join(ready, name)):
            os.rename(os.path.join(ready, name), os.path.join(folder, name))
    fsync_dir(folder)
    shutil.rmtree(ready, ignore_errors=True)
    shutil.rmtree(aside, ignore_errors=True)


def recover_files(folder: str) -> None:
    """The staging folders of replace_files whose writer is gone: an unfinished one is removed
    (the folder is as it was), a decided one is finished, what it replaced removed."""
    entries = sorted(_listdir(folder), key=lambda e: not e.endswith(".ready"))
    for entry in entries:
        m = _STAGED.match(entry)
        if m is None or (int(m["pid"]) != os.getpid() and _alive(int(m["pid"]))):
            continue
        full = os.path.join(folder, entry)
        if m["state"] == "ready" and os.path.isfile(os.path.join(full, _PLAN)):
            _finish(folder, full)
        else:
            shutil.rmtree(full, ignore_errors=True)
