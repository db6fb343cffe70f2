"""The part of the host state that lives in the disk tier: one folder of state files per run,
the update loop that streams an owner's pieces through the host AdamW, and whole-owner reads
and writes for loading, state_dict and checkpoints."""
from __future__ import annotations

import os
import tempfile
import weakref
from typing import Callable

import torch

from ..cost.host_memory import DEPTH, Placement, piece_numel
from ..errors import StorageError
from .tier import DiskTier

# update(master, grad, exp_avg, exp_avg_sq, out, step, decays, ratio): one AdamW call over flat slices
# of one owner, with those parameters' own step count; decays: False where AdamW no_decay exempts them;
# ratio: their lr's multiple of the step's (AdamW lr_ratios).
UpdateFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, int, bool, float],
                    None]
# over(start, master, grad, exp_avg, exp_avg_sq, out): the update of a piece of one owner, the
# buffers holding its flat [start, start + len) (runtime/host.py runs it over the piece's parameters).
PieceFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], None]


class DiskState:
    def __init__(self, sizes: dict[int, int], placement: Placement, nvme_dir: str | None, verify: bool | None = None,
                 depth: int = DEPTH):
        if nvme_dir is None:
            raise StorageError(f"the plan puts {placement.describe()}, but no nvme_dir was given: "
                               "compile(..., nvme_dir=PATH) names the folder on a fast disk")
        try:
            os.makedirs(nvme_dir, exist_ok=True)
            # A folder of its own per run, so two runs never share state files.
            self.folder = tempfile.mkdtemp(prefix="megacompile-state-", dir=nvme_dir)
        except OSError as e:
            raise StorageError(f"cannot make a state folder in nvme_dir {nvme_dir}: {e.strerror or e}") from e
        self.placement = placement
        try:
            self.tier = DiskTier(self.folder, sizes, placement.kinds, piece_numel=piece_numel(), depth=depth,
                                 verify=verify)
        except BaseException:
            os.rmdir(self.folder)
            raise
        # (owner, kind, values handed out, values as read): see read()
        self._cached: tuple[int, str, torch.Tensor, torch.Tensor] | None = None
        self._finalizer = weakref.finalize(self, _close, self.tier, self.folder)

    def record_into(self, timeline) -> None:
        """Each piece the tier reads or writes becomes a span on `timeline`'s disk track. The I/O
        threads know no schedule node: the spans carry none, and the step running when they end."""
        self.tier.on_io = lambda what, start, end: timeline.add("disk", what, start, end, (None, timeline.step))

    def holds(self, kind: str) -> bool:
        return kind in self.placement.kinds

    # -- whole owners --------------------------------------------------------------------
    def read(self, owner: int, kind: str) -> torch.Tensor:
        """The owner's flat `kind`, read from disk into RAM. Readers go name by name through an
        owner (state_dict, checkpoints), so the last one read is kept; writes into it reach the
        disk when it is let go (another owner read, the next update, an explicit write)."""
        if self._cached is None or self._cached[:2] != (owner, kind):
            self.settle()
            values = self.tier.read(owner, kind)
            self._cached = (owner, kind, values, values.clone())
        return self._cached[2]

    def settle(self) -> None:
        """Let go of the kept owner: written back if anything changed it (bitwise)."""
        if self._cached is not None:
            owner, kind, values, read = self._cached
            self._cached = None
            if not torch.equal(values.view(torch.int32), read.view(torch.int32)):
                self.tier.write(owner, kind, values)

    def write(self, owner: int, kind: str, values: torch.Tensor) -> None:
        self.settle()
        self.tier.write(owner, kind, values)

    # -- the update ----------------------------------------------------------------------
    def schedule(self, owners: list[int]) -> None:
        """The owners whose updates the host stream runs next, in that order: start reading."""
        self.settle()
        self.tier.schedule(owners)

    def update(self, owner: int, master: torch.Tensor | None, grad: torch.Tensor, exp_avg: torch.Tensor | None,
               exp_avg_sq: torch.Tensor | None, out: torch.Tensor | None, fn: PieceFn) -> None:
        """Run `fn` over the owner piece by piece: buffers in RAM are sliced, those on disk come
        from the piece read ahead; each piece is written behind as soon as its update is done."""
        ram = {"master": master, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        for a, b in self.tier.pieces_of(owner):
            piece = self.tier.next_piece(owner)
            try:
                part = {k: piece.views[k] if t is None else t[a:b] for k, t in ram.items()}
                fn(a, part["master"], grad[a:b], part["exp_avg"], part["exp_avg_sq"], None if out is None else out[a:b])
            except BaseException as e:
                self.tier.abandon(piece, e)
                raise
            self.tier.write_behind(piece)

    def close(self) -> None:
        self._finalizer()


def _close(tier: DiskTier, folder: str) -> None:
    tier.close(remove=True)
    try:
        os.rmdir(folder)
    except OSError:
        pass
