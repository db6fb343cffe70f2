"""Each new input shape traces and plans anew; the engine keeps a bounded number of plans and
says when shapes keep changing (RetraceWarning), with the fix: pad to a few lengths."""
from __future__ import annotations

import warnings


import megacompile
import megacompile.planner.cache as plan_cache
from megacompile.errors import RetraceWarning
from tests import models


def test_plans_are_bounded_and_shape_churn_is_named(monkeypatch):
    monkeypatch.setattr(plan_cache, "FIRST_WARNING", 2)
    model = models.NanoGPT(vocab=96, d=16, layers=1, heads=2)
    engine = megacompile.compile(model, 1.0, device="cpu")
    engine._compiled.limit = engine._captured.limit = 3

    def step(t):
        ids = models.batch(96, 1, t)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.step(idx=ids, targets=ids)
        return [w for w in caught if issubclass(w.category, RetraceWarning)]

    said = [step(t) for t in (3, 5, 7, 9, 11)]
    # warned at the 2nd and the 4th new shape (then at every doubling), not at every step
    assert [len(w) for w in said] == [0, 1, 0, 1, 0]
    message = str(said[3][0].message)
    assert "4 different input shapes" in message and "(1, 9)" in message and "Pad inputs" in message
    assert len(engine._compiled) == 3 and len(engine._captured) == 3
    assert engine._shapes_seen == 5
    step(11)                          # the most recent shape: kept, nothing traced
    assert engine._shapes_seen == 5
    step(3)                           # the oldest was dropped: traced again
    assert engine._shapes_seen == 6
    engine.close()


def test_the_cache_keeps_the_most_recently_used():
    cache = plan_cache.PlanCache(limit=2)
    cache["a"], cache["b"] = 1, 2
    assert cache.get("a") == 1        # a is now the most recent
    cache["c"] = 3
    assert list(cache) == ["a", "c"]
    assert cache.get("b") is None
