"""Host state sharded across ranks: each rank keeps the fp32 masters, AdamW moments and gradient
sums of its 1/R of the parameters; the ranks of a node share one whole compute copy (what their
devices fetch: node.py).

The shares are cut at parameter boundaries in the flat order of the owners' buffers (owner by
owner, parameter by parameter), so a rank's share of each owner is one contiguous range of that
owner's flat buffers (possibly empty), and a checkpoint keeps the model's own tensor names (each
rank writes whole tensors: distributed/checkpoint.py). With many parameters per rank the shares
are within one parameter of equal; a model of a few large tensors shares less evenly.

Per trainable parameter and rank, in host RAM: (master 4 + exp_avg 4 + exp_avg_sq 4 + fp32
gradient sum 4 [+ a landing buffer with grad_accum > 1]) / R; per node, once: the compute copy
(4 B fp32, 2 B bf16).

Every rank lays out every trainable parameter as rank 0's first program places it (those it does
not reach in its prologue's owner, as one process does: runtime/host.py), so the ranks hold the
same layout and shares whatever their first micro-batches reach.

One optimizer step: as the backward produces each stage's gradients they are summed over the
ranks on the device into the rank that holds each tensor, and divided by R there
(grad_reduce.py); only the holder's land on the host, in its range of the gradient buffers. A
parameter that only some ranks' programs reach (an image on one rank) is summed over the host
once the walk is done instead, zeros from the ranks that did not reach it (reach.py), and every
rank steps it. The global squared norm is the sum of the ranks' partial norms; each rank updates
its range of the masters and moments, writes the new weights into its range of its node's compute
copy, and the ranges then cross to the other nodes, owner by owner, on the host stream, before the
next step's prefetch of that owner (which waits for the owner's update: node.py).
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch

from ..capture import CapturedModel
from ..cost.host_memory import OwnerLayout, Placement
from ..errors import ArgumentError, MegacompileError
from ..runtime.host import HostState, OwnerBuffers
from ..disk.owner_state import UpdateFn
from . import reach
from .grad_reduce import reduce_to_holders
from .group import Ranks
from .node import NodeCopy

SHARDED = ("master", "exp_avg", "exp_avg_sq")


def shard_of(numels: list[int], ranks: int) -> list[int]:
    """The rank holding each tensor of a flat sequence of tensors of these sizes: contiguous runs,
    each rank's run as close to 1/ranks of the total as whole tensors allow (a tensor goes to the
    rank its midpoint falls in)."""
    total = sum(numels)
    out, start = [], 0
    for n in numels:
        out.append(min(ranks - 1, int((start + n / 2) * ranks // max(total, 1))))
        start += n
    return out


class ShardedHostState(HostState):
    def __init__(self, captured: CapturedModel, compute_dtype: torch.dtype, *, ranks: Ranks, pin: bool = False,
                 grad_accum: int = 1, placement: Placement = Placement(), nvme_dir: str | None = None):
        if placement.on_disk:
            raise ArgumentError("data parallelism keeps each rank's share of the host state in RAM; the disk tier "
                                "(nvme_dir) is not sharded: drop nvme_dir, or give each rank more host RAM")
        self.ranks = ranks
        self.holder: dict[str, int] = {}              # parameter -> the rank that holds its master and moments
        self.ranges: dict[int, list[tuple[int, int]]] = {}   # owner -> per rank, its [lo, hi) of the flat buffers
        self._global_sq = 0.0
        self.gathered: dict[str, torch.Tensor] = {}    # whole masters, while an export reads them
        self.node_copy: NodeCopy | None = None         # the compute copy this rank's node shares
        self._pin = pin                                # page-locked on the cuda backend
        # The running micro-batch's verdict (reach.py): what the ranks' programs reach, and the
        # gradients summed over the host once the walk is done.
        self.reach = reach.NOTHING_DEFERRED
        self.deferred = reach.DeferredGrads((), {})
        self._device_order: list[str] = []             # the names its device reduces come in, as agreed
        super().__init__(captured, compute_dtype, pin=pin, grad_accum=grad_accum, placement=placement,
                         nvme_dir=nvme_dir)

    def _lay_out(self, captured: CapturedModel, every_trainable: bool) -> tuple[dict[str, int], set[int]]:
        """Rank 0's layout on every rank (a collective): the ranks' first programs may differ (an
        image on one rank only), their layouts and shares may not."""
        mine = super()._lay_out(captured, every_trainable)
        return self.ranks.gather_objects(mine, "agreeing on the host state's layout")[0]

    def _cut(self) -> None:
        names = sorted(self.slots, key=lambda n: (self.slots[n].owner, self.slots[n].offset))
        holders = shard_of([self.slots[n].numel for n in names], self.ranks.size)
        for name, rank in zip(names, holders):
            self.holder[name] = rank
        for owner in {s.owner for s in self.slots.values()}:
            mine = [[math.inf, -math.inf] for _ in range(self.ranks.size)]
            for name, slot in self.slots.items():
                if slot.owner == owner:
                    r = mine[self.holder[name]]
                    r[0], r[1] = min(r[0], slot.offset), max(r[1], slot.offset + slot.numel)
            # an empty range sits where the next one starts
            ends = [0] * self.ranks.size
            for r in range(self.ranks.size):
                lo = mine[r][0] if mine[r][0] != math.inf else (ends[r - 1] if r else 0)
                ends[r] = mine[r][1] if mine[r][1] != -math.inf else lo
                mine[r] = (lo, ends[r])
            self.ranges[owner] = [tuple(r) for r in mine]
        numels: dict[int, int] = {}
        for slot in self.slots.values():
            numels[slot.owner] = numels.get(slot.owner, 0) + slot.numel
        self.node_copy = NodeCopy(self.ranks, numels, self.compute_dtype, self._pin)

    def _owner_buffers(self, owner: int, numel: int, compute_dtype: torch.dtype, pin: bool,
                       layout: OwnerLayout) -> OwnerBuffers:
        if not self.ranges:
            self._cut()
        # This rank's range of the fp32 gradient sum (and landing buffer): the device's summed
        # gradients of the tensors it holds land there (never in the compute copy, which every
        # rank reads whole). The compute copy is a view of the node's segment; then the share of
        # masters and moments.
        lo, hi = self.ranges[owner][self.ranks.rank]
        b = OwnerBuffers(hi - lo, compute_dtype, pin, replace(layout, master=False, moments=False, compute_copy=False,
                                                              grad_dtype=torch.float32, grad_in_copy=False))
        b.grad_lo = lo
        b.compute = self.node_copy.view(owner)
        b.master = torch.empty(hi - lo, dtype=torch.float32)
        b.exp_avg = torch.zeros(hi - lo, dtype=torch.float32)
        b.exp_avg_sq = torch.zeros(hi - lo, dtype=torch.float32)
        return b

    @property
    def state_bytes(self) -> int:
        """Bytes of the fp32 masters and AdamW moments this rank holds."""
        return sum(getattr(b, k).nbytes for b in self.owners.values() for k in SHARDED)

    @property
    def grad_bytes(self) -> int:
        """Bytes of the gradient buffers (the sum and the landing buffer) this rank holds."""
        return grad_bytes(self)

    @property
    def shared_bytes(self) -> int:
        """Bytes of the compute copy this rank's node shares (once per node)."""
        return self.node_copy.nbytes

    @property
    def nbytes(self) -> int:
        """This rank's host RAM: its own buffers and its 1/L part of the node's shared copy (L ranks
        per node), so that the ranks' figures add up to the node's."""
        segment = self.node_copy.segment.untyped_storage().data_ptr()
        own = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for b in self.owners.values()
               for t in (b.master, b.exp_avg, b.exp_avg_sq, b.grad, b.landing) if t is not None}
        own.pop(segment, None)
        consts = sum(t.untyped_storage().nbytes() for t in self.consts.values())
        return sum(own.values()) + consts + self.shared_bytes // len(self.node_copy.local)

    # -- views ---------------------------------------------------------------------------
    def mine(self, name: str) -> bool:
        return self.holder[name] == self.ranks.rank

    def view(self, buffer: str, name: str) -> torch.Tensor:
        """As HostState.view; masters and moments only of the parameters this rank holds."""
        if buffer in ("grad", "landing") and not self.mine(name):
            raise MegacompileError(f"the gradient of {name} is summed on rank {self.holder[name]}, not on rank "
                                   f"{self.ranks.rank}: read it there")
        if buffer not in SHARDED:
            return super().view(buffer, name)
        if not self.mine(name):
            raise MegacompileError(f"{buffer} of {name} is held by rank {self.holder[name]}, not by rank "
                                   f"{self.ranks.rank}: read it there (or gathered: engine.state_dict())")
        slot = self.slots[name]
        lo = self.ranges[slot.owner][self.ranks.rank][0]
        flat = getattr(self.owners[slot.owner], buffer)
        return flat[slot.offset - lo:slot.offset - lo + slot.numel].view(slot.shape)

    def master(self, name: str) -> torch.Tensor:
        """The whole fp32 master of `name`: with fp32 compute the compute copy is the master, bit
        for bit (AdamW writes both); with bf16 compute the holder broadcasts it (a collective:
        every rank reads the same names in the same order, as engine.state_dict does)."""
        if self.compute_dtype == torch.float32:
            return self.source(name)
        if name in self.gathered:
            return self.gathered[name]
        slot = self.slots[name]
        out = self.view("master", name).clone() if self.mine(name) else torch.empty(slot.shape)
        self.ranks.broadcast_(out, self.holder[name], f"gathering the master of {name}")
        return out

    def gather_masters(self) -> None:
        """Every whole master into `gathered` (bf16 compute: fp32 compute reads the copies)."""
        if self.compute_dtype != torch.float32:
            self.gathered = {name: self.master(name) for name in self.slots}

    # -- values in -----------------------------------------------------------------------
    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Whole weights into the compute copies; this rank's share into its masters."""
        with torch.no_grad():
            for name, t in tensors.items():
                if name in self.slots:
                    self.source(name).copy_(t)
                    if self.mine(name):
                        self.view("master", name).copy_(t)
                elif name in self.consts:
                    self.consts[name].copy_(t)

    # -- the step ------------------------------------------------------------------------
    def enter_program(self, uses: dict[str, int], order: list[str] | None = None) -> None:
        """As HostState's, and the ranks settle what their programs reach (a collective, before the
        program runs): `order` names the parameters as this rank's backward hands them over."""
        super().enter_program(uses)
        order = [n for n in order or () if n in self.slots]
        self.reach = reach.agree(self.ranks, list(self.slots), order)
        self.deferred = reach.DeferredGrads(self.reach.deferred, {n: self.slots[n].shape for n in self.reach.deferred})
        self._device_order = [n for n in order if n not in self.deferred]

    def offload_grads(self, backend, names: list[str], grads: list[torch.Tensor], stage: str, after=None):
        """Sum the stage's gradients over the ranks on the device, then offload this rank's; a
        deferred one goes to the host whole, to be summed there (sum_deferred)."""
        summed = [i for i, n in enumerate(names) if n not in self.deferred]
        expected, self._device_order = self._device_order[:len(summed)], self._device_order[len(summed):]
        # The ranks run other programs (something is deferred): their device reduces pair up only
        # in the order they agreed on.
        if self.reach.deferred and [names[i] for i in summed] != expected:
            raise MegacompileError(f"{stage} hands over the gradients of {[names[i] for i in summed]} where the ranks "
                                   f"agreed on {expected}: summing them over the ranks would mix tensors")
        reduced, sent = None, []
        if summed:
            reduced, sent = reduce_to_holders(self.ranks, backend, [grads[i] for i in summed],
                                              [self.holder[names[i]] for i in summed], stage)
        keep = [(names[i], t) for i, t in zip(summed, sent) if self.mine(names[i])]
        keep += [(n, g) for n, g in zip(names, grads) if n in self.deferred]
        return super().offload_grads(backend, [n for n, _ in keep], [t for _, t in keep], stage, after=reduced)

    def landing_view(self, name: str, g: torch.Tensor) -> torch.Tensor | None:
        return None if name in self.deferred else super().landing_view(name, g)

    def accumulate_grad(self, name: str, g: torch.Tensor) -> None:
        if name in self.deferred:
            self.deferred.add(name, g)
        else:
            super().accumulate_grad(name, g)

    def update_order(self, owners: list[int]) -> list[int]:
        """In forward order (owners are the layout program's stages): every rank updates and
        publishes the same owners in one order whatever program it ran (node.py), and the next
        forward needs the first ones first."""
        return sorted(owners)

    def sum_deferred(self) -> None:
        """Once every rank's walk is done: the deferred gradients summed over the ranks (zeros
        where a rank's program did not reach them), each added into its holder's step sum."""
        for name, g in self.deferred.mean_over(self.ranks).items():
            if self.mine(name):
                self._add_to_sum(name, g)

    def commit_micro_batch(self) -> None:
        """As HostState's; what the other ranks' programs reached counts as reached here too, so
        every rank steps (or skips) the same parameters."""
        super().commit_micro_batch()
        self._reached |= self.reach.reached

    def sum_grad_norms(self) -> None:
        """The step's global squared gradient norm (clipping), or whether any gradient is inf or
        NaN: the sum of every rank's over the sums it holds (taken as they landed), on every rank."""
        self.complete_checks()
        total = self.ranks.sum_(torch.tensor([sum(self._sq.values())], dtype=torch.float64),
                                "summing the gradient norm")
        self._global_sq = float(total[0])

    def grad_sq_norm(self) -> float:
        return self._global_sq

    def nonfinite_grads(self) -> list[str]:
        return [] if math.isfinite(self._global_sq) else ["the gradients summed over the ranks"]

    def update_owner(self, owner: int, fn: UpdateFn) -> None:
        """AdamW over this rank's range into the node's compute copy, then the other nodes' ranges."""
        lo, hi = self.ranges[owner][self.ranks.rank]
        if hi > lo:     # HostState adds the last micro-batch's gradients into the sum first
            super().update_owner(owner, fn)      # into b.compute, the node's copy, at [lo, hi)
        self.node_copy.publish(owner, self.ranges[owner])


def grad_bytes(host: HostState) -> int:
    """Host bytes of a state's gradient buffers (the step's sums, and landing buffers apart from
    them; a gradient that lands in the compute copy has none)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for b in host.owners.values() for t in (b.grad, b.landing) if t is not b.compute}
    return sum(storages.values())
