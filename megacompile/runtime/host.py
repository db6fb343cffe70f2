"""Host memory: float32 masters, AdamW state, gradients, and what the device copies in.

Each stage owns the trainable parameters it is the first to use; they sit in flat buffers per
owner (master, exp_avg, exp_avg_sq, plus the bf16 copy the device fetches when compute is bf16),
so the optimizer makes one pass over each block. Which buffers an owner has, and which the disk
tier holds instead (megacompile/disk), is cost/host_memory.py's OwnerLayout: with one
micro-batch per step the gradient lands in the compute copy (bf16: 14 B/param in RAM, 6 with the
moments on disk, 2 with the masters there too).
Buffers and frozen parameters are kept once, in the model's own dtype, and never updated.
Every trainable parameter has its place from the first step on, reached by its program or not
(cost/host_memory.py held_owners); a step updates only those its micro-batches' programs gave a
gradient, each with its own AdamW step count (schedule_updates).
How gradients land in these buffers and are checked is host_grads.py's part of the class; loads
and the module's views of the weights are host_weights.py's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..capture import CapturedModel
from ..capture.model_graph import owners
from ..cost.host_memory import OwnerLayout, Placement, held_owners, owner_layout
from ..disk.owner_state import DiskState, UpdateFn
from .host_grads import HostGradients
from .host_weights import HostWeights
from .page_locked import pinned_empty


@dataclass(frozen=True)
class Slot:
    owner: int
    offset: int
    numel: int
    shape: tuple[int, ...]


class OwnerBuffers:
    """One owner's flat buffers in RAM, as its OwnerLayout says (cost/host_memory.py); a buffer
    the disk tier holds is None here."""

    def __init__(self, numel: int, compute_dtype: torch.dtype, pin: bool, layout: OwnerLayout | None = None):
        layout = layout or owner_layout(compute_dtype, 1, False, Placement())
        def empty(dtype, pinned=pin):
            return pinned_empty(numel, dtype) if pinned else torch.empty(numel, dtype=dtype)
        # Only what crosses the link is page-locked: the fp32 master only when compute is fp32 (with
        # bf16 compute the device fetches the copy below; pinning the master would lock 4 B/param
        # for nothing, 280 GB at 70B).
        self.master = empty(torch.float32, pinned=pin and not layout.compute_copy) if layout.master else None
        self.exp_avg = torch.zeros(numel, dtype=torch.float32) if layout.moments else None
        self.exp_avg_sq = torch.zeros(numel, dtype=torch.float32) if layout.moments else None
        # fp32 compute reads the masters themselves; bf16 (or a master on disk) gets its own copy,
        # written by AdamW.
        self.compute = empty(compute_dtype) if layout.compute_copy else self.master
        # grad: the sum of the committed micro-batches of this step (what AdamW reads): fp32 when
        # micro-batches or tied uses add into it; else in the compute dtype, as it left the device,
        # and then it lands in the compute copy itself (see host_memory.py), which AdamW reads it
        # from before writing the new weights over it.
        # landing: with grad_accum > 1, where a later micro-batch's own gradient lands, as it left
        # the device (bf16: 2 B/param; a tied owner's fp32 partial sums: 4). It joins `grad` only
        # after its micro-batch commits, so a failed micro-batch leaves the earlier ones' sum
        # untouched (HostState.accumulate_grad); with one micro-batch per step the two are one,
        # and the device's gradients land in it directly (HostState.landing_view), so it is
        # page-locked then: it crosses the link.
        self.grad = (self.compute if layout.grad_in_copy
                     else empty(layout.grad_dtype,
                                pinned=pin and not layout.landing and layout.grad_dtype == compute_dtype).zero_())
        self.landing = torch.zeros(numel, dtype=layout.landing_dtype) if layout.landing else self.grad
        self.grad_in_copy = layout.grad_in_copy
        # The first element of the owner's flat order that grad and landing hold (data
        # parallelism keeps only this rank's range of them: distributed/shard.py).
        self.grad_lo = 0

    @property
    def nbytes(self) -> int:
        tensors = (self.master, self.exp_avg, self.exp_avg_sq, self.grad, self.landing, self.compute)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
        return sum(storages.values())


class HostState(HostWeights, HostGradients):
    def __init__(self, captured: CapturedModel, compute_dtype: torch.dtype, pin: bool = False, grad_accum: int = 1,
                 placement: Placement = Placement(), nvme_dir: str | None = None, verify: bool | None = None,
                 every_trainable: bool = True, borrowed: dict[str, torch.Tensor] | None = None):
        self.compute_dtype = compute_dtype
        self.placement = placement
        self.contributors = owners(captured)[1]
        # A trainable parameter this program does not reach may be reached by a later one: it gets
        # its place too (engine/gradless.py checks that a later program owns it there).
        owner_of, summed = self._lay_out(captured, every_trainable)
        self.slots: dict[str, Slot] = {}
        sizes: dict[int, int] = {}
        for name, s in owner_of.items():   # insertion order = order of first use
            entry = captured.state[name]
            self.slots[name] = Slot(s, sizes.get(s, 0), entry.numel, entry.shape)
            sizes[s] = sizes.get(s, 0) + entry.numel
        # Each owner's parameters in their flat order: the update goes over them in runs.
        self._by_owner: dict[int, list[str]] = {}
        for name, slot in self.slots.items():
            self._by_owner.setdefault(slot.owner, []).append(name)
        # The running program's (enter_program): how many stages produce a gradient for each
        # parameter it reaches (2 for a tied embedding), and so which parameters it reaches.
        self.uses: dict[str, int] = program_uses(captured, self.slots)
        self.summed_owners = frozenset(summed)
        # Per parameter, how many optimizer steps gave it no gradient (absent: none), so its own
        # AdamW step count is the global one less these; the engine hands in its TrainingState's
        # dict, which checkpoints keep.
        self.missed: dict[str, int] = {}
        # The parameters AdamW steps with weight decay 0 (AdamW no_decay): the engine hands in its
        # TrainingState's set.
        self.no_decay: frozenset[str] = frozenset()
        # Each parameter AdamW steps at lr x a ratio other than 1 (AdamW lr_ratios): the engine hands
        # in its TrainingState's dict.
        self.lr_ratios: dict[str, float] = {}
        self._reached: set[str] = set()    # parameters the step's committed micro-batches' programs reach
        self._summed: set[str] = set()     # parameters whose gradient sum holds a committed micro-batch's
        self._got: set[str] = set()        # parameters the running micro-batch landed a gradient for
        # per staged owner: (lo, hi, AdamW step, decays, lr ratio)
        self._runs: dict[int, list[tuple[int, int, int, bool, float]]] = {}

        self.owners = {s: self._owner_buffers(s, n, compute_dtype, pin,
                                              owner_layout(compute_dtype, grad_accum, s in summed, placement))
                       for s, n in sizes.items()}
        self.disk = DiskState(sizes, placement, nvme_dir, verify) if placement.on_disk else None
        self._in_copy: set[int] = set()   # owners whose gradients landed in their compute copy
        # grad_accum > 1: parameters whose gradient sits in `landing` -- landed by the running
        # micro-batch; committed but not yet added to `grad`; and, per owner, to be added by its update.
        self._landed: set[str] = set()
        self._unfolded: set[str] = set()
        self._fold_at_update: dict[int, list[str]] = {}
        self.consts: dict[str, torch.Tensor] = {}
        # Frozen weights another engine on the device holds with the same values (compile(...,
        # share_frozen=True): a reference beside a LoRA policy's base): its tensors, not copies, and
        # never written here; a load into one checks that it holds the same values.
        self.borrowed = frozenset(n for n, t in (borrowed or {}).items()
                                  if n in captured.state and n not in self.slots
                                  and tuple(t.shape) == tuple(captured.state[n].shape)
                                  and t.dtype == captured.state[n].dtype)
        for name, entry in captured.state.items():
            if name in self.borrowed:
                self.consts[name] = borrowed[name]
            elif name not in self.slots:
                # Kept in the model's own dtype (a frozen fp32 weight stays exact); the prefetch
                # casts to the compute dtype as it copies. Page-locked like the masters: a
                # non_blocking copy from pageable memory is a synchronous one.
                const = pinned_empty(entry.numel, entry.dtype) if pin else torch.empty(entry.numel, dtype=entry.dtype)
                self.consts[name] = const.zero_().view(entry.shape)
        self._first = True          # the running micro-batch is the first of its step
        self._check = True          # ... and the last: its sums are what AdamW will read
        self._partial: dict[str, tuple[int, torch.Tensor]] = {}
        self._norms = False         # ... and the step clips: take each sum's squared norm
        # Per landed sum of the step's last micro-batch: its squared norm (float64) when
        # clipping, else a number that is finite exactly when every value is.
        self._sq: dict[str, float] = {}
        # Updates still running on the host stream, per owner: the next read of those masters
        # (a prefetch, state_dict) waits for them first.
        self.pending: dict[int, object] = {}

    def _lay_out(self, captured: CapturedModel, every_trainable: bool) -> tuple[dict[str, int], set[int]]:
        """The owner of each held parameter, in the order of first use, and the owners laid out to
        sum a parameter's gradients from several stages (data parallelism: the same on every rank,
        megacompile/distributed/shard.py)."""
        owner_of = held_owners(captured, every_trainable)
        return owner_of, {owner_of[name] for name, n in program_uses(captured, owner_of).items() if n > 1}

    def _owner_buffers(self, owner: int, numel: int, compute_dtype: torch.dtype, pin: bool,
                       layout: OwnerLayout) -> OwnerBuffers:
        """One owner's buffers (data parallelism keeps only this rank's share of some:
        megacompile/distributed/shard.py)."""
        return OwnerBuffers(numel, compute_dtype, pin, layout)

    def wait_update(self, owner: int) -> None:
        event = self.pending.pop(owner, None)
        if event is not None:
            event.wait()

    def wait_updates(self) -> None:
        for owner in list(self.pending):
            self.wait_update(owner)

    # -- views ---------------------------------------------------------------------------
    def _view(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        slot = self.slots[name]
        return flat[slot.offset:slot.offset + slot.numel].view(slot.shape)

    def _grad_flat(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        """`name`'s slice, flat, of its owner's grad or landing buffer (which start at grad_lo)."""
        slot = self.slots[name]
        o = slot.offset - self.owners[slot.owner].grad_lo
        return flat[o:o + slot.numel]

    def _grad_view(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        return self._grad_flat(flat, name).view(self.slots[name].shape)

    def view(self, buffer: str, name: str) -> torch.Tensor:
        """One parameter's slice of its owner's flat `buffer` (master, exp_avg, exp_avg_sq, grad).
        A buffer the disk tier holds is read from there, one owner at a time (DiskState.read);
        what is written into such a slice reaches the disk before the next update reads it."""
        owner = self.slots[name].owner
        if buffer == "grad":
            self._fold(name)      # the committed sum, whole
        if self.disk is not None and self.disk.holds(buffer):
            return self._view(self.disk.read(owner, buffer), name)
        if buffer in ("grad", "landing"):
            return self._grad_view(getattr(self.owners[owner], buffer), name)
        return self._view(getattr(self.owners[owner], buffer), name)

    def master(self, name: str) -> torch.Tensor:
        return self.view("master", name)

    def source(self, name: str) -> torch.Tensor:
        """The host tensor a prefetch copies to the device (trainable: already in the compute
        dtype; buffers and frozen weights: in their own dtype, cast by the copy)."""
        if name in self.consts:
            return self.consts[name]
        return self._view(self.owners[self.slots[name].owner].compute, name)

    @property
    def nbytes(self) -> int:
        """Host RAM of the state: owners' buffers, frozen weights and buffers, the disk tier's pool."""
        return (sum(b.nbytes for b in self.owners.values())
                + sum(t.untyped_storage().nbytes() for n, t in self.consts.items() if n not in self.borrowed)
                + (self.disk.tier.pool.total_bytes if self.disk is not None else 0))

    def parts(self) -> dict[str, int]:
        """Bytes of RAM each kind of buffer takes, counted once where two kinds share one."""
        seen: set[int] = set()
        out: dict[str, int] = {}

        def add(kind: str, t: torch.Tensor | None) -> None:
            if t is None or t.untyped_storage().data_ptr() in seen:
                return
            seen.add(t.untyped_storage().data_ptr())
            out[kind] = out.get(kind, 0) + t.untyped_storage().nbytes()
        for b in self.owners.values():
            add("fp32 masters", b.master)
            add("exp_avg+exp_avg_sq", b.exp_avg)
            add("exp_avg+exp_avg_sq", b.exp_avg_sq)
            add("compute copies", b.compute)
            add("grads", b.grad)
            add("grads", b.landing)
        for n, t in self.consts.items():
            if n not in self.borrowed:
                add("frozen weights and buffers", t)
        if self.disk is not None:
            out["disk-tier pool"] = self.disk.tier.pool.total_bytes
        return out

    # -- the update ----------------------------------------------------------------------
    def update_order(self, owners: list[int]) -> list[int]:
        """The order the step's updates start in: the schedule's (data parallelism: shard.py's)."""
        return owners

    def schedule_updates(self, owners: list[int], step: int | None = None) -> None:
        """The host stream runs these owners' updates next, in this order: the disk tier reads ahead.

        step: the optimizer step these updates make (1-based), given at the step's last
        micro-batch. Each owner is updated in runs of neighbouring parameters of one AdamW step
        count, one weight decay (decayed, or exempt by AdamW no_decay) and one lr ratio (AdamW
        lr_ratios): one run, the whole owner, when every parameter has had a gradient in every
        step and all decay and step alike. A
        parameter the step's programs gave no gradient is left out, as torch.optim.AdamW skips a
        parameter whose .grad is None: its master, moments and count stay as they are."""
        self._in_copy = set()    # committed: the updates overwrite the copies
        if step is not None:
            self.plan_updates(owners, step, self._reached)
        staged = set(owners)
        for name in [n for n in self._unfolded if self.slots[n].owner in staged]:
            self._unfolded.discard(name)
            self._fold_at_update.setdefault(self.slots[name].owner, []).append(name)
        if self.disk is not None:
            self.disk.schedule(owners)

    def plan_updates(self, owners: list[int], step: int, reached: set[str]) -> None:
        """Fix the step's AdamW step counts: each owner's runs (schedule_updates), and one more
        missed step for every parameter not `reached`. An update that starts as its gradients land
        (runtime/early_updates.py) calls this itself, before the step's first update."""
        for owner in owners:
            runs: list[tuple[int, int, int, bool, float]] = []
            for name in self._by_owner.get(owner, []):
                if name not in reached:
                    continue
                slot = self.slots[name]
                kind = (step - self.missed.get(name, 0), name not in self.no_decay, self.lr_ratios.get(name, 1.0))
                if runs and runs[-1][1] == slot.offset and runs[-1][2:] == kind:
                    runs[-1] = (runs[-1][0], slot.offset + slot.numel, *kind)
                else:
                    runs.append((slot.offset, slot.offset + slot.numel, *kind))
            self._runs[owner] = runs
        for name in self.slots:
            if name not in reached:
                self.missed[name] = self.missed.get(name, 0) + 1

    def update_owner(self, owner: int, fn: UpdateFn) -> None:
        """fn(master, grad, exp_avg, exp_avg_sq, out, step, decays, ratio) over the owner's flat buffers,
        once per run that schedule_updates found (all of them, or piece by piece through the disk
        tier)."""
        b = self.owners[owner]
        for name in self._fold_at_update.pop(owner, []):   # the last micro-batch's gradients join the sum
            self._grad_view(b.grad, name).add_(self._grad_view(b.landing, name))
        runs = self._runs.pop(owner)
        out = None if b.compute is b.master else b.compute

        def over(start: int, master, grad, exp_avg, exp_avg_sq, out) -> None:
            """The runs' parts within these buffers, which hold the owner's flat [start, start + len)."""
            end = start + grad.numel()
            for lo, hi, step, decays, ratio in runs:
                lo, hi = max(lo, start), min(hi, end)
                if lo < hi:
                    part = slice(lo - start, hi - start)
                    fn(master[part], grad[part], exp_avg[part], exp_avg_sq[part],
                       None if out is None else out[part], step, decays, ratio)
        if self.disk is None:
            # The buffers hold [grad_lo, grad_lo + len) (a data-parallel rank's range); the compute
            # copy (out) is the whole owner's.
            lo = b.grad_lo
            over(lo, b.master, b.grad, b.exp_avg, b.exp_avg_sq, None if out is None else out[lo:lo + b.grad.numel()])
        else:
            self.disk.update(owner, b.master, b.grad, b.exp_avg, b.exp_avg_sq, out, over)


def program_uses(captured: CapturedModel, slots) -> dict[str, int]:
    """For each parameter in `slots` that `captured`'s backward gives a gradient: from how many
    stages (2 for a tied embedding)."""
    uses: dict[str, int] = {}
    for stage in captured.stages:
        for name, slot in zip(stage.params, stage.template.params):
            if slot.trainable and name in slots:
                uses[name] = uses.get(name, 0) + 1
    return uses


def owner_map(captured: CapturedModel, slots) -> tuple[dict[int, int], list[str]]:
    """Which host owner each of `captured`'s owning stages updates, and the parameters that make
    that ambiguous.

    The host state's owners are the first program's owning stages. A later program may cut the
    model into other stages: a LLaVA step without images has no tower blocks and no bridge, so its
    decoder's blocks have other indices, and its token embedding sits in its prologue where the
    first program's bridge held it. Each of its owning stages updates the host owner that holds
    its parameters; several may update one (a text-only first program laid the tower out in its
    prologue's owner). A stage whose parameters the host holds in several owners is ambiguous:
    its parameters are returned, and the step is refused (engine/gradless.py)."""
    owner_of = owners(captured)[0]
    found: dict[int, set[int]] = {}
    for name, s in owner_of.items():
        if name in slots:
            found.setdefault(s, set()).add(slots[name].owner)
    mapping = {s: next(iter(h)) for s, h in found.items() if len(h) == 1}
    split = sorted(n for n, s in owner_of.items() if n in slots and s not in mapping)
    return mapping, split
