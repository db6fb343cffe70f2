"""A stop signal (SIGTERM, SIGUSR1) during `megacompile train`: the step in flight completes, a
checkpoint of it is written, the command exits 128 + the signal's number and says how to resume;
the same command resumes to the log of a run never interrupted, row for row."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from megacompile.cli import main
from megacompile.engine.engine import Engine
from megacompile.io import checkpoint, durable
from megacompile.train import load, log, run
from megacompile.train.preemption import StopSignals
from tests.train import files

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAME = ("step", "loss", "lr", "grad_norm", "tokens", "device_peak_bytes", "predicted_device_peak_bytes", "skipped")
TINY = dict(bundled_model=dict(dim=32, layers=1, heads=2, kv_heads=1, ffn=64), device="cpu", batch=1, grad_accum=2,
            seq=16, steps=5, lr=3e-3, warmup=1, save_every=2, keep_last=2, resume="auto", log_every=1)


@pytest.fixture
def uncaught():
    """A SIGTERM or SIGUSR1 that no run catches fails the test instead of killing the test process."""
    def unexpected(signum, frame):
        raise AssertionError(f"{signal.Signals(signum).name} reached the test: the run did not catch it")
    before = {s: signal.signal(s, unexpected) for s in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for s, handler in before.items():
        signal.signal(s, handler)


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> list[dict]:
    """The log rows of the run never interrupted."""
    folder = tmp_path_factory.mktemp("whole")
    run(load(files.run_yaml(str(folder / "whole.yaml"), run_dir="whole", **TINY), []))
    return _rows(folder / "whole")


def _config(tmp_path, name: str, **more) -> str:
    return files.run_yaml(str(tmp_path / f"{name}.yaml"), run_dir=name, **{**TINY, **more})


def _rows(run_dir) -> list[dict]:
    return [{k: r[k] for k in SAME} for r in log.read(os.path.join(run_dir, "log.csv"))]


def _signal_at_step(monkeypatch, at: int, signum=signal.SIGTERM) -> None:
    """The signal comes as the first micro-batch of optimizer step `at` begins: that step is in flight."""
    step = Engine.weighted_step

    def step_with_signal(self, *args, **kwargs):
        if self.steps_done == at - 1 and self.state.micro_batches % self.state.grad_accum == 0:
            os.kill(os.getpid(), signum)
        return step(self, *args, **kwargs)
    monkeypatch.setattr(Engine, "weighted_step", step_with_signal)


def test_sigterm_mid_step_saves_that_step_and_the_same_command_resumes_exactly(tmp_path, monkeypatch, capsys,
                                                                               uncaught, whole):
    monkeypatch.chdir(tmp_path)
    config = _config(tmp_path, "cut")
    _signal_at_step(monkeypatch, 3)
    assert main(["train", "--config", config]) == 128 + signal.SIGTERM
    said = capsys.readouterr().err
    assert "SIGTERM at step 3: stopped after the whole step" in said
    assert f"resume with   megacompile train --config {config}\n" in said
    assert [r["step"] for r in _rows("cut")] == ["1", "2", "3"]          # step 3 ran whole: both micro-batches
    assert sorted(os.listdir("cut/checkpoints")) == ["step-000002", "step-000003"]
    assert checkpoint.verified_manifest("cut/checkpoints/step-000003")["micro_batches"] == 6

    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config", config]) == 0
    assert _rows("cut") == whole


def test_sigterm_during_a_save_finishes_it_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, capsys,
                                                                             uncaught, whole):
    monkeypatch.chdir(tmp_path)
    config = _config(tmp_path, "cut")
    fsync_file, sent = durable.fsync_file, []

    def fsync_then_signal(path):
        fsync_file(path)
        if ".step-000004." in path and not sent:     # step 4's first file, in its .partial folder
            sent.append(path)
            os.kill(os.getpid(), signal.SIGTERM)
    monkeypatch.setattr(durable, "fsync_file", fsync_then_signal)
    assert main(["train", "--config", config]) == 143
    assert "SIGTERM at step 4" in capsys.readouterr().err and sent
    assert sorted(os.listdir("cut/checkpoints")) == ["step-000002", "step-000004"]      # no leftover
    for kept in ("step-000002", "step-000004"):
        checkpoint.verified_manifest(os.path.join("cut/checkpoints", kept))
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config", config]) == 0
    assert _rows("cut") == whole


def test_sigusr1_and_a_run_dir_to_name(tmp_path, monkeypatch, capsys, uncaught):
    """SIGUSR1 (SLURM's --signal) exits 138; a run without resume: auto is told the keys to add."""
    monkeypatch.chdir(tmp_path)
    config = files.run_yaml(str(tmp_path / "plain.yaml"), **{**TINY, "resume": None})
    _signal_at_step(monkeypatch, 2, signal.SIGUSR1)
    assert main(["train", "--config", config, "steps=3"]) == 128 + signal.SIGUSR1
    said = capsys.readouterr().err
    run_dir = next(p for p in os.listdir("runs"))
    assert "SIGUSR1 at step 2" in said
    assert f"megacompile train --config {config} steps=3 resume=auto run_dir=runs/{run_dir}" in said
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config", config, "steps=3", "resume=auto", f"run_dir=runs/{run_dir}"]) == 0
    assert [r["step"] for r in _rows(f"runs/{run_dir}")] == ["1", "2", "3"]


def test_stop_signals_for_a_loop_of_ones_own(uncaught):
    with StopSignals(["SIGUSR1"]) as stop:
        assert stop.active and stop.requested is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.requested == signal.SIGUSR1 and stop.exit_code == 138 and stop.name == "SIGUSR1"
    with pytest.raises(AssertionError, match="SIGUSR1 reached the test"):      # the handler before it is back
        os.kill(os.getpid(), signal.SIGUSR1)


@pytest.mark.slow       # a real process, started and signalled from outside: ~15 s on 2 cores
def test_a_scheduler_sigterm_from_outside(tmp_path):
    config = _config(tmp_path, "cut", steps=400, save_every=None)
    child = subprocess.Popen([sys.executable, "-m", "megacompile", "train", "--config", config], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    csv = tmp_path / "cut" / "log.csv"
    while not (csv.exists() and len(csv.read_text().splitlines()) > 3):
        assert child.poll() is None, child.communicate()[1][-2000:]
        time.sleep(0.05)
    sent = time.monotonic()
    child.send_signal(signal.SIGTERM)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 143, err[-2000:]
    assert time.monotonic() - sent < 30          # a step and a save of a tiny model, not the whole run
    step = int(log.read(str(csv))[-1]["step"])
    assert os.listdir(tmp_path / "cut" / "checkpoints") == [f"step-{step:06d}"]
    assert "resume with   megacompile train --config" in err


def test_ctrl_c_outside_stop_signals_says_which_checkpoint_the_same_command_goes_on_from(tmp_path, monkeypatch,
                                                                                        capsys, whole):
    """SIGINT not among stop_signals: the step in flight is dropped whole (KeyboardInterrupt), and the
    run says where it goes on from; with SIGINT among them Ctrl-C saves the step first."""
    monkeypatch.chdir(tmp_path)
    config = _config(tmp_path, "cut")
    _signal_at_step(monkeypatch, 3, signal.SIGINT)
    assert main(["train", "--config", config]) == 130
    said = capsys.readouterr().err
    assert "interrupted    the run stopped after step 2; the same command goes on from its last checkpoint, " in said
    assert "step-000002 (step 2) (with SIGINT among stop_signals, Ctrl-C finishes the step in flight and saves it " \
           "first)" in said
    assert [r["step"] for r in _rows("cut")] == ["1", "2"]
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config", config]) == 0
    assert _rows("cut") == whole

    _signal_at_step(monkeypatch, 2, signal.SIGINT)
    assert main(["train", "--config", _config(tmp_path, "saved", stop_signals=["SIGINT"])]) == 130
    assert "SIGINT at step 2: stopped after the whole step; its checkpoint is " in capsys.readouterr().err
    assert sorted(os.listdir("saved/checkpoints")) == ["step-000002"]
