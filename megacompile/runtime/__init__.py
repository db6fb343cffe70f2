"""The runtime: executes a plan on a backend. It decides nothing the plan did not say."""
from __future__ import annotations

import torch

from ..errors import MegacompileError
from .backend import Backend, Span, Timeline
from .executor import Executor
from .host import HostState


def make_backend(device: str | torch.device | None, budget_bytes: int) -> Backend:
    """`cuda` when a GPU is there (or asked for), else `cpu`, the simulated device."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cpu":
        from .cpu import CpuBackend
        return CpuBackend(budget_bytes)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise MegacompileError("device='cuda' was asked for but torch sees no GPU; use device='cpu' "
                                   "(the simulated device) or install a CUDA build of torch")
        from .cuda import CudaBackend
        return CudaBackend(budget_bytes, device)
    raise MegacompileError(f"device must be 'cuda' or 'cpu', got {device}")


__all__ = ["Backend", "Executor", "HostState", "Span", "Timeline", "make_backend"]
