"""A run killed with SIGKILL right after one step's log row is written (crash_child.py: as a crash or
the OOM killer would end it), and the log rows a resumed run is compared by."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from megacompile.train import log

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMED = ("seconds", "tokens_per_s", "host_resident_bytes")     # measured: they differ run to run


def kill_after(config: str, step: int) -> None:
    """`megacompile train --config CONFIG` in a child process (the tests' modules importable, for
    reward functions), killed right after step `step`'s row."""
    child = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "train", "crash_child.py"), config, str(step)],
                           cwd=ROOT, capture_output=True, text=True, timeout=600,
                           env={**os.environ, "PYTHONPATH": ROOT})
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]


def untimed(path) -> list[dict]:
    """A log.csv's rows without their timings: what a resumed run must write as the whole one did."""
    return [{k: v for k, v in row.items() if k not in TIMED} for row in log.read(str(path))]


def trainer_log(folder) -> list[dict]:
    """A run folder's trainer_log.jsonl lines without their times."""
    with open(os.path.join(folder, "trainer_log.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in ("elapsed_time", "remaining_time")}
                for line in f]


def resumes_as_whole(config, folder, steps: int, kill_at: int, kept: list[str]) -> list[dict]:
    """config(name) -> a run.yaml of `steps` steps whose run folder is folder/name: the run `whole`
    goes to its end; `cut` is killed after step `kill_at` (its checkpoints then `kept`) and resumed
    with the same command, and writes whole's log (and trainer_log.jsonl). whole's rows, without timings."""
    from megacompile.train import load, run
    assert run(load(config("whole"), []))["steps"] == steps
    kill_after(config("cut"), kill_at)
    assert sorted(os.listdir(os.path.join(folder, "cut", "checkpoints"))) == kept
    assert run(load(config("cut"), []))["steps"] == steps
    whole, cut = (untimed(os.path.join(folder, name, "log.csv")) for name in ("whole", "cut"))
    assert whole == cut
    assert trainer_log(os.path.join(folder, "whole")) == trainer_log(os.path.join(folder, "cut"))
    return whole
