"""What the ranks settle when their micro-batches reach different parameters (an image on one rank
only), on two host states in two threads of this process whose collectives meet at a barrier: no
process group, no device, no program run.

The model: a vision tower of two tensors, an embedding and a head, and a norm no program reaches
(LLaVA's last tower norm). Rank 0's micro-batch has an image, rank 1's none. Both must lay the
host state out alike (rank 1's first program never reaches the tower), sum a zero gradient from
rank 1 into the tower's mean, step the tower on both ranks, and skip only the norm.
"""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from megacompile.capture.model_graph import StateEntry
from megacompile.distributed import reach, shard
from megacompile.engine.gradless import gradient_order
from megacompile.errors import InputMismatchError
from megacompile.runtime.host import program_uses

SHAPES = {"tower.a": (5, 2), "tower.b": (2,), "norm": (2,), "embed": (4,), "head": (4,)}


def program(*stages: tuple[str, ...]) -> SimpleNamespace:
    """A captured program: its stages' trainable parameters, in forward order."""
    def stage(names):
        slots = [SimpleNamespace(trainable=True) for _ in names]
        return SimpleNamespace(params=list(names), template=SimpleNamespace(params=slots,
                                                                            grad_params=list(range(len(names)))))
    state = {n: StateEntry(s, torch.float32, trainable=True, is_buffer=False) for n, s in SHAPES.items()}
    return SimpleNamespace(stages=[stage(s) for s in stages], state=state)


WITH_IMAGE = program(("tower.a",), ("tower.b",), ("embed",), ("head",))
WITHOUT = program(("embed",), ("head",))


class Pair:
    """Two ranks' collectives, met in threads: each hands in its value and gets both back."""

    def __init__(self):
        self.barrier = threading.Barrier(2, timeout=20)
        self.values = [None, None]

    def exchange(self, rank: int, value) -> list:
        self.values[rank] = value
        self.barrier.wait()
        out = list(self.values)
        self.barrier.wait()
        return out


class StubRanks:
    size = 2

    def __init__(self, pair: Pair, rank: int):
        self.pair, self.rank = pair, rank

    def gather_objects(self, obj, what: str) -> list:
        return self.pair.exchange(self.rank, obj)

    def gather_(self, t: torch.Tensor, what: str) -> torch.Tensor:
        return torch.stack(self.pair.exchange(self.rank, t.clone()))

    def sum_(self, t: torch.Tensor, what: str) -> torch.Tensor:
        t.copy_(sum(self.pair.exchange(self.rank, t.clone())))
        return t


class StubCopy:
    """The node's compute copy, this rank's own (node.py's shares memory between processes)."""

    def __init__(self, ranks, numels: dict[int, int], dtype: torch.dtype, pin: bool):
        self.copies = {owner: torch.zeros(n, dtype=dtype) for owner, n in numels.items()}

    def view(self, owner: int) -> torch.Tensor:
        return self.copies[owner]


def both(work) -> list:
    """work(rank) on two threads at once; their results, or the first error."""
    out, errors = [None, None], []

    def run(rank: int) -> None:
        try:
            out[rank] = work(rank)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def gradients(rank: int) -> dict[str, torch.Tensor]:
    return {n: torch.full(s, float(1 + rank + i)) for i, (n, s) in enumerate(SHAPES.items())}


def test_a_tower_one_rank_reaches_is_stepped_on_both_with_a_zero_from_the_other(monkeypatch):
    monkeypatch.setattr(shard, "NodeCopy", StubCopy)
    pair = Pair()

    def step(rank: int):
        captured = (WITH_IMAGE, WITHOUT)[rank]
        host = shard.ShardedHostState(captured, torch.float32, ranks=StubRanks(pair, rank))
        host.begin_micro_batch(first=True, last=True, norms=True)
        host.enter_program(program_uses(captured, host.slots), gradient_order(captured))
        grads = gradients(rank)
        for name in gradient_order(captured):
            if name in host.deferred:       # as the stage's gradient offload hands it over
                host.accumulate_grad(name, grads[name])
            elif host.mine(name):           # summed on the device: both ranks reach it
                host.accumulate_grad(name, (gradients(0)[name] + gradients(1)[name]) / 2)
        host.sum_deferred()
        host.sum_grad_norms()
        host.commit_micro_batch()
        host.schedule_updates(host.reached_owners(), step=1)
        return host

    hosts = both(step)
    layouts = [{n: (s.owner, s.offset) for n, s in h.slots.items()} for h in hosts]
    assert layouts[0] == layouts[1] and layouts[0].keys() == SHAPES.keys()
    assert [h.reach.deferred for h in hosts] == [("tower.a", "tower.b")] * 2
    # each rank holds part of the tower: rank 1, without an image, sums rank 0's gradient and its zero
    held = {n: r for r in range(2) for n in hosts[r].slots if hosts[r].mine(n)}
    assert held["tower.a"] == 0 and held["tower.b"] == 1
    for name in ("tower.a", "tower.b"):
        torch.testing.assert_close(hosts[held[name]].view("grad", name), gradients(0)[name] / 2, rtol=0, atol=0)
    # the clip norm is of the summed gradients, the same on both ranks
    expected = sum(float(((gradients(0)[n] + (gradients(1)[n] if n in ("embed", "head") else 0)) / 2).square().sum())
                   for n in ("tower.a", "tower.b", "embed", "head"))
    assert hosts[0].grad_sq_norm() == hosts[1].grad_sq_norm() == pytest.approx(expected)
    # both ranks step the tower; only the norm, which no rank reaches, is skipped, on both
    assert [h.missed for h in hosts] == [{"norm": 1}] * 2
    assert hosts[1].reached_owners() == hosts[0].reached_owners() == sorted({s.owner for s in hosts[0].slots.values()})


def test_parameters_every_rank_reaches_in_other_orders_are_refused_on_every_rank():
    names = ["a", "b", "c"]
    rows = torch.stack([reach.row(names, ["a", "b", "c"]), reach.row(names, ["b", "a", "c"])])
    with pytest.raises(InputMismatchError, match="2 trainable parameters .a, b. over in another order on rank 1"):
        reach.settle(names, rows)


def test_a_parameter_used_from_more_stages_on_one_rank_is_summed_over_the_host():
    """A tied weight one rank's program uses twice and another's once: the device reduces would
    not pair up, so it is deferred like one that only some ranks reach."""
    names = ["embed", "head"]
    rows = torch.stack([reach.row(names, ["embed", "head", "embed"]), reach.row(names, ["head", "embed"])])
    verdict = reach.settle(names, rows)
    assert verdict.deferred == ("embed",) and verdict.reached == {"embed", "head"}
