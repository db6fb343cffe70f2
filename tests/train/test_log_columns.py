"""log.csv over a resume whose settings change its columns (compute_accuracy, eval_on_each_dataset
turned on or off): the rows before the checkpoint keep every figure they hold, the header names
every column, and the rows after it are written under the same header; a figure first logged after
the header (a reward function's log_metric) widens it."""
from __future__ import annotations

import os

from megacompile.train import log
from megacompile.train.log import COLUMNS, RunLog


def _row(step: int, **extra) -> dict:
    return {"step": step, "loss": 1.0 / step, **extra}


def test_a_column_the_log_had_stays_and_a_new_one_is_empty_before(tmp_path):
    run_dir = str(tmp_path)
    first = RunLog(run_dir, ["csv"], 0, columns=COLUMNS + ("eval_first_loss",))
    for step in (1, 2, 3):
        first.write(_row(step, eval_first_loss=0.5 * step))
    first.close()
    # resumed from step 2 with eval_on_each_dataset off and compute_accuracy on
    again = RunLog(run_dir, ["csv"], 2, columns=COLUMNS + ("eval_accuracy",))
    again.write(_row(3, eval_accuracy=0.25))
    again.close()
    rows = log.read(os.path.join(run_dir, "log.csv"))
    assert [r["step"] for r in rows] == ["1", "2", "3"]
    assert [r["eval_first_loss"] for r in rows] == ["0.5", "1.0", ""]
    assert [r["eval_accuracy"] for r in rows] == ["", "", "0.25"]
    assert rows[2]["loss"] == repr(1.0 / 3)


def test_a_figure_first_logged_after_the_header_widens_it(tmp_path):
    run_dir = str(tmp_path)
    written = RunLog(run_dir, ["csv"], 0)
    written.write(_row(1))
    written.write(_row(2, my_metric=0.5))
    written.write(_row(3, my_metric=1.5, other=2.0))
    written.close()
    rows = log.read(os.path.join(run_dir, "log.csv"))
    assert [r["step"] for r in rows] == ["1", "2", "3"]
    assert [r["my_metric"] for r in rows] == ["", "0.5", "1.5"] and [r["other"] for r in rows] == ["", "", "2.0"]
    assert rows[0]["loss"] == "1.0" and list(rows[0])[:len(COLUMNS)] == list(COLUMNS)
    assert written.extra == ("my_metric", "other")          # TensorBoard's and W&B's scalars take them too
