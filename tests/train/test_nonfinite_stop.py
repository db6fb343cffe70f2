"""A run stopped by a step whose loss is inf or NaN (on_nonfinite: raise) says so in the run's words,
names the records of the micro-batch that failed by file and line, saves the step before it (the
failed step changed nothing), and points to what goes past it: on_nonfinite=skip, which then does.
Records are named from the token file's order, past records that gave no document."""
from __future__ import annotations

import os
import re
import warnings

import pytest

from megacompile.errors import NonFiniteError
from megacompile.io.checkpoint import committed_beside
from megacompile.runtime import executor
from megacompile.engine.step import StepRecord
from megacompile.train import load, resume, run
from megacompile.train.data import tokens
from megacompile.train.data.origins import Origins
from tests.train import records
from tests.train.test_skip_streak import TINY

POISON = ord("~")      # a byte only the poisoned record holds (the bundled model reads bytes)


def _poison_rows_with(monkeypatch, byte: int) -> None:
    """A training micro-batch whose input_ids hold `byte` has a NaN loss, as a poisoned record's would."""
    ran = executor.Executor.run

    def poisoned(self, inputs, seed=1.0, context=None, check_loss=False):
        out = ran(self, inputs, seed, context, check_loss)
        if check_loss and any(getattr(t, "dtype", None) is not None and not t.is_floating_point() and (t == byte).any()
                              for t in (inputs if isinstance(inputs, list) else [inputs])):
            raise executor.NonFiniteLoss(float("nan"), out)
        return out
    monkeypatch.setattr(executor.Executor, "run", poisoned)


def _checkpoints(run_dir) -> list[str]:
    return [os.path.basename(p) for p in committed_beside(os.path.join(run_dir, "checkpoints", "latest"))]


def test_a_poisoned_record_is_named_and_the_sound_step_saved(tmp_path, monkeypatch, capsys):
    rows = records.texts(16)
    rows[9] = {"text": "the ~ poisoned ~ record ~"}
    data = records.jsonl(tmp_path / "data.jsonl", rows)
    _poison_rows_with(monkeypatch, POISON)
    run_dir = tmp_path / "run"
    settings = [*TINY, f"data={data}", f"run_dir={run_dir}", "steps=12", "save_every=1000", "resume=auto"]
    with pytest.raises(NonFiniteError) as caught:
        run(load(None, [*settings, "on_nonfinite=raise"]))
    message = str(caught.value)
    step = int(re.match(r"step (\d+) failed: the loss is nan, and on_nonfinite: raise stops the run", message)[1])
    assert step > 1
    # the poisoned record by file and line, beside the others its row holds: FILE:10 or FILE (lines 10, 14)
    assert re.search(rf"held the records? {re.escape(data)}(:10;| \(lines ([0-9, ]*, )?10[,)])", message), message
    assert "skipped" not in message and "compile(" not in message       # the run's words, not the API's
    # the step before the failed one is saved, and the way past the step is on_nonfinite=skip
    saved = f"step-{step - 1:06d}"
    assert _checkpoints(run_dir) == [saved]
    assert (f"its last checkpoint is {run_dir / 'checkpoints' / saved} (step {step - 1}): the same command with "
            "on_nonfinite=skip goes on from it") in message
    # the engine's own words stay compile()'s
    assert re.match(rf"step {step} failed: the loss is nan; nothing of it was applied.*compile\(\.\.\., "
                    r"on_nonfinite='skip'\)", str(caught.value.__cause__))
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as said:      # the poisoned record's rows, each skipped
        warnings.simplefilter("always")
        result = run(load(None, [*settings, "on_nonfinite=skip"]))
    assert f"step {step} skipped: the loss is nan" in str(said[0].message)
    assert result["steps"] == 12 and f"resumed        from {run_dir / 'checkpoints' / saved}" in capsys.readouterr().out


def test_records_are_found_past_those_that_gave_no_document(tmp_path):
    # an empty text gives the bundled model's tokenizer (no EOS) no token, and so no document; a blank
    # line is no record
    first = records.jsonl(tmp_path / "a.jsonl", [{"text": "one"}, {"text": ""}, {"text": "two"}, {"text": ""},
                                                 {"text": ""}, {"text": "three"}])
    with open(tmp_path / "b.jsonl", "w") as f:
        f.write('{"text": "four"}\n\n{"text": "five"}\n')
    entries = tokens.as_entries([first, str(tmp_path / "b.jsonl")])
    made = tokens.token_file(str(tmp_path / "tokens"), "train", entries, tokens.ByteTokenizer(), None, False)
    assert made.n_docs == 5
    found = Origins(made, entries, tokens.ByteTokenizer(), False, None)
    assert found.of_documents([4, 2, 0, 1, 3]) == [f"{tmp_path}/b.jsonl:3", f"{first}:6", f"{first}:1", f"{first}:3",
                                                   f"{tmp_path}/b.jsonl:1"]


def test_a_stage_that_names_no_records_still_says_what_goes_on():
    # a streamed run's rows and stage grpo's rollouts keep no file and line
    c = load(None, [*TINY, "grad_accum=2", "run_dir=RUN", "resume=auto"])
    record = StepRecord(4, 2.5, 1, True, skipped="gradient", reason="2 gradients hold inf or NaN (w, b)")
    said = resume.failed_step(c, "RUN", record, None, (2, "RUN/checkpoints/step-000002"),
                              "the checkpoint of step 3 could not be written (the disk is full)")
    assert said == ("step 4 failed: 2 gradients hold inf or NaN (w, b), and on_nonfinite: raise stops the run at "
                    "such a step (nothing of step 4 was applied); the checkpoint of step 3 could not be written (the "
                    "disk is full); its last checkpoint is RUN/checkpoints/step-000002 (step 2, training step 3 "
                    "again): the same command with on_nonfinite=skip goes on from it and passes over such steps with "
                    "a warning (on_nonfinite: skip in run.yaml); as it is, it would feed step 4 the same data again")
    assert resume._by_file(["a.jsonl:5", "a.jsonl:2", "b.txt line 3", "t row 4", "t row 1", "the bundled corpus"]) \
        == "a.jsonl (lines 2, 5), b.txt:3, t (rows 1, 4), the bundled corpus"
