"""Overlap is real on the cpu backend: prefetches run while compute runs (from the recorded timeline)."""
from __future__ import annotations

import time

import megacompile
from megacompile.optim.host_update import HostUpdate
from megacompile.runtime import cpu
from tests import models


def test_prefetch_runs_concurrently_with_compute(monkeypatch):
    """Each prefetch is stretched by a sleep, as the host updates are below: a schedule that
    waited for its copies before computing would show no overlap however long they took."""
    coalesce = cpu.coalesce

    def slow_coalesce(dsts, srcs):      # runs inside the prefetch's copy, on the h2d stream
        time.sleep(0.01)
        return coalesce(dsts, srcs)
    monkeypatch.setattr(cpu, "coalesce", slow_coalesce)
    model = models.NanoGPT(vocab=96, d=256, layers=6, heads=4)
    engine = megacompile.compile(model, hbm_budget=64.0, device="cpu")
    assert engine_plan_depth(engine) >= 1
    overlapped = 0
    for seed in range(3):
        engine.timeline.clear()
        ids = models.batch(96, 4, 32, seed=seed)
        engine.step(idx=ids, targets=ids)
        compute = engine.timeline.on("compute")
        prefetches = [s for s in engine.timeline.on("h2d") if s.what.startswith("prefetch")]
        assert prefetches and compute
        overlapped += sum(1 for p in prefetches
                          if any(c.start < p.end and p.start < c.end for c in compute))
    assert overlapped > 0, "no prefetch ever ran while a stage computed"


def test_host_optimizer_runs_beside_the_next_forward(monkeypatch):
    """Updates start when the step commits (after its whole backward) and run while the next
    step's forward computes. Each update is stretched by a sleep (which holds no lock), so the
    overlap does not hang on how fast this machine's cores are at the moment: an engine that
    waited for every update before the next forward would show none however slow they were."""
    adamw = HostUpdate.adamw

    def slow_adamw(self, stage, context):
        time.sleep(0.05)
        adamw(self, stage, context)
    monkeypatch.setattr(HostUpdate, "adamw", slow_adamw)
    model = models.NanoGPT(vocab=96, d=256, layers=6, heads=4)
    engine = megacompile.compile(model, hbm_budget=64.0, device="cpu")
    ids = models.batch(96, 4, 32, seed=0)
    engine.step(idx=ids, targets=ids)
    overlapped = 0
    for seed in range(1, 4):
        engine.timeline.clear()
        ids = models.batch(96, 4, 32, seed=seed)
        engine.step(idx=ids, targets=ids)       # the previous step's updates overlap this forward
        compute = engine.timeline.on("compute")
        updates = [u for u in engine.timeline.on("host") if u.what.startswith("adamw")]
        forwards = [c for c in compute if c.what.startswith("forward")]
        backward_end = max(c.end for c in compute if c.what.startswith("backward"))
        engine.synchronize()
        this_step = [u for u in engine.timeline.on("host") if u.what.startswith("adamw") and u.start >= backward_end]
        assert len(this_step) == 8   # one per owning stage, none before the backward ended
        overlapped += sum(1 for u in updates if any(c.start < u.end and u.start < c.end for c in forwards))
    assert overlapped > 0, "no host AdamW update ever ran while the next step's forward computed"


def engine_plan_depth(engine) -> int:
    ids = models.batch(96, 4, 32)
    engine.step(idx=ids, targets=ids)
    return engine.plan.program.facts["choice"].prefetch_depth
