"""Gradients into the host state: where each landed gradient goes (in place in its owner's buffer,
or staged and added), the sums of a step's micro-batches, the check of each sum as it lands (the
squared norm clipping needs, or a witness of finiteness), and what a dropped micro-batch gives back.

A part of HostState (runtime/host.py), kept here as one idea: it reads the state's slots, owners'
buffers, the running program's uses and the step's bookkeeping sets that HostState.__init__ makes.
"""
from __future__ import annotations

import math

import torch

from ..optim.fused_adamw import grad_sq_norm


class HostGradients:
    def enter_program(self, uses: dict[str, int], order: list[str] | None = None) -> None:
        """The next micro-batch runs a program whose backward gives these parameters a gradient,
        from this many stages each (engine/gradless.py checks it against the layout first), in
        `order` (data parallelism agrees on it across the ranks: distributed/shard.py)."""
        self.uses = uses

    def begin_micro_batch(self, first: bool, last: bool = True, norms: bool = False) -> None:
        """Gradients of the first micro-batch of a step overwrite the fp32 grads; later ones add.
        In the last one every landed sum is also checked (one more read of what was just
        written): inf and NaN survive every later addition, so checking once per step is enough.
        With `norms` the check is the squared norm clipping needs."""
        self._first, self._check, self._norms = first, last, norms
        self._partial = {}
        self._sq = {}
        self._in_copy = set()
        self._landed = set()
        self._got = set()
        if first:    # a step dropped after some micro-batches committed leaves their names here
            self._unfolded = set()
            self._reached, self._summed = set(), set()

    def commit_micro_batch(self) -> None:
        """The micro-batch succeeded: what it landed belongs to the step's gradients. The first
        micro-batch wrote the sum itself; a later one's gradients wait in `landing` and are added
        to the sum when the next micro-batch's gradient for the same parameter lands, or when the
        update comes (update_owner), whichever is first."""
        self._unfolded |= self._landed
        self._landed = set()
        self._summed |= self._got
        self._got = set()
        self._reached |= self.uses.keys()

    def resume_mid_step(self, reached: set[str]) -> None:
        """A checkpoint saved between micro-batches was loaded: its gradient sums are those of the
        parameters `reached` (the others' hold nothing of this step)."""
        self._reached, self._summed = set(reached), set(reached)
        self._got = set()

    def reached_owners(self) -> list[int]:
        """The owners holding a parameter that a committed micro-batch of the step reached."""
        return sorted({self.slots[n].owner for n in self._reached})

    def reached(self) -> set[str]:
        """The parameters the step's committed micro-batches reach (a checkpoint saved between
        them keeps this)."""
        return set(self._reached)

    def _fold(self, name: str) -> None:
        """grad += landing for `name`, if a committed micro-batch's gradient still waits there."""
        if name in self._unfolded:
            self._unfolded.discard(name)
            b = self.owners[self.slots[name].owner]
            self._grad_view(b.grad, name).add_(self._grad_view(b.landing, name))

    def landing_view(self, name: str, g: torch.Tensor) -> torch.Tensor | None:
        """Where the device gradient g of `name` may land as it is, with no host-side copy: its
        slot of the owner's grad buffer, when this is the step's only micro-batch (the landed value
        is the sum), the parameter has one use (a tied one sums its uses first), and the slot
        has g's dtype and shape. None otherwise (the gradient is staged, then added)."""
        slot = self.slots.get(name)
        if slot is None or not self._first or self.uses[name] != 1:
            return None
        buffers = self.owners[slot.owner]
        if buffers.landing is not buffers.grad or buffers.grad.dtype != g.dtype or tuple(g.shape) != slot.shape:
            return None
        if buffers.grad_in_copy:     # from here the copy holds a gradient: a dropped step restores it
            self._in_copy.add(slot.owner)
        return self._grad_view(buffers.grad, name)

    def offload_grads(self, backend, names: list[str], grads: list[torch.Tensor], stage: str, after=None):
        """A stage's device gradients (of the parameters `names`) to the host, added into the step's
        sums there; returns the offload's event. Data parallelism sums them across the ranks first
        and offloads only this rank's (distributed/shard.py), `after` that sum."""
        def sink(host_grads: list[torch.Tensor]) -> None:
            for name, g in zip(names, host_grads):
                self.accumulate_grad(name, g)
        dsts = [self.landing_view(name, g) for name, g in zip(names, grads)]
        return backend.offload(grads, sink, f"offload {stage}", dsts=dsts, after=after)

    def accumulate_grad(self, name: str, g: torch.Tensor) -> None:
        """Add one stage's gradient for `name`. A parameter used by several stages (tied
        weights) sums its contributions of the micro-batch first, then adds that sum to the
        accumulated gradient: the order eager autograd rounds in."""
        uses = self.uses[name]
        if uses > 1:
            seen, partial = self._partial.get(name, (0, None))
            if partial is None:
                partial = g.to(torch.float32, copy=True)
            else:
                partial.add_(g)
            if seen + 1 < uses:
                self._partial[name] = (seen + 1, partial)
                return
            self._partial.pop(name, None)
            g = partial
        self._add_to_sum(name, g)

    def _add_to_sum(self, name: str, g: torch.Tensor) -> None:
        """Add the micro-batch's gradient for `name` (every use's, summed) into the step's sum."""
        slot = self.slots[name]
        buffers = self.owners[slot.owner]
        if buffers.grad_in_copy:
            self._in_copy.add(slot.owner)
        self._got.add(name)
        if self._first or name not in self._summed:
            # The sum itself: the step's first micro-batch to reach `name` starts it from this
            # gradient (what the buffer held is an older step's); a failed micro-batch leaves
            # nothing worth keeping there.
            flat = self._grad_flat(buffers.grad, name)
            if g.data_ptr() != flat.data_ptr():      # else it landed in place (landing_view)
                flat.view(slot.shape).copy_(g)
            if self._check:
                self._sq[name] = grad_sq_norm(flat) if self._norms else _finite_witness(flat)
            return
        self._fold(name)        # the committed sum is complete before this micro-batch adds to it
        self._grad_view(buffers.landing, name).copy_(g)
        self._landed.add(name)
        if self._check:   # the sum this micro-batch makes, grad + landing, as AdamW will read it
            grad = self._grad_flat(buffers.grad, name)
            landing = self._grad_flat(buffers.landing, name)
            check = grad_sq_norm if self._norms else _finite_witness
            self._sq[name] = sum(check(torch.add(grad[i:i + _CHECK_SLICE], landing[i:i + _CHECK_SLICE]))
                                 for i in range(0, slot.numel, _CHECK_SLICE))


    def restore_copies(self) -> None:
        """The micro-batch was dropped: the compute copies its gradients landed in get their
        weights back from the masters (no update of those owners can be running: the plan waited
        for each before the prefetch that preceded its gradients)."""
        with torch.no_grad():
            for owner in sorted(self._in_copy):
                b = self.owners[owner]
                master = self.disk.read(owner, "master") if b.master is None else b.master
                b.compute.copy_(master)
        self._in_copy = set()

    def grad_sq_norm(self) -> float:
        """Sum of squares of the step's accumulated fp32 gradients (float64 accumulation), taken
        as they landed in the step's last micro-batch (begin_micro_batch(norms=True)); a parameter
        no micro-batch reached has no gradient and no part in it (as under clip_grad_norm_)."""
        self.complete_checks()
        return sum(self._sq.values())

    def nonfinite_grads(self) -> list[str]:
        """Parameters whose accumulated gradient holds an inf or NaN."""
        self.complete_checks()
        return [name for name, sq in self._sq.items() if not math.isfinite(sq)]

    def complete_checks(self) -> None:
        """In the step's last micro-batch: the check of each sum an earlier micro-batch made and
        this one did not add to (its program does not reach the parameter)."""
        if not self._check:
            return
        for name in sorted((self._summed | self._got) - self._sq.keys()):
            self._fold(name)
            flat = self._grad_flat(self.owners[self.slots[name].owner].grad, name)
            self._sq[name] = grad_sq_norm(flat) if self._norms else _finite_witness(flat)

    @property
    def checks(self) -> dict[str, float]:
        """The running micro-batch's check of each gradient it landed (see `_sq`); the next
        micro-batch starts a new dict, so one taken here stays that micro-batch's."""
        return self._sq

    def nonfinite_in(self, owner: int, checks: dict[str, float]) -> list[str]:
        """The owner's parameters whose landed gradient holds an inf or NaN, by `checks`."""
        return [n for n in self._by_owner.get(owner, []) if n in checks and not math.isfinite(checks[n])]


# The check of a later micro-batch's sum works in slices of this many elements (64 MiB of fp32).
_CHECK_SLICE = 1 << 24


def _finite_witness(flat: torch.Tensor) -> float:
    """0.0 if every value is finite, else inf. A float32 sum is finite only if every term is (an
    inf or NaN term makes it inf or NaN), so one vectorized read decides almost always (~6x
    faster here than the float64 squared norm, ~20x than isfinite().all()); only a sum that
    overflowed from finite values needs the exact second look."""
    if math.isfinite(float(flat.sum())) or bool(torch.isfinite(flat).all()):
        return 0.0
    return math.inf
