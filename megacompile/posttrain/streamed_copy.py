"""A generation copy that streams its decoder layers: `StreamedHFGenerator` is `HFGenerator`
(transformers' generate with a key-value cache on a copy of the policy in `dtype`) whose decoder
layers live in host memory, pinned on cuda, and visit the device one at a time.

A forward pre-hook on layer i makes sure its weights are on the device (copied then, or waited for
when they were prefetched) and starts copying layer i + 1's; the forward hook on layer i points its
parameters back at their host tensors, which drops the device copy. On cuda the prefetch runs on a
side stream: the compute stream waits for its event before the layer runs, and each device copy is
marked used by the compute stream (`record_stream`) so the allocator does not reuse it early.
Device memory held at once: the resident parts (embeddings, final norm, head, buffers), at most
two decoder layers (the one running and the next), and the key-value cache, which stays on the
device. Every layer crosses the host link once per forward, so each new token moves the layers'
bytes once: slow, but the copy's size is bounded by host memory, not the device's.

The decoder layers are the modules whose class the model names in `_no_split_modules` (transformers'
own list of blocks that must stay whole on one device). Between forwards every parameter is its
host tensor, so `sync()` writes the masters into host memory and the next forward moves them.
"""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

from ..errors import ArgumentError
from .hf_generator import HFGenerator


class HostToDevice:
    """Copies to a device with no streams of its own (the cpu backend's): at once, in order. On
    the cpu device `copy` returns the host tensor itself: nothing is duplicated."""

    def __init__(self, device: torch.device):
        self.device = device

    def host_tensor(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def copy(self, host: torch.Tensor) -> torch.Tensor:
        return host.to(self.device, non_blocking=True)

    def load(self, hosts: list[torch.Tensor], prefetch: bool) -> tuple[list[torch.Tensor], object]:
        """The device copies of `hosts` and what the compute stream waits on before using them."""
        return [self.copy(h) for h in hosts], None

    def wait(self, ready) -> None:
        pass

    def release(self, tensors: list[torch.Tensor]) -> None:
        pass


class CudaHostToDevice(HostToDevice):
    """Pinned host tensors; a prefetch is copied on a side stream and waited for by an event."""

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.side = torch.cuda.Stream(device)

    def host_tensor(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype).pin_memory()

    def load(self, hosts, prefetch):
        if not prefetch:        # needed now: copied on the compute stream, in its order
            return [self.copy(h) for h in hosts], None
        # the side stream must not copy before the compute stream reaches this point (the layers
        # before it may still be reading memory the allocator hands the copy)
        reached = torch.cuda.Event()
        reached.record(torch.cuda.current_stream(self.device))
        self.side.wait_event(reached)
        with torch.cuda.stream(self.side):
            tensors = [self.copy(h) for h in hosts]
            ready = torch.cuda.Event()
            ready.record(self.side)
        return tensors, ready

    def wait(self, ready) -> None:
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)

    def release(self, tensors) -> None:
        compute = torch.cuda.current_stream(self.device)
        for t in tensors:
            t.record_stream(compute)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers in order: the outermost modules of a class it lists in
    `_no_split_modules`."""
    kinds = set(getattr(model, "_no_split_modules", None) or ())
    layers, inside = [], ()
    for name, module in model.named_modules():
        if type(module).__name__ in kinds and not any(name.startswith(p) for p in inside):
            layers.append(module)
            inside += (name + ".",)
    if not layers:
        raise ArgumentError(f"a streamed copy moves the model's decoder layers one at a time, and "
                            f"{type(model).__name__} names none (its _no_split_modules is {sorted(kinds)}): use "
                            "generator hf (the whole copy on the device) or engine")
    return layers


class LayerStreamer:
    """The hooks that bring each layer's parameters to the device for its forward and back after."""

    def __init__(self, layers: list[nn.Module], moves: HostToDevice):
        self.moves = moves
        self.params = [list(layer.parameters()) for layer in layers]
        self.host = [[p.data for p in params] for params in self.params]
        self.ready: dict[int, object] = {}      # layer -> its copy's event, while on the device
        self.handles = []
        for i, layer in enumerate(layers):
            self.handles.append(layer.register_forward_pre_hook(partial(self._before, i)))
            self.handles.append(layer.register_forward_hook(partial(self._after, i)))

    def _load(self, i: int, prefetch: bool) -> None:
        tensors, self.ready[i] = self.moves.load(self.host[i], prefetch)
        for p, t in zip(self.params[i], tensors):
            p.data = t

    def _before(self, i: int, module, args) -> None:
        if i not in self.ready:
            self._load(i, prefetch=False)
        self.moves.wait(self.ready[i])
        if i + 1 < len(self.params) and i + 1 not in self.ready:
            self._load(i + 1, prefetch=True)

    def _after(self, i: int, module, args, output) -> None:
        self._unload(i)

    def _unload(self, i: int) -> None:
        if i not in self.ready:
            return
        del self.ready[i]
        self.moves.release([p.data for p in self.params[i]])
        for p, host in zip(self.params[i], self.host[i]):
            p.data = host

    def unload_all(self) -> None:
        """Every layer back to its host tensors (after a forward that stopped half way)."""
        for i in list(self.ready):
            self._unload(i)


class StreamedHFGenerator(HFGenerator):
    def _moves(self) -> HostToDevice:
        return (CudaHostToDevice if self.device.type == "cuda" else HostToDevice)(self.device)

    def _fill(self) -> None:
        self.mover = self._moves()
        owners = {id(m) for m in decoder_layers(self.model)}
        self.layer_prefixes = tuple(f"{n}." for n, m in self.model.named_modules() if id(m) in owners)
        super()._fill()

    def _tensor(self, name, shape, dtype):
        """A decoder layer's parameter in host memory (pinned on cuda); the rest on the device."""
        if name.startswith(self.layer_prefixes):
            return self.mover.host_tensor(shape, dtype)
        return super()._tensor(name, shape, dtype)

    def _place(self) -> None:
        """Buffers to the device (the layers' too: small); parameters stay where `_tensor` put them."""
        for module in self.model.modules():
            for key, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[key] = buffer.to(self.device)
        self.model.eval()
        self.streamer = LayerStreamer(decoder_layers(self.model), self.mover)

    def generate(self, prompts, n, max_new_tokens, temperature=1.0, inputs=None):
        try:
            return super().generate(prompts, n, max_new_tokens, temperature, inputs)
        finally:
            self.streamer.unload_all()
