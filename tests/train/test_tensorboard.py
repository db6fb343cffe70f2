"""`log: [csv, tensorboard]` writes each step's scalars as TensorBoard events, and a resumed run's
events replace those of the steps after its checkpoint, as its CSV rows do; a skipped step's row
(its number the next update's) is the CSV's alone."""
from __future__ import annotations

import pytest

from megacompile.train.log import RunLog
from tests.train import files

pytest.importorskip("tensorboard")


def _row(step: int, loss: float) -> dict:
    return {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 0.5, "tokens": 64, "seconds": 0.1,
            "tokens_per_s": 640.0, "device_peak_bytes": 1024, "predicted_device_peak_bytes": 1024,
            "skipped": None}


def test_scalars_are_written_and_a_resume_replaces_the_steps_after_its_checkpoint(tmp_path):
    run_dir = str(tmp_path)
    log = RunLog(run_dir, ["csv", "tensorboard"], resume_step=0)
    for step in (1, 2, 3):
        log.write(_row(step, 4.0 - step))
    log.write({**_row(3, 1.0), "eval_loss": 1.5, "eval_perplexity": 4.5} | {"step": 4})
    log.close()
    first = files.board_scalars(run_dir)
    assert first["train/loss"] == [(1, 3.0), (2, 2.0), (3, 1.0), (4, 1.0)]
    assert first["eval/loss"] == [(4, 1.5)] and first["eval/perplexity"] == [(4, 4.5)]
    assert [s for s, _ in first["train/grad_norm"]] == [1, 2, 3, 4]

    log = RunLog(run_dir, ["csv", "tensorboard"], resume_step=2)     # from a checkpoint at step 2
    log.write(_row(3, 0.25))
    log.close()
    assert files.board_scalars(run_dir)["train/loss"] == [(1, 3.0), (2, 2.0), (3, 0.25)]


def test_a_skipped_steps_row_is_in_the_csv_alone(tmp_path):
    run_dir = str(tmp_path)
    log = RunLog(run_dir, ["csv", "tensorboard"], resume_step=0)
    log.write(_row(1, 3.0))
    log.write({**_row(2, 9.0), "lr": None, "grad_norm": None, "skipped": "gradient"})   # tried again as step 2
    log.write(_row(2, 2.0))
    log.close()
    assert files.board_scalars(run_dir)["train/loss"] == [(1, 3.0), (2, 2.0)]
    assert [(r["step"], r["skipped"]) for r in files.log_rows(run_dir)] == [("1", ""), ("2", "gradient"), ("2", "")]
