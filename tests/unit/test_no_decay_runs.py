"""The host update's runs under AdamW no_decay and lr_ratios: an owner's update is cut where
neighbouring parameters differ in weight decay or lr ratio (as in step count), one AdamW call a run;
parameters all alike stay one call for the whole owner. A data-parallel rank runs the same runs over its own range.

On host states built from a stand-in program (no trace, no device, no step): one owner of four
parameters, w1 b1 w2 norm in its flat order.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megacompile.capture.model_graph import StateEntry
from megacompile.distributed import shard
from megacompile.engine.gradless import gradient_order
from megacompile.runtime.host import HostState, program_uses
from tests.unit.test_data_parallel_reach import Pair, StubCopy, StubRanks, both

SHAPES = {"w1": (3, 2), "b1": (2,), "w2": (2, 2), "norm": (2,)}
CAPTURED = SimpleNamespace(
    stages=[SimpleNamespace(params=list(SHAPES), template=SimpleNamespace(
        params=[SimpleNamespace(trainable=True) for _ in SHAPES], grad_params=list(range(len(SHAPES)))))],
    state={n: StateEntry(s, torch.float32, trainable=True, is_buffer=False) for n, s in SHAPES.items()})


def _calls(host: HostState, no_decay: set[str], grad=lambda name: None, ratios=None) -> list[tuple]:
    """One step over every parameter; each AdamW call's (first element, elements, decays), and its
    lr ratio with `ratios`."""
    host.no_decay = frozenset(no_decay)
    host.lr_ratios = dict(ratios or {})
    host.begin_micro_batch(first=True, last=True)
    host.enter_program(program_uses(CAPTURED, host.slots), gradient_order(CAPTURED))
    for name in gradient_order(CAPTURED):
        grad(name)
    host.commit_micro_batch()
    (owner,) = host.reached_owners()
    host.schedule_updates([owner], step=1)
    base = host.owners[owner].master.data_ptr() - 4 * host.owners[owner].grad_lo
    calls = []
    host.update_owner(owner, lambda master, grad, m, v, out, step, decays, ratio: calls.append(
        ((master.data_ptr() - base) // 4, master.numel(), decays) + ((ratio,) if ratios is not None else ())))
    return calls


@pytest.mark.parametrize("no_decay, expected", [
    (set(), [(0, 14, True)]),                                                  # all alike: one call
    ({"b1", "norm"}, [(0, 6, True), (6, 2, False), (8, 4, True), (12, 2, False)]),
    ({"w2", "norm"}, [(0, 8, True), (8, 6, False)]),                           # neighbours alike join
    ({"w1", "b1", "w2", "norm"}, [(0, 14, False)]),
])
def test_an_owner_is_updated_in_runs_of_one_weight_decay(no_decay, expected):
    host = HostState(CAPTURED, torch.float32)
    assert [(host.slots[n].offset, host.slots[n].numel) for n in SHAPES] == [(0, 6), (6, 2), (8, 4), (12, 2)]

    def grad(name):
        host.accumulate_grad(name, torch.ones(SHAPES[name]))
    assert _calls(host, no_decay, grad) == expected


@pytest.mark.parametrize("ratios, expected", [
    ({}, [(0, 14, True, 1.0)]),
    ({"b1": 16.0, "norm": 16.0}, [(0, 6, True, 1.0), (6, 2, True, 16.0), (8, 4, True, 1.0), (12, 2, True, 16.0)]),
    ({"w2": 0.5, "norm": 0.5}, [(0, 8, True, 1.0), (8, 6, True, 0.5)]),
])
def test_an_owner_is_updated_in_runs_of_one_lr_ratio(ratios, expected):
    host = HostState(CAPTURED, torch.float32)

    def grad(name):
        host.accumulate_grad(name, torch.ones(SHAPES[name]))
    assert _calls(host, set(), grad, ratios) == expected
    # with no_decay beside them, a run is one decay and one ratio
    host = HostState(CAPTURED, torch.float32)
    assert _calls(host, {"norm"}, grad, {"b1": 2.0, "norm": 2.0}) == [
        (0, 6, True, 1.0), (6, 2, True, 2.0), (8, 4, True, 1.0), (12, 2, False, 2.0)]


class _NodeCopy(StubCopy):
    def publish(self, owner: int, ranges) -> None:
        pass


def test_a_data_parallel_rank_runs_the_runs_within_its_range(monkeypatch):
    monkeypatch.setattr(shard, "NodeCopy", _NodeCopy)
    pair = Pair()

    def step(rank: int):
        host = shard.ShardedHostState(CAPTURED, torch.float32, ranks=StubRanks(pair, rank))

        def grad(name):
            if host.mine(name):
                host.accumulate_grad(name, torch.ones(SHAPES[name]))
        return host.ranges[0][rank], _calls(host, {"b1", "norm"}, grad)

    (range0, calls0), (range1, calls1) = both(step)
    assert range0[1] == range1[0] and 0 < range0[1] < 14     # each rank holds part of the owner
    assert sorted(calls0 + calls1) == [(0, 6, True), (6, 2, False), (8, 4, True), (12, 2, False)]
    assert all(range0[0] <= lo < range0[1] for lo, _, _ in calls0)
