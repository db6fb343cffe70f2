"""Page-locked host memory at exact sizes: the host buffers the device copies from and into.

torch's pinned allocator rounds each block up to a power of two and keeps it (a 4.5 GB block
would take 8 GB), so host buffers the device reads are allocated pageable and registered with
CUDA in place, at their own size; a registration that fails leaves CUDA's error state clean.
"""
from __future__ import annotations

import weakref

import torch


def pinned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Page-locked host memory of exactly numel elements: the buffers the device copies from.

    torch's pinned allocator rounds each block up to a power of two (a 4.5 GB block would take
    8 GB), so the memory is allocated pageable and registered with CUDA at its exact size; if
    registration fails, the pinned allocator is used instead.
    """
    t = torch.empty(numel, dtype=dtype)
    if t.numel() and torch.cuda.is_available():
        if register_host(t):
            return t
    return torch.empty(numel, dtype=dtype, pin_memory=True)


def register_host(t: torch.Tensor) -> bool:
    """Page-lock t's memory in place; False (and CUDA's error state clean) when that fails."""
    cudart = torch.cuda.cudart()
    # cudaHostRegisterPortable: page-locked for every device's context, not only the current one
    # (host state is made before a step makes the engine's device current).
    status = cudart.cudaHostRegister(t.data_ptr(), t.untyped_storage().nbytes(), 1)
    if int(status) != 0:
        # A failed runtime call leaves its error as CUDA's "last error", which the next kernel
        # launch check would report as its own; read it here to clear it.
        clear_cuda_error(cudart)
        return False
    # Unregister when the tensor goes away (views keep it alive through ._base), before its
    # memory returns to the allocator.
    weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())
    return True


def clear_cuda_error(cudart) -> None:
    """cudaGetLastError, which resets the calling thread's error state. torch's cudart module does
    not bind it; the libcudart torch loaded does (found in this process's mappings)."""
    get = getattr(cudart, "cudaGetLastError", None)
    if get is None:
        import ctypes
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
        if not paths:
            return    # cudart linked statically into torch: its state is out of reach
        get = ctypes.CDLL(sorted(paths)[0]).cudaGetLastError
    get()
