"""The runtime: executes a plan on a backend. It decides nothing the plan did not say."""
from __future__ import annotations

import torch

from ..errors import MegacompileError
from .backend import Backend, Span, Timeline
from .executor import Executor
from .host import HostState


def normalize_device(device: str | torch.device | None) -> torch.device:
    """The one device a backend runs on, with its index: `cuda` alone means the current GPU
    (torch.cuda calls such as set_per_process_memory_fraction refuse a device without one)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise MegacompileError(f"device must be 'cuda', 'cuda:N' or 'cpu', got {device!r}") from e
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise MegacompileError(f"device must be 'cuda' or 'cpu', got {device}")
    if not torch.cuda.is_available():
        raise MegacompileError("device='cuda' was asked for but torch sees no GPU; use device='cpu' "
                               "(the simulated device) or install a CUDA build of torch")
    index = torch.cuda.current_device() if device.index is None else device.index
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise MegacompileError(f"device {device} does not exist: torch sees {count} GPU(s), cuda:0 to cuda:{count - 1}")
    return torch.device("cuda", index)


def make_backend(device: str | torch.device | None, budget_bytes: int) -> Backend:
    """`cuda` when a GPU is there (or asked for), else `cpu`, the simulated device."""
    device = normalize_device(device)
    if device.type == "cpu":
        from .cpu import CpuBackend
        return CpuBackend(budget_bytes)
    from .cuda import CudaBackend
    return CudaBackend(budget_bytes, device)


__all__ = ["Backend", "Executor", "HostState", "Span", "Timeline", "make_backend", "normalize_device"]
