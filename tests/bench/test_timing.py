"""How the peers bench times a system: allocator retries are counted over the timed steps and
reported per step (the first lease's "18 retries a step" was the process's total over 6 steps)."""
import torch

from megacompile.bench import timing
from megacompile.bench.workload import Workload


def test_alloc_retries_are_counted_over_the_timed_steps_and_given_per_step(monkeypatch):
    retries = {"num_alloc_retries": 7}      # before the first step: retries of whatever ran before
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda *a: dict(retries))

    def step(ids, labels):
        retries["num_alloc_retries"] += 3
        return torch.tensor(1.0)
    out = timing.timed(Workload(shape="tiny", device="cuda", batch=2, seq=32, steps=4, warmup=2), step)
    assert out["alloc_retries_per_step"] == 3
    assert len(out["losses"]) == 6


def test_the_cpu_half_reports_no_allocator_figures():
    tiny = Workload(shape="tiny", device="cpu", batch=2, seq=32, steps=1, warmup=1)
    out = timing.timed(tiny, lambda ids, labels: 1.0)
    assert "alloc_retries_per_step" not in out and out["step_s"] > 0
