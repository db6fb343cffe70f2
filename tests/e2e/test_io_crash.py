"""Crash safety: a training process SIGKILLed at random moments, mid-save included, never loads
a broken checkpoint, never loses a finished save, leaves nothing behind once it resumes, and its
losses after every resume are the uninterrupted run's, bit for bit (dropout on, a torch LR
scheduler attached). The run is tests/e2e/io_crash_child.py; one run folder is killed and
resumed again and again, so each trial costs one process start. A save that replaces the
checkpoint at a fixed path is killed at each point of its commit (tests/e2e/io_commit_child.py):
the old or the new one loads, never none."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
STEPS, SLOW_SAVE = 60, 0.02


def _start(run_dir: str, cache_dir: str | None = None) -> subprocess.Popen:
    env = dict(os.environ, **({"MEGACOMPILE_CACHE_DIR": cache_dir} if cache_dir else {}))
    return subprocess.Popen([sys.executable, "-m", "tests.e2e.io_crash_child", run_dir, str(STEPS), str(SLOW_SAVE)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)


def _finish(p: subprocess.Popen) -> None:
    _, err = p.communicate(timeout=900)
    assert p.returncode == 0, err[-3000:]


def _log(run_dir: str) -> list[list[str]]:
    path = os.path.join(run_dir, "log")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [line.split() for line in f.read().splitlines() if line]


def _wait_for_training(run_dir: str, p: subprocess.Popen, lines_before: int) -> float:
    """Until the run has loaded its checkpoint and built its engine (it logs where it starts)."""
    while p.poll() is None:
        if len(_log(run_dir)) > lines_before:
            return time.monotonic()
        time.sleep(0.01)
    raise AssertionError(f"the run ended before it trained: {p.stderr.read()[-3000:]}")


def _kill_and_resume(run_dir: str, trials: int, rng: random.Random, step_seconds: float) -> list[str]:
    moments = []
    for _ in range(trials):
        before = _log(run_dir)
        p = _start(run_dir)
        began = _wait_for_training(run_dir, p, len(before))
        time.sleep(max(0.0, began + rng.uniform(0, 3 * step_seconds) - time.monotonic()))
        p.send_signal(signal.SIGKILL)
        p.wait()
        log = _log(run_dir)
        assert log[-1] != ["done"], "the run finished before the kill: give it more steps"
        moments.append("mid-save" if log[-1][0] == "saving" else "mid-step")
    _finish(_start(run_dir))
    return moments


def _check(run_dir: str, expected: dict[int, str]) -> None:
    saved, begun = -1, -1           # the last save that finished / began, over every run so far
    run, wrong = "fresh", []
    for line in _log(run_dir):
        if line[0] in ("fresh", "resumed"):
            start = int(line[1]) if line[0] == "resumed" else 0
            run = " ".join(line)
            # A finished save is never lost; an unfinished one is never taken.
            assert saved + 1 <= start <= begun + 1, (start, saved, begun)
        elif line[0] == "loss" and line[2] != expected[int(line[1])]:
            wrong.append(f"step {line[1]} ({run}): {line[2]} != {expected[int(line[1])]}")
        elif line[0] == "saved":
            saved = int(line[1])
        elif line[0] == "saving":
            begun = int(line[1])
    assert not wrong, wrong
    assert _log(run_dir)[-1] == ["done"]
    assert sorted(os.listdir(run_dir)) == ["log", f"step-{STEPS - 2}", f"step-{STEPS - 1}"]


@pytest.mark.long   # a process per kill, ~4 min on 2 cores; in CI the kill points below and train/test_resume.py stand for it
def test_twenty_kills_at_random_moments_resume_exactly(tmp_path):
    reference = str(tmp_path / "reference")
    os.makedirs(reference)
    # The reference plans on a cold profile cache (it calibrates, drawing random numbers), the
    # killed runs on a warm one: the random stream must not depend on which.
    p = _start(reference, cache_dir=str(tmp_path / "cold-cache"))
    began = _wait_for_training(reference, p, 0)
    _finish(p)
    step_seconds = (time.monotonic() - began) / STEPS
    expected = {int(x[1]): x[2] for x in _log(reference) if x[0] == "loss"}
    assert sorted(expected) == list(range(STEPS))
    run = str(tmp_path / "killed")
    os.makedirs(run)
    moments = _kill_and_resume(run, 20, random.Random(0), step_seconds)
    print({m: moments.count(m) for m in set(moments)})
    _check(run, expected)
    assert moments.count("mid-save") >= 3, moments      # the kills did land inside saves


@pytest.mark.slow   # a process per kill point: ~3 s each
@pytest.mark.parametrize("point", ["rename-1", "rename-2", "rmtree", "mid-rmtree", "none"])
def test_a_save_to_a_fixed_path_killed_anywhere_in_its_commit_leaves_one_that_loads(tmp_path, point):
    """The old checkpoint stays loadable until the new one, committed, has taken its place: a kill
    at each point between the renames leaves the old or the new one, never none, and the load
    that finds it leaves nothing else behind."""
    import megacompile
    from tests import models
    folder = str(tmp_path)
    engine = megacompile.compile(models.NanoGPT(vocab=96, d=32, layers=2), 1.0, device="cpu")
    engine.save_checkpoint(os.path.join(folder, "ck"), extra={"v": 1})
    child = subprocess.run([sys.executable, "-m", "tests.e2e.io_commit_child", folder, point], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == (0 if point == "none" else -signal.SIGKILL), child.stderr[-3000:]
    expected = {"rename-1": 1, "rename-2": 1}.get(point, 2)
    if point == "rename-2":
        assert not os.path.exists(os.path.join(folder, "ck"))     # only the folder moved aside holds one
    loaded = megacompile.compile(models.NanoGPT(vocab=96, d=32, layers=2), 1.0, device="cpu")
    assert loaded.load_checkpoint(os.path.join(folder, "ck")) == {"v": expected}
    assert os.listdir(folder) == ["ck"]
