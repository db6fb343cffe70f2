"""An epoch's steps (train/stages/epochs.py): whole steps that run on into the next epoch, the
Trainer's count beside them where the two differ, and the logged epoch as the items read."""
from __future__ import annotations

from types import SimpleNamespace

from megacompile.train.stages import epochs


def _run(batch=3, grad_accum=2, global_batch=None, epochs_given=2.0):
    return SimpleNamespace(batch=batch, grad_accum=grad_accum, global_batch=global_batch, epochs=epochs_given)


def test_37_rows_in_steps_of_6_are_13_steps_for_2_epochs_where_the_trainer_takes_14():
    # the Trainer: 13 micro-batches an epoch (the last of 1 row), 7 steps (the last of 1 micro-batch)
    c = _run()
    assert epochs.steps(c, 37, 2.0) == 13 and epochs.trainer_steps(c, 37, 2.0) == 14
    assert epochs.steps(c, 37, 0.5) == 4 and epochs.trainer_steps(c, 37, 0.5) == 4
    [line] = epochs.note(c, 37, "rows")
    assert line.split(None, 1)[1] == (
        "2 of 37 rows in 13 steps of 6: an epoch's last rows share a step with the next epoch's first; "
        "transformers' Trainer (LlamaFactory, TRL) ends each epoch with a shorter step: 14 steps")


def test_whole_steps_agree_with_the_trainer_and_say_nothing():
    c = _run(batch=2, grad_accum=2)
    assert epochs.steps(c, 36, 3.0) == epochs.trainer_steps(c, 36, 3.0) == 27
    assert epochs.note(c, 36, "pairs") == [] and epochs.note(_run(epochs_given=None), 37, "rows") == []


def test_a_global_batch_counts_its_rows_a_step_and_names_no_trainer_count():
    c = _run(batch=4, grad_accum=1, global_batch=8, epochs_given=1.0)
    assert epochs.per_step(c) == 8 and epochs.steps(c, 20, 1.0) == 3
    [line] = epochs.note(c, 20, "rows")
    assert "1 of 20 rows in 3 steps of 8" in line and "Trainer" not in line
