"""An engine's threads end before the interpreter does, and when the engine is dropped.

step() returns while its AdamW update still runs on the host stream (that is the overlap). A
script that ends right there leaves the update running on a daemon thread while Python finalises:
the thread is stopped inside torch's C++ code (SIGABRT, "terminate called without an active
exception") and the update is cut off half-way. So each open backend is drained (its queued work
finishes) and its threads joined:

- at interpreter exit, in threading's own exit hooks: those run before atexit and in reverse order
  of registration, so ours (registered at the first engine) runs before concurrent.futures joins
  its pools, whose refusal of new work would fail a disk-tier update still in flight;
- when an engine is garbage-collected without close() (Engine's weakref.finalize);
- at close(), through that same finalizer, so nothing runs twice.

Errors of the drained work are not raised here: they belong to the step that queued the work, and
at exit or in a finalizer nobody is left to catch them.
"""
from __future__ import annotations

import atexit
import threading
import weakref

from .backend import Backend
from .stream import on_stream_thread

_open: "weakref.WeakSet[Backend]" = weakref.WeakSet()
_lock = threading.Lock()
_hooked = False


def watch(backend: Backend) -> None:
    """The backend is drained and closed at exit unless end() has closed it first."""
    global _hooked
    with _lock:
        _open.add(backend)
        if not _hooked:
            # threading._register_atexit is what concurrent.futures uses; older Pythons lack it.
            getattr(threading, "_register_atexit", atexit.register)(end_all)
            _hooked = True


def end(backend: Backend) -> None:
    """Let the backend's queued work finish, then stop its threads. Once per backend."""
    with _lock:
        if backend not in _open:
            return
        _open.discard(backend)
    if on_stream_thread():
        # A dropped engine's last reference can go on one of its own streams (the update that
        # held it finished there): that thread cannot wait for itself, so another one ends it.
        threading.Thread(target=_drain_and_close, args=(backend,), name="megacompile-end").start()
    else:
        _drain_and_close(backend)


def _drain_and_close(backend: Backend) -> None:
    try:
        backend.synchronize(host=True)
    except Exception:   # noqa: BLE001 - a failed stream still has to be closed; see the module note
        pass
    backend.close()


def end_all() -> None:
    for backend in list(_open):
        end(backend)
