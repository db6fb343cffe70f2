"""A run folder is one run's: a second process is refused while the first trains in it (run_lock.py),
and takes it once the first is gone however it ended; a run resumed from an earlier checkpoint of
its own folder sets the later ones aside, so that `resume: auto` goes on from the new branch; a
plan dump the disk refuses is the run's own error, naming the folder."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from megacompile.train import load, log, run
from megacompile.train.run_lock import RunFolderBusyError
from tests.train import files

TEXT = "the cat sat on the mat. " * 8
TINY = dict(model="bundled", bundled_model=dict(dim=32, layers=1, heads=2, kv_heads=1, ffn=64), device="cpu",
            seq=16)
HOLD = ("import sys, time\nfrom megacompile.train.run_lock import holding\n"
        "with holding(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(600)\n")


def _yaml(tmp_path, **settings) -> str:
    (tmp_path / "d.txt").write_text(TEXT)
    return files.run_yaml(str(tmp_path / "run.yaml"), **{**TINY, "data": ["d.txt"], "run_dir": "run", **settings})


def _holder(run_dir) -> subprocess.Popen:
    """Another process, holding the run folder as a run does."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_second_run_in_a_folder_another_process_trains_in_is_refused_and_changes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run(load(_yaml(tmp_path, steps=2), []))
    before = sorted(os.listdir(tmp_path / "run"))
    holder = _holder(tmp_path / "run")
    try:
        for resume in ("auto", None):
            with pytest.raises(RunFolderBusyError, match=rf"run_dir .*run is in use by another run \(pid {holder.pid} "
                                                         r"on .*\): .* give this run another run_dir"):
                run(load(_yaml(tmp_path, steps=4, resume=resume), []))
        assert sorted(os.listdir(tmp_path / "run")) == before
        assert [int(r["step"]) for r in log.read(str(tmp_path / "run" / "log.csv"))] == [1, 2]
    finally:
        holder.kill()
        holder.wait()
    # Killed, its lock went with it: the same command goes on.
    result = run(load(_yaml(tmp_path, steps=4, resume="auto"), []))
    assert result["steps"] == 4


def test_a_new_folder_a_refused_check_made_is_removed_with_its_lock(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Exception, match="lr"):
        run(load(_yaml(tmp_path, steps=2, run_dir="runs/new"), ["lr=-1"]))
    assert not os.path.exists(tmp_path / "runs")


def test_resuming_from_an_earlier_checkpoint_sets_the_later_ones_aside(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run(load(_yaml(tmp_path, steps=4, save_every=1, keep_last=None), []))
    checkpoints = tmp_path / "run" / "checkpoints"
    run(load(_yaml(tmp_path, steps=3, save_every=1, keep_last=None, lr=1e-4, resume="run/checkpoints/step-000002"),
             []))
    said = capsys.readouterr().out
    aside = checkpoints / "set-aside-at-step-000002"
    assert "the checkpoints after the one resumed from (step-000003, step-000004) are of the run it branches " \
           f"from: moved to {aside}, so that resume: auto goes on from this run's" in said
    assert sorted(os.listdir(aside)) == ["step-000003", "step-000004"]
    assert sorted(n for n in os.listdir(checkpoints) if n.startswith("step-")) == [
        "step-000001", "step-000002", "step-000003"]
    # The branch goes on from its own step 3, not the abandoned run's step 4.
    run(load(_yaml(tmp_path, steps=5, save_every=1, keep_last=None, lr=1e-4, resume="auto"), []))
    assert f"resumed        from {checkpoints / 'step-000003'} at step 3" in capsys.readouterr().out
    assert [int(r["step"]) for r in log.read(str(tmp_path / "run" / "log.csv"))] == [1, 2, 3, 4, 5]
    # A second branch from the same checkpoint sets its later ones aside in a folder of their own.
    run(load(_yaml(tmp_path, steps=3, save_every=1, keep_last=None, lr=2e-4, resume="run/checkpoints/step-000002"),
             []))
    assert sorted(os.listdir(aside)) == ["step-000003", "step-000004"]
    assert sorted(os.listdir(checkpoints / "set-aside-at-step-000002-2")) == ["step-000003", "step-000004",
                                                                                "step-000005"]


@pytest.mark.parametrize("named", ["run", "run/checkpoints", "run/checkpoints/latest"])
def test_resume_naming_a_run_folder_goes_on_from_its_latest_checkpoint(tmp_path, monkeypatch, capsys, named):
    """LlamaFactory's resume_from_checkpoint given megacompile's run folder (or its checkpoints
    folder) rather than a checkpoint in it: its latest committed checkpoint, as export takes it."""
    monkeypatch.chdir(tmp_path)
    run(load(_yaml(tmp_path, steps=2, save_every=1), []))
    capsys.readouterr()
    run(load(_yaml(tmp_path, steps=3, run_dir="next", resume=named), []))
    said = capsys.readouterr().out
    assert f"resume         {tmp_path / named} is a run folder: going on from its latest checkpoint" in said
    assert f"resumed        from {tmp_path / 'run' / 'checkpoints' / 'step-000002'} at step 2" in said
    assert [int(r["step"]) for r in log.read(str(tmp_path / "next" / "log.csv")) if int(r["step"]) > 0] == [3]


def test_the_lock_is_the_kernels_and_ends_with_its_process(tmp_path):
    holder = _holder(tmp_path / "run")
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    from megacompile.train.run_lock import holding
    with holding(str(tmp_path / "run")):
        assert (tmp_path / "run" / ".lock").read_text().split()[1] == str(os.getpid())


def test_a_plan_dump_the_disk_refuses_names_the_folder(tmp_path, monkeypatch):
    import errno

    from megacompile.errors import CheckpointError
    from megacompile.planner import Plan

    def full(self, folder):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(Plan, "dump", full)
    with pytest.raises(CheckpointError, match=r"cannot write the plan dump .*run/plan: the disk is full "
                                              r"\(No space left on device\)"):
        run(load(_yaml(tmp_path, steps=2), []))
