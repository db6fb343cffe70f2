"""A stand-in for peers._run, for tests of the peers bench's running order without processes: it
records each system's time limit, may advance a stand-in clock by it (a system that used all of
its time), and returns a row."""
from __future__ import annotations


class StubRuns:
    def __init__(self, minimum_gib: float = 3.55, use_all_time: bool = True):
        self.now = 0.0
        self.calls: list[tuple[str, dict, float]] = []
        self.minimum_gib, self.use_all_time = minimum_gib, use_all_time

    def clock(self) -> float:
        return self.now

    def run(self, system, workload, options, timeout, scratch, log) -> dict:
        self.calls.append((system, options, timeout))
        if self.use_all_time:
            self.now += timeout
        row = {"ok": True, "losses": [11.7, 11.5], "step_s": 1.0, "tokens_per_s": 1.0, "tflops_6nd": 1.0}
        if system == "megacompile":
            fraction = options["budget"]
            asked = 64.0 if fraction == "resident" else float(fraction) * workload.parameters * 2 / 2**30
            row.update(hbm_budget_gib=max(asked, self.minimum_gib), asked_budget_gib=asked,
                       budget_raised_to_minimum=asked < self.minimum_gib, updates=options["updates"])
        return row

    def install(self, monkeypatch, peers) -> "StubRuns":
        monkeypatch.setattr(peers, "_run", self.run)
        monkeypatch.setattr(peers, "_clock", self.clock)
        monkeypatch.setattr(peers, "_unavailable", lambda system, workload: None)
        monkeypatch.setattr(peers, "_weights", lambda *a: ("/weights", ""))
        return self
