"""A checkpoint pinned by a reader (an export) outlives the keep_last rotation of the run that
goes on saving beside it, and goes at the first rotation after its release; a pin left by a dead
process pins nothing; several readers pin one checkpoint until the last lets go."""
from __future__ import annotations

import json
import os
import signal

from megacompile.io import checkpoint
from megacompile.io.checkpoint_pin import pin_path, pinned

RUN = "run-a"


def _checkpoints(folder, steps=(1, 2, 3)) -> list[str]:
    """Committed stub checkpoints, as committed_beside lists them: a manifest and its marker."""
    out = []
    for step in steps:
        path = folder / f"step-{step:06d}"
        path.mkdir()
        (path / checkpoint.MANIFEST).write_text(json.dumps({"format": checkpoint.FORMAT, "steps_done": step,
                                                            "micro_batches": step, "run": RUN}))
        (path / checkpoint.MARKER).write_text("sealed\n")
        out.append(str(path))
    return out


def _left(folder) -> list[str]:
    return sorted(os.listdir(folder))


def test_a_pinned_checkpoint_outlives_the_rotation_until_its_pin_is_released(tmp_path):
    first, _, last = _checkpoints(tmp_path)
    with pinned(first) as held:
        assert held and os.path.isfile(pin_path(first))
        checkpoint.rotate(last, RUN, keep_last=1)
        assert _left(tmp_path) == [".step-000001.pin", "step-000001", "step-000003"]    # step 2 went
    assert _left(tmp_path) == ["step-000001", "step-000003"]        # the pin file goes with its pin
    checkpoint.rotate(last, RUN, keep_last=1)
    assert _left(tmp_path) == ["step-000003"]


def test_a_pin_left_by_a_killed_reader_pins_nothing(tmp_path):
    first, _, last = _checkpoints(tmp_path)
    pid = os.fork()
    if pid == 0:        # the reader, killed while it holds its pin: the file stays, its lock does not
        try:
            with pinned(first):
                os.kill(os.getpid(), signal.SIGKILL)
        finally:
            os._exit(1)
    os.waitpid(pid, 0)
    assert os.path.isfile(pin_path(first))
    checkpoint.rotate(last, RUN, keep_last=1)
    assert _left(tmp_path) == ["step-000003"]       # removed, its stale pin file with it


def test_two_readers_pin_one_checkpoint_until_the_last_lets_go(tmp_path):
    first, _, last = _checkpoints(tmp_path)
    with pinned(first):
        with pinned(first):
            pass
        assert os.path.isfile(pin_path(first))      # the other reader's pin is still there
        checkpoint.rotate(last, RUN, keep_last=1)
        assert "step-000001" in _left(tmp_path)
    checkpoint.rotate(last, RUN, keep_last=1)
    assert _left(tmp_path) == ["step-000003"]


def test_a_folder_that_is_not_there_is_not_pinned(tmp_path):
    with pinned(str(tmp_path / "gone" / "step-000001")) as held:
        assert not held


def test_an_export_of_a_run_whose_latest_keeps_being_removed_gives_up_by_name(tmp_path, monkeypatch):
    """A run folder's latest checkpoint chosen, then removed by the run's keep_last before the pin
    holds it, each of three times: the export says so, naming a checkpoint folder to give."""
    import pytest

    from megacompile.errors import ArgumentError
    from megacompile.io import durable
    from megacompile.train import checkpoint_export
    latest = _checkpoints(tmp_path, steps=(4,))[0]
    chosen = []
    monkeypatch.setattr(checkpoint_export, "checkpoint_of", lambda path: chosen.append(path) or latest)
    monkeypatch.setattr(durable, "committed", lambda path: False)      # gone each time, once pinned
    with pytest.raises(ArgumentError, match=r"the latest checkpoint of .* was removed 3 times before it could be "
                                            r"read .*give a checkpoint folder"):
        with checkpoint_export._pinned(str(tmp_path)):
            raise AssertionError("a removed checkpoint was handed out")
    assert len(chosen) == 3 and not os.path.exists(pin_path(latest))
