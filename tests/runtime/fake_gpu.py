"""A stand-in for torch.cuda that runs the cuda backend's own code on the CPU: device tensors are
host tensors, streams and events record what was asked of them, in one ordered log.

The copies run at once (the CPU has no queue), so results are exact; what the log shows is the
order the backend asked for: which stream waited on which event before what."""
from __future__ import annotations

import contextlib
import ctypes
import itertools
from types import SimpleNamespace

import torch

GiB = 2 ** 30


class FakeStream:
    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def wait_event(self, event) -> None:
        self.log.append(("wait", self.name, event.id))

    def synchronize(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


class FakeEvent:
    ids = itertools.count()

    def __init__(self, log: list, enable_timing: bool = False):
        self.log, self.id, self.stream = log, next(self.ids), None

    def record(self, stream=None) -> None:
        self.stream = stream
        self.log.append(("record", stream.name, self.id))

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


class FakeGpu:
    """Installed with install(monkeypatch); `log` holds ("wait", stream, event id),
    ("record", stream, event id), ("record_stream", stream, data_ptr) and what tests add."""

    def __init__(self, retries: int = 0):
        self.log: list = []
        self.compute = FakeStream(self.log, "compute")
        self.current = [self.compute]
        self.settings: list[str] = []         # allocator settings asked for, in order
        self.fraction: list[float] = []
        self.retries = retries
        self.registered = 0                   # page-locked bytes registered

    def install(self, monkeypatch) -> "FakeGpu":
        cuda = torch.cuda
        names = itertools.count()
        for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
            monkeypatch.delenv(var, raising=False)
        patches = {
            "is_available": lambda: True, "device_count": lambda: 1, "current_device": lambda: 0,
            "get_device_properties": lambda d=None: SimpleNamespace(total_memory=80 * GiB, name="NVIDIA H100 80GB HBM3",
                                                                    major=9, minor=0, multi_processor_count=132),
            "set_per_process_memory_fraction": lambda f, device=None: self.fraction.append(f),
            "get_per_process_memory_fraction": lambda device=None: 1.0,
            "Stream": lambda device=None: FakeStream(self.log, f"side{next(names)}"),
            "Event": lambda enable_timing=False: FakeEvent(self.log, enable_timing),
            "stream": self._stream, "current_stream": lambda device=None: self.current[-1],
            "device": lambda d: contextlib.nullcontext(), "synchronize": lambda device=None: None,
            "memory_stats": lambda device=None: {"num_alloc_retries": self.retries},
            "max_memory_allocated": lambda device=None: 0, "max_memory_reserved": lambda device=None: 0,
            "reset_peak_memory_stats": lambda device=None: None,
            "get_rng_state": lambda device=None: torch.get_rng_state(),
            "set_rng_state": lambda state, device=None: torch.set_rng_state(state),
            "cudart": lambda: SimpleNamespace(cudaHostRegister=self._register, cudaHostUnregister=lambda ptr: 0),
            "empty_cache": lambda: self.log.append(("empty_cache",)),
        }
        for name, value in patches.items():
            monkeypatch.setattr(cuda, name, value, raising=False)
        monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", self.settings.append, raising=False)
        monkeypatch.setattr(torch.Tensor, "record_stream",
                            lambda t, stream: self.log.append(("record_stream", stream.name, t.data_ptr())))
        as_tensor = torch.as_tensor
        monkeypatch.setattr(torch, "as_tensor", lambda obj, *a, **k: (
            self._from_interface(obj) if hasattr(obj, "__cuda_array_interface__") else as_tensor(obj, *a, **k)))
        return self

    def _from_interface(self, obj) -> torch.Tensor:
        """What torch.as_tensor makes of an object with the CUDA array interface: a tensor over its
        pointer, not owning it (the device here is host memory). Checks the fields torch reads."""
        face = obj.__cuda_array_interface__
        assert face["version"] >= 2 and face["typestr"] == "|u1" and face["strides"] is None, face
        (nbytes,), (ptr, read_only) = face["shape"], face["data"]
        assert not read_only
        self.log.append(("interface", ptr, nbytes))
        return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)

    def _register(self, ptr, nbytes, flags) -> int:
        self.registered += nbytes
        return 0

    @contextlib.contextmanager
    def _stream(self, stream):
        self.current.append(stream)
        try:
            yield
        finally:
            self.current.pop()

    def backend(self, budget_bytes: int):
        """A CudaBackend whose device tensors are host tensors."""
        from megacompile.runtime import cuda
        backend = cuda.CudaBackend(budget_bytes, torch.device("cuda", 0))
        backend.device = torch.device("cpu")
        return backend
