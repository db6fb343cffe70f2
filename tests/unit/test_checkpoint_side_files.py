"""A checkpoint's side files (a run's trainer_state.json): written in the folder before it is
committed, under plain names of their own; a name that would be a path or one of the checkpoint's
own files is refused."""
from __future__ import annotations

import os

import pytest

from megacompile.errors import CheckpointError
from megacompile.io import checkpoint


def test_side_files_are_in_the_folder_when_it_commits(tmp_path):
    tmp, path = tmp_path / ".step-000001.1.partial", tmp_path / "step-000001"
    tmp.mkdir()
    checkpoint.commit(str(tmp), str(path), {"files": {}}, {"trainer_state.json": "{}\n"})
    assert sorted(os.listdir(path)) == ["COMMITTED", "manifest.json", "trainer_state.json"]
    assert (path / "trainer_state.json").read_text() == "{}\n"


@pytest.mark.parametrize("name", ["../elsewhere.json", "sub/x.json", ".hidden", "manifest.json", "COMMITTED",
                                  "owner-0000.safetensors"])
def test_a_side_file_that_is_a_path_or_one_of_the_checkpoints_own_is_refused(tmp_path, name):
    tmp = tmp_path / ".step-000001.1.partial"
    tmp.mkdir()
    with pytest.raises(CheckpointError, match="is no plain file name of its own"):
        checkpoint.commit(str(tmp), str(tmp_path / "step-000001"), {"files": {"owner-0000.safetensors": {}}},
                          {name: "{}"})
    assert not (tmp_path / "step-000001").exists() and not (tmp_path / "elsewhere.json").exists()
