"""The host heap: freed memory handed back to the operating system, and the resident set measured.

The cpu backend's device is host memory, so a step's device tensors are ordinary heap blocks.
glibc keeps freed blocks for reuse, and it raises its mmap threshold each time a large block is
freed (up to 32 MiB on 64-bit), so after a step the process can keep most of the step's device
peak resident although nothing holds it: the host resident set then overstates the host state
by up to the device budget (2-3 B/param for a 134M Llama at a roomy budget). A GPU's memory never
appears there, so the simulated device gives its memory back when the step ends: malloc_trim(0),
only when the heap holds enough free bytes to matter (it costs ~10 ms over a few GiB of heap).
Elsewhere than glibc this does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util

# Free heap bytes below which a trim is not worth its cost.
TRIM_ABOVE = 16 * 2 ** 20


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "malloc_trim"):
        return None
    if hasattr(libc, "mallinfo2"):
        libc.mallinfo2.restype = _Mallinfo2
    return libc


_LIBC = _libc()


def free_heap_bytes() -> int | None:
    """Bytes glibc holds free in its heaps (mallinfo2's fordblks, every arena); None where unknown."""
    if _LIBC is None or not hasattr(_LIBC, "mallinfo2"):
        return None
    return int(_LIBC.mallinfo2().fordblks)


def give_back_freed() -> bool:
    """Return the heap's free pages to the operating system when there are enough of them to
    matter; True when a trim ran."""
    if _LIBC is None:
        return False
    free = free_heap_bytes()
    if free is not None and free < TRIM_ABOVE:
        return False
    _LIBC.malloc_trim(0)
    return True


def resident_set_bytes() -> int | None:
    """The process's resident set now (Linux: /proc/self/status VmRSS); None where unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
