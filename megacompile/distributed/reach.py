"""Which parameters the ranks' programs reach in a micro-batch, agreed before it runs, and the sum
of the gradients that some ranks' programs produce and others' do not.

A rank's micro-batch may skip part of the model that another rank's uses: a LLaVA micro-batch
without an image runs neither the vision tower nor the projector. Eager DDP (with
find_unused_parameters), like one process accumulating the ranks' micro-batches, then counts a
zero gradient for that rank: the tower steps with (g_0 + 0) / R. Only a parameter that no rank's
program reaches, in any micro-batch of the step, is skipped the way one process skips it (no
moment decay, no weight decay, no advance of its count: runtime/host.py schedule_updates). So the
ranks settle, per parameter, whether any of them reaches it, and every rank steps the union.

The agreement is one all-gather of a row per rank: for each held parameter (in the host layout's
order, the same on every rank) its first position in the order the rank's backward hands over
gradients (-1: not reached), and from how many stages (2 for a tied embedding). Every rank derives
the same verdict from the same rows:
- reached by every rank, from as many stages, in one order: summed on the device as each
  backward produces them (grad_reduce.py), as when the ranks run one program;
- reached by some ranks only (or from unequal numbers of stages): deferred. A rank whose program
  reaches one keeps its gradient on the host in fp32 (the d2h copy one process makes anyway);
  once every rank's walk is done, one all-reduce over the host sums them in the layout's order,
  a rank that did not reach a parameter sending zeros, and each holder divides by R. The ranks'
  backwards differ, so such a sum cannot follow either of them. It costs 4 B per deferred
  parameter on every rank while it runs (the tower's, not the model's).
The ranks' device reduces must then come in one order; where the parameters every rank reaches
come in different orders the step is refused on every rank, before it runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputMismatchError

_NAMED = 6     # parameters named in a message; the rest are counted


@dataclass(frozen=True)
class Reach:
    """The verdict of one micro-batch, the same on every rank."""
    reached: frozenset[str]       # by some rank's program: the step updates them on every rank
    deferred: tuple[str, ...]     # by some ranks' only: summed over the host once the walk is done


NOTHING_DEFERRED = Reach(frozenset(), ())


def row(names: list[str], order: list[str]) -> torch.Tensor:
    """This rank's row: per held parameter (`names`, the layout's order) its first position in
    `order` (the names as the backward hands over their gradients, once per stage) or -1, then how
    many times `order` names it."""
    index = {name: i for i, name in enumerate(names)}
    first, uses = [-1] * len(names), [0] * len(names)
    for k, name in enumerate(order):
        i = index[name]
        if first[i] < 0:
            first[i] = k
        uses[i] += 1
    return torch.tensor(first + uses, dtype=torch.int64)


def settle(names: list[str], rows: torch.Tensor) -> Reach:
    """The verdict from every rank's row (rows: ranks x 2 len(names))."""
    n = len(names)
    first, uses = rows[:, :n], rows[:, n:]
    reaching = (uses > 0).sum(0)
    reached = reaching > 0
    everywhere = (reaching == rows.shape[0]) & (uses == uses[0]).all(0)
    common = everywhere.nonzero().flatten()
    orders = [common[first[r, common].argsort()] for r in range(rows.shape[0])]
    apart = [r for r in range(1, len(orders)) if not torch.equal(orders[r], orders[0])]
    if apart:
        which = [names[i] for i, j in zip(orders[0].tolist(), orders[apart[0]].tolist()) if i != j]
        raise InputMismatchError(
            f"step() got inputs whose programs hand the gradients of {len(which)} trainable parameters "
            f"({_names(which)}) over in another order on rank {apart[0]} than on rank 0, so the ranks cannot sum "
            "them as their backwards produce them; nothing was run. Give the ranks inputs of the same kind "
            "in this micro-batch")
    return Reach(frozenset(names[i] for i in reached.nonzero().flatten().tolist()),
                 tuple(names[i] for i in (reached & ~everywhere).nonzero().flatten().tolist()))


def agree(ranks, names: list[str], order: list[str]) -> Reach:
    """The verdict, from one all-gather over the ranks (a collective: every rank calls it before
    each micro-batch's program runs)."""
    return settle(names, ranks.gather_(row(names, order), "agreeing on the parameters the ranks' inputs reach"))


class DeferredGrads:
    """The gradients of one micro-batch's deferred parameters: what this rank's program produced,
    in fp32 (zeros for what it did not reach), laid out in the verdict's order."""

    def __init__(self, names: tuple[str, ...], shapes: dict[str, tuple[int, ...]]):
        self.spans: dict[str, tuple[int, int, tuple[int, ...]]] = {}
        end = 0
        for name in names:
            numel = 1
            for d in shapes[name]:
                numel *= d
            self.spans[name] = (end, end + numel, tuple(shapes[name]))
            end += numel
        self.flat = torch.zeros(end, dtype=torch.float32) if end else None

    def __contains__(self, name: str) -> bool:
        return name in self.spans

    def add(self, name: str, g: torch.Tensor) -> None:
        """One stage's gradient for `name` (a tied parameter's stages add up)."""
        lo, hi, shape = self.spans[name]
        self.flat[lo:hi].view(shape).add_(g)

    def mean_over(self, ranks) -> dict[str, torch.Tensor]:
        """Each deferred parameter's gradient summed over the ranks and divided by their number (a
        collective: every rank calls it, with nothing to sum on none)."""
        if self.flat is None:
            return {}
        ranks.sum_(self.flat, "summing the gradients that some ranks' inputs do not reach")
        self.flat.div_(ranks.size)
        return {name: self.flat[lo:hi].view(shape) for name, (lo, hi, shape) in self.spans.items()}


def _names(names: list[str]) -> str:
    more = len(names) - _NAMED
    return ", ".join(names[:_NAMED]) + (f" and {more} more" if more > 0 else "")
