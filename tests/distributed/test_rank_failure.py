"""A rank that dies or hangs mid-run: every other rank stops soon, with a DistributedError that
names it and says how to resume; no checkpoint is left half-written; the ranks started again
from the last committed checkpoint go on exactly as the run would have."""
from __future__ import annotations

import json
import os
from datetime import timedelta

import pytest

from megacompile.distributed import liveness, timeouts
from megacompile.errors import ArgumentError

from . import dying, ranks

# A peer that dies closes its sockets: the others hear of it at once and spend the roll call's
# wait on it (liveness.ANSWER_WAIT); the rest is the error's way out of the process.
DEATH_BOUND = liveness.ANSWER_WAIT + 7.0       # s


def _read(folder, name):
    with open(os.path.join(folder, name)) as f:
        return json.load(f)


def _error(folder, rank: int) -> str:
    return (folder / f"rank{rank}.error").read_text()


def test_a_killed_rank_is_named_and_the_other_stops_within_the_bound(tmp_path, monkeypatch):
    monkeypatch.delenv(timeouts.ENV, raising=False)        # the timeouts the run sets itself
    exits = dying.launch("die", 2, str(tmp_path), how="kill", at=6)
    assert exits[1][0] == -9
    code, exited = exits[0]
    assert code == 1
    took = exited - _read(tmp_path, "ended-at")
    print(f"the surviving rank exited {took:.2f} s after rank 1 was killed")
    assert took < DEATH_BOUND
    error = _error(tmp_path, 0).splitlines()[-1]
    ckpt = str(tmp_path / "ckpt" / f"step-{dying.SAVE_AT}")
    assert error.startswith("megacompile.errors.DistributedError: rank 0 of 2: "), error
    assert "rank 1 did not answer" in error and "died or froze" in error, error
    assert f"start all 2 ranks again and, on each, engine.load_checkpoint({ckpt!r})" in error, error
    assert f"(step {dying.SAVE_AT})" in error, error
    # The waits: the long one until a step had run, then the steps' floor (a tiny model's step is ms).
    for rank in range(2):
        waits = _read(tmp_path, f"timeouts-{rank}.json")
        assert waits["before"] == {"ranks": timeouts.LONG, "gloo": timeouts.LONG}
        assert waits["paced"] == {"ranks": timeouts.STEP_FLOOR, "gloo": timeouts.STEP_FLOOR}


@pytest.mark.slow
def test_a_rank_killed_while_saving_leaves_the_last_checkpoint_and_the_run_resumes_exactly(tmp_path, monkeypatch):
    monkeypatch.setenv(timeouts.ENV, "30")
    at = 5
    exits = dying.launch("die", 2, str(tmp_path), how="save", at=at)
    assert exits[1][0] == -9 and exits[0][0] == 1
    assert exits[0][1] - _read(tmp_path, "ended-at") < DEATH_BOUND
    ckpt = tmp_path / "ckpt"
    last = ckpt / f"step-{dying.SAVE_AT}"
    error = _error(tmp_path, 0).splitlines()[-1]
    assert "writing the checkpoint failed: rank 1 did not answer" in error, error
    assert repr(str(last)) in error, error
    # the save cut short left nothing: no step-5, no partial folder; step-3 is whole
    assert sorted(os.listdir(ckpt)) == ["state-0.pt", "state-1.pt", f"step-{dying.SAVE_AT}"]
    assert (last / "COMMITTED").is_file()
    died = [_read(tmp_path, f"losses-{r}.json") for r in range(2)]
    assert [len(d) for d in died] == [at, at]

    again = tmp_path / "again"
    again.mkdir()
    ranks.spawn("train", 2, str(again), resume=str(last))
    resumed = [_read(again, f"rank{r}.json") for r in range(2)]
    assert all(r["exact"] for r in resumed)          # masters and moments as the ranks held them
    for r in range(2):        # the steps both runs took, bit for bit
        assert resumed[r]["losses"][:at - dying.SAVE_AT] == died[r][dying.SAVE_AT:], r


@pytest.mark.slow
def test_a_hung_rank_is_named_once_the_wait_runs_out(tmp_path, monkeypatch):
    wait = 4
    monkeypatch.setenv(timeouts.ENV, str(wait))
    exits = dying.launch("die", 2, str(tmp_path), how="hang", at=4, awaited=[0])
    assert exits[1] == (None, None)        # asleep: killed by launch() once rank 0 was done
    code, exited = exits[0]
    took = exited - _read(tmp_path, "ended-at")
    print(f"the surviving rank exited {took:.2f} s after rank 1 hung (timeout {wait} s)")
    assert code == 1 and wait <= took < wait + DEATH_BOUND
    error = _error(tmp_path, 0).splitlines()[-1]
    assert "rank 1 is alive but never reached it" in error and "it hangs, or runs something" in error, error
    assert f"waited up to {wait} s, {timeouts.ENV} sets it" in error, error


def test_the_steps_wait_follows_the_step_with_a_floor(monkeypatch):
    monkeypatch.delenv(timeouts.ENV, raising=False)
    assert timeouts.long() == timedelta(seconds=timeouts.LONG)
    assert timeouts.for_steps(0.01, 0.02) == timedelta(seconds=timeouts.STEP_FLOOR)
    assert timeouts.for_steps(30.0, 12.0) == timedelta(seconds=30.0 * timeouts.STEP_MULTIPLE)
    assert timeouts.for_steps(None, 45.0) == timedelta(seconds=45.0 * timeouts.STEP_MULTIPLE)   # slower than predicted
    monkeypatch.setenv(timeouts.ENV, "7.5")
    assert timeouts.long() == timeouts.for_steps(30.0, 12.0) == timedelta(seconds=7.5)
    for bad in ("0", "-3", "inf", "ten"):
        monkeypatch.setenv(timeouts.ENV, bad)
        with pytest.raises(ArgumentError, match=timeouts.ENV):
            timeouts.long()


def test_the_roll_call_blames_the_silent_and_the_late():
    rank_of = {10: 0, 11: 1, 12: 2}
    alive = {"MainThread": [7, "agreeing on the step's losses"]}
    assert liveness.blame({11: None, 12: alive}, "MainThread", 7, rank_of).startswith("rank 1 did not answer")
    late = liveness.blame({11: alive, 12: {"MainThread": [6, None]}}, "MainThread", 7, rank_of)
    assert late.startswith("rank 2 is alive but never reached it (its MainThread thread is past collective 6")
    assert liveness.blame({11: alive, 12: alive}, "MainThread", 7, rank_of) is None
    assert "store did not answer" in liveness.blame(None, "MainThread", 7, rank_of)
