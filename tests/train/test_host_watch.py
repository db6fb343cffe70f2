"""The process's host memory step by step (train/host_watch.py): log.csv's host_resident_bytes is
the resident set after each step; the run says once, at the first step past its host budget that
has also grown since the first step, what the plan placed and the memory there is, and never for a
small run whose interpreter alone passes its budget."""
from __future__ import annotations

import os

from megacompile.train import load, log, run
from megacompile.train.host_watch import HostWatch
from tests.train import files

GiB = 2 ** 30


def test_past_the_budget_and_grown_since_the_first_step_is_said_once(capsys):
    watch = HostWatch(2 * GiB, planned_bytes=GiB)
    assert watch.check(int(1.2 * GiB), 1) is None and watch.check(int(1.9 * GiB), 2) is None
    line = watch.check(int(2.5 * GiB), 3)
    assert line is not None and line in capsys.readouterr().out
    assert ("after step 3 the process holds 2.50 GiB, past the run's host budget of 2.00 GiB (the plan placed "
            "1.00 GiB of state)") in line and "log.csv's host_resident_bytes" in line
    assert watch.check(4 * GiB, 4) is None                      # once
    small = HostWatch(GiB // 2, planned_bytes=None)            # the interpreter alone is past it: no growth
    assert small.check(GiB, 1) is None and small.check(int(1.2 * GiB), 2) is None
    assert small.check(int(1.3 * GiB), 3) is not None          # grown a quarter since the first step
    assert HostWatch(GiB, None).check(None, 1) is None         # unknown where there is no /proc


def test_a_runs_log_records_its_resident_set_after_each_step(tmp_path):
    work = files.workspace(tmp_path)
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), model=work["model"], data=work["chats"], batch=2, seq=32,
                            steps=2, device="cpu", run_dir=str(tmp_path / "run")), [])
    assert run(c)["steps"] == 2
    rows = log.read(os.path.join(c.run_dir, "log.csv"))
    resident = [int(r["host_resident_bytes"]) for r in rows]
    assert len(resident) == 2 and all(100 * 2 ** 20 < r < 64 * GiB for r in resident)   # the process, torch and all
