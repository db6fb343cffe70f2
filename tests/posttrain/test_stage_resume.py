"""A GRPO run from run.yaml (rollout batches of two micro-batches, each trained twice), killed with
SIGKILL between checkpoints and resumed with `resume: auto`, writes the uninterrupted run's
log.csv bit for bit, rewards included: the checkpoint holds the sampler's state and the prompt
position beside the weights, and the rollout batch is shuffled into micro-batches alike."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from megacompile.train import load, log, run
from tests.posttrain import stage_files
from tests.train import files
from tests.train.killed import TIMED      # the measured columns, which differ run to run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow   # two runs and a killed one
def test_a_grpo_run_killed_mid_way_resumes_to_the_uninterrupted_log(tmp_path):
    work = stage_files.workspace(tmp_path)

    def settings(name: str) -> dict:
        # a rollout batch of 2 micro-batches of 4 completions, trained twice: 4 steps a rollout batch
        return stage_files.grpo(work, str(tmp_path / name), batch=4, steps_per_generation=2, steps=8,
                                num_iterations=2, save_every=4, keep_last=2, resume="auto", beta=0.05,
                                epsilon_high=0.28)
    whole = run(load(files.run_yaml(str(tmp_path / "whole.yaml"), **settings("whole")), []))
    assert whole["steps"] == 8
    config = files.run_yaml(str(tmp_path / "cut.yaml"), **settings("cut"))
    child = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "train", "crash_child.py"), config, "7"],
                           cwd=ROOT, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PYTHONPATH": ROOT})      # the reward's module, tests.posttrain
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    cut = tmp_path / "cut"
    assert [r["step"] for r in log.read(str(cut / "log.csv"))] == ["1", "2", "3", "4", "5", "6", "7"]
    assert sorted(os.listdir(cut / "checkpoints")) == ["step-000004"]

    assert run(load(config, []))["steps"] == 8        # from step 4: step 5's rollout sampled again, shuffled alike
    a, b = log.read(str(tmp_path / "whole" / "log.csv")), log.read(str(cut / "log.csv"))
    assert [{k: v for k, v in r.items() if k not in TIMED} for r in a] == \
        [{k: v for k, v in r.items() if k not in TIMED} for r in b]
    assert len({r["reward"] for r in a}) > 1 and any(float(r["kl"]) > 0 for r in a)
    assert len({r["reward"] for r in a[:4]}) == 1            # one rollout batch's steps
    assert any(float(r["clip_ratio"]) > 0 or float(r["kl"]) > 0 for r in a[1:4] + a[5:])    # after its first step
