"""Engines that take turns on one device: a post-training reference model beside its policy.

A second engine made with compile(..., share_device=policy) runs on the policy's backend: the same
budget, streams and device arena (runtime/arena.py: every plan of the device serves from one
arena, the largest plan's), so the two together hold what one plan of them says, never two
budgets. They take turns: one lock serves both, and a call on either while the other runs is
refused as a second thread's would be. The host budget is the machine's, so each engine's host
state is placed in what the others' leave. The engine that made the device owns it: its close()
stops the streams, after which the others refuse to run.
"""
from __future__ import annotations

import threading
import weakref

from ..errors import ArgumentError
from ..ir.printer import fmt_bytes
from ..runtime import normalize_device


class SharedDevice:
    """One device's backend, its lock, and the engines on it."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.lock = threading.Lock()
        self.closed = False            # the owner closed: its streams are stopped
        self.engines: "weakref.WeakSet" = weakref.WeakSet()

    def host_taken(self, engine) -> int:
        """Host bytes the other engines' plans say they hold (their states and offloaded activations)."""
        return sum(e.host_plan_bytes() for e in list(self.engines) if e is not engine)

    def host_room(self, engine, budget: int) -> tuple[int, str]:
        """The host budget `engine`'s state is placed in, and a note naming what the others take ('':
        nothing)."""
        taken = self.host_taken(engine)
        if not taken:
            return budget, ""
        return max(0, budget - taken), (f" (the host budget {fmt_bytes(budget)} less {fmt_bytes(taken)} that the "
                                        "engines sharing its device hold)")


def join(owner, budget_bytes: int, device, data_parallel) -> SharedDevice:
    """The owner's device for an engine compiled with share_device=owner: refused unless the budget
    and device agree and the owner still runs."""
    shared = getattr(owner, "device_share", None)      # an Engine's (this module is below engine.py)
    if not isinstance(shared, SharedDevice):
        raise ArgumentError(f"share_device takes the Engine whose device this one runs on, got {type(owner).__name__}")
    if shared.closed:
        raise ArgumentError("share_device: that engine is closed (its streams are stopped); share the device of an "
                            "open engine")
    if budget_bytes != owner.budget_bytes:
        raise ArgumentError(f"share_device: the device's budget is {fmt_bytes(owner.budget_bytes)}, the one hbm_budget "
                            f"of both engines; got {fmt_bytes(budget_bytes)}: give the same hbm_budget")
    if device is not None and normalize_device(device) != owner.device:
        raise ArgumentError(f"share_device: that engine runs on {owner.device}, this one was given device={device}; "
                            "leave device out or give the same one")
    if data_parallel is not None or owner.data_parallel is not None:
        raise ArgumentError("share_device is not supported with data parallelism: each rank compiles its own engine")
    return shared
