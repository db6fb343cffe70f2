"""durable.replace_text: a file replaced whole (the run's end figures, train/results.py): the new
text, or the old where the write fails, and no temporary file left beside it."""
from __future__ import annotations

import os

import pytest

from megacompile.io import durable


def test_the_file_is_replaced_whole(tmp_path):
    path = tmp_path / "trainer_state.json"
    path.write_text("old\n")
    durable.replace_text(str(path), "new\n")
    assert path.read_text() == "new\n" and os.listdir(tmp_path) == ["trainer_state.json"]


def test_a_failed_replacement_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "trainer_state.json"
    path.write_text("old\n")

    def refused(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "replace", refused)
    with pytest.raises(OSError):
        durable.replace_text(str(path), "new\n")
    assert path.read_text() == "old\n" and os.listdir(tmp_path) == ["trainer_state.json"]
