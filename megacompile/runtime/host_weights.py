"""Values in and out of the host state: the checks a load makes before it writes anything, the load
into the masters, compute copies and frozen weights, and the module's tensors lent views of them
so the process holds one copy of the weights.

A part of HostState (runtime/host.py), kept here as one idea: it reads the state's slots, owners'
buffers, consts, borrowed names and disk tier, and its views (_view, source).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..errors import ArgumentError


class HostWeights:
    def load_problems(self, tensors: dict[str, torch.Tensor]) -> list[str]:
        """Everything that would make load() fail or load nonsense, found before it writes: not a
        tensor, on the meta device, a wrong shape, a dtype that does not cast (an integer tensor
        for a float weight), an inf or NaN, other values for a borrowed weight."""
        problems = []
        for name, t in tensors.items():
            own = (torch.empty(self.slots[name].shape, device="meta") if name in self.slots
                   else self.consts.get(name))
            if own is None:
                continue
            if not isinstance(t, torch.Tensor):
                problems.append(f"{name} is a {type(t).__name__}, not a tensor")
            elif t.is_meta:
                problems.append(f"{name} is on the meta device and holds no values")
            elif tuple(t.shape) != tuple(own.shape):
                problems.append(f"{name} has shape {tuple(t.shape)}, expected {tuple(own.shape)}")
            elif (t.is_floating_point() or t.is_complex()) != own.is_floating_point() or t.is_complex() \
                    or (t.dtype == torch.bool) != (own.dtype == torch.bool):
                problems.append(f"{name} has dtype {t.dtype}, expected {own.dtype}")
            elif t.is_floating_point() and not finite(t):
                problems.append(f"{name} holds inf or NaN")
            elif name in self.borrowed and not torch.equal(own, t.to(own.dtype)):
                problems.append(self._borrowed_differs(name))
        return problems

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy parameters into the masters (and the compute copies) and buffers into consts."""
        on_disk = self.disk is not None and self.disk.holds("master")
        with torch.no_grad():
            masters: dict[int, torch.Tensor] = {}     # owners whose masters are on disk, read once
            for name, t in tensors.items():
                if name in self.slots:
                    owner = self.slots[name].owner
                    if on_disk and owner not in masters:
                        masters[owner] = self.disk.read(owner, "master").clone()
                    self._view(masters[owner] if on_disk else self.owners[owner].master, name).copy_(t)
                    if self.owners[owner].compute is not self.owners[owner].master:
                        self.source(name).copy_(t)
                elif name in self.consts:
                    self.fill_const(name, self.consts[name], t)
            for owner, flat in masters.items():
                self.disk.write(owner, "master", flat)

    def fill_const(self, name: str, target: torch.Tensor, t: torch.Tensor) -> None:
        """`t` into `target` (a frozen weight or buffer, or a part of one); into a borrowed one only
        the check that it holds those values already."""
        if name not in self.borrowed:
            target.copy_(t)
        elif not torch.equal(target, t.to(target.dtype)):
            raise ArgumentError(self._borrowed_differs(name))

    @staticmethod
    def _borrowed_differs(name: str) -> str:
        return (f"frozen weight {name} differs from the one the engine it is shared with holds (share_frozen "
                "shares only weights both hold alike): compile without share_frozen")

    def load_module(self, model: nn.Module) -> None:
        self.load(dict(model.named_parameters()) | dict(model.named_buffers()))

    def lend_to_module(self, model: nn.Module) -> None:
        """Make the module's tensors views of this state, so the process holds one copy of the
        weights: an fp32 parameter becomes its master (or, with the master on disk, the fp32 compute
        copy), a parameter in the compute dtype the compute copy (the master rounded to it, as
        synchronize() would write it), a frozen weight or buffer its copy here. Each module
        tensor's own memory is freed as it goes (unless the caller still holds it); one of another
        dtype keeps its own, which the plan counts (cost/host_memory.py module_bytes). Called after
        the weights are loaded, before any update. A compute copy holds the step's gradients
        between their landing and the update: the module reads weights once updates are done
        (engine.synchronize(), model.state_dict())."""
        with torch.no_grad():
            for name, t in list(model.named_parameters()) + list(model.named_buffers()):
                if t.is_meta or t.device.type != "cpu":
                    continue
                if name in self.slots:
                    flat = self._lendable(name, t.dtype)
                    if flat is not None:
                        t.data = self._view(flat, name)
                elif name in self.consts and self.consts[name].dtype == t.dtype:
                    t.data = self.consts[name]

    def _lendable(self, name: str, dtype: torch.dtype) -> torch.Tensor | None:
        """The flat buffer of `name`'s owner that holds its weight in `dtype`, if one does."""
        buffers = self.owners[self.slots[name].owner]
        if buffers.master is not None and dtype == torch.float32:
            return buffers.master
        if buffers.compute is not None and buffers.compute is not buffers.master and buffers.compute.dtype == dtype:
            return buffers.compute
        return None

    def lent(self, name: str, t: torch.Tensor) -> bool:
        """Whether `t` (the module's tensor for `name`) is a view of this state (lend_to_module)."""
        if name in self.consts:
            return self.consts[name].data_ptr() == t.data_ptr()
        if name in self.slots:
            flat = self._lendable(name, t.dtype)
            return flat is not None and self._view(flat, name).data_ptr() == t.data_ptr()
        return False


def finite(t: torch.Tensor) -> bool:
    """No inf or NaN in the float tensor `t`, without a temporary of its size: torch.isfinite(t).all()
    makes a float copy and three masks (1.75x the tensor at its peak), while the min and the max carry
    a NaN and show an inf."""
    if t.numel() == 0:
        return True
    low, high = torch.aminmax(t.detach())
    return math.isfinite(float(low)) and math.isfinite(float(high))
