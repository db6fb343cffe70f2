"""Pages of a memory-mapped file given back once their tensor has been copied out.

torch.load(mmap=True) maps a whole file; every page a copy touches stays in the process's resident
set until the mapping closes, so a file read tensor by tensor into the host state would, by its
last tensor, be held in full beside it (8 bytes per parameter for a Trainer's optimizer.pt, over
half of the host state again). madvise(MADV_DONTNEED) drops a range's pages from the resident set:
a file-backed page is read from the file again if touched again, so dropping the pages around a
tensor never changes what any tensor of the mapping reads. It must never be called on anonymous
memory (a tensor the process made), whose dropped pages would read back as zeros: callers pass
only tensors that view the mapping.
"""
from __future__ import annotations

import ctypes
import mmap
import sys

import torch

_PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4      # Linux's value
_libc = None


def _madvise():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return _libc.madvise


def drop(t: torch.Tensor) -> bool:
    """Drop the resident pages under the storage of the file-mapped tensor `t` (whole pages around
    it). False where nothing was dropped: not Linux, an empty storage, or madvise refused (the
    pages then stay until the mapping closes, as without this)."""
    storage = t.untyped_storage()
    if not sys.platform.startswith("linux") or storage.nbytes() == 0 or t.device.type != "cpu":
        return False
    start = storage.data_ptr() // _PAGE * _PAGE
    end = -(-(storage.data_ptr() + storage.nbytes()) // _PAGE) * _PAGE
    return _madvise()(start, end - start, _MADV_DONTNEED) == 0


def drop_view(t: torch.Tensor) -> bool:
    """drop() for the pages under the contiguous view `t` alone (whole pages around it), not its
    whole storage: a large mapped tensor copied out a piece at a time gives back each piece's pages."""
    if not sys.platform.startswith("linux") or t.numel() == 0 or t.device.type != "cpu" or not t.is_contiguous():
        return False
    start = t.data_ptr() // _PAGE * _PAGE
    end = -(-(t.data_ptr() + t.numel() * t.element_size()) // _PAGE) * _PAGE
    return _madvise()(start, end - start, _MADV_DONTNEED) == 0
