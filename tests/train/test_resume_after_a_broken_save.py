"""Which checkpoint `megacompile train` goes on from when the last save went wrong: `resume: auto`
passes over what a save killed mid-write leaves (a dead writer's partial folder, a folder without
its COMMITTED marker) and resumes from the last complete one; a committed checkpoint that lost a
file is refused before anything of the run folder changes, naming the one before it and the
`resume=` that goes on from it. Either way the run ends with the log of a run never broken."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from megacompile.errors import WeightsFileError
from megacompile.io import checkpoint
from megacompile.train import load, run
from tests.train import files

TINY = dict(bundled_model=dict(dim=32, layers=1, heads=2, kv_heads=1, ffn=64), device="cpu", batch=1, seq=16,
            steps=6, lr=3e-3, warmup=1, save_every=2, keep_last=3, resume="auto", log_every=1)



@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> list[dict]:
    return files.unbroken_run(tmp_path_factory.mktemp("whole"), **TINY)


def _four_steps(tmp_path) -> tuple[str, str]:
    """A run stopped after step 4, with the checkpoints of steps 2 and 4: its config and checkpoints folder."""
    config = files.run_yaml(str(tmp_path / "run.yaml"), run_dir="run", **TINY)
    run(load(config, ["steps=4"]))
    folder = str(tmp_path / "run" / "checkpoints")
    assert sorted(os.listdir(folder)) == ["step-000002", "step-000004"]
    return config, folder


def _dead_pid() -> int:
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(child.stdout)


def _cut_short(path: str) -> None:
    owner = next(os.path.join(path, f) for f in sorted(os.listdir(path)) if f.startswith("owner-"))
    os.truncate(owner, os.path.getsize(owner) // 2)


def test_resume_auto_passes_over_saves_killed_mid_write(tmp_path, whole, capsys):
    config, folder = _four_steps(tmp_path)
    step_4, step_2 = os.path.join(folder, "step-000004"), os.path.join(folder, "step-000002")
    os.remove(os.path.join(step_4, checkpoint.MARKER))      # killed before its marker: a writer without the rename
    _cut_short(step_4)
    partial = os.path.join(folder, f".step-000006.{_dead_pid()}.partial")      # killed mid-write
    shutil.copytree(step_2, partial)
    os.remove(os.path.join(partial, checkpoint.MARKER))
    _cut_short(partial)
    capsys.readouterr()

    assert run(load(config, []))["steps"] == 6
    assert f"resumed        from {step_2} at step 2" in capsys.readouterr().out
    assert files.log_rows(tmp_path / "run") == whole
    assert sorted(os.listdir(folder)) == ["step-000002", "step-000004", "step-000006"]
    for kept in os.listdir(folder):
        checkpoint.verified_manifest(os.path.join(folder, kept))


def test_a_committed_checkpoint_that_lost_a_file_is_refused_naming_the_one_before(tmp_path, whole, capsys):
    config, folder = _four_steps(tmp_path)
    step_4, step_2 = os.path.join(folder, "step-000004"), os.path.join(folder, "step-000002")
    owner = next(f for f in sorted(os.listdir(step_4)) if f.startswith("owner-"))
    os.remove(os.path.join(step_4, owner))
    with open(tmp_path / "run" / "log.csv", "rb") as f:
        rows_before = f.read()

    with pytest.raises(WeightsFileError) as refused:
        run(load(config, []))
    assert str(refused.value) == (
        f"cannot load the checkpoint {step_4}: {owner} is missing; nothing was loaded; the last committed checkpoint "
        f"beside it is {step_2}; give resume={step_2} to go on from it (or move {step_4} away: resume: auto then "
        "takes it)")
    with open(tmp_path / "run" / "log.csv", "rb") as f:
        assert f.read() == rows_before

    assert run(load(config, [f"resume={step_2}"]))["steps"] == 6
    assert files.log_rows(tmp_path / "run") == whole
    checkpoint.verified_manifest(step_4)        # written again by the resumed run, whole
    capsys.readouterr()
    assert run(load(config, []))["complete"]
