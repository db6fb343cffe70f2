"""A checkpoint of `megacompile train` that the disk refuses partway (full, or an I/O error): the run
stops with CheckpointError naming the folder, the bytes the checkpoint needs and the free space,
and the checkpoint it goes on from; that previous checkpoint stays committed and byte for byte as
it was (keep_last: 1 removes nothing before the new one is complete), nothing half-written is
left, and the same command resumes to the log of a run whose disk never filled."""
from __future__ import annotations

import errno
import os
import re

import pytest
import safetensors.torch

from megacompile.errors import CheckpointError
from megacompile.io import checkpoint, durable
from megacompile.train import load, run
from tests.train import files

TINY = dict(bundled_model=dict(dim=32, layers=1, heads=2, kv_heads=1, ffn=64), device="cpu", batch=1, seq=16,
            steps=5, lr=3e-3, warmup=1, save_every=2, keep_last=1, resume="auto", log_every=1)



@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> list[dict]:
    return files.unbroken_run(tmp_path_factory.mktemp("whole"), **TINY)


def _fail_in_step_4(monkeypatch, where: str, code: int) -> list:
    """The write of step 4's checkpoint fails at `where`: a tensor file half written, its fsync, or
    the COMMITTED marker (the last file)."""
    hits = []

    def failing(real, target_of):
        def write(*args, **kwargs):
            target = target_of(*args, **kwargs)
            if ".step-000004." in target:
                hits.append(target)
                if where == "tensor file":
                    with open(target, "wb") as f:
                        f.write(b"half a file")
                raise OSError(code, os.strerror(code), target)
            return real(*args, **kwargs)
        return write

    if where == "tensor file":
        monkeypatch.setattr(safetensors.torch, "save_file",
                            failing(safetensors.torch.save_file, lambda tensors, target, *a, **k: target))
    elif where == "fsync":
        monkeypatch.setattr(durable, "fsync_file", failing(durable.fsync_file, lambda path: path))
    else:
        real = durable.write_text
        marker = failing(real, lambda path, text: path)
        monkeypatch.setattr(durable, "write_text",
                            lambda path, text: (marker if path.endswith(checkpoint.MARKER) else real)(path, text))
    return hits


@pytest.mark.parametrize("where, code", [("tensor file", errno.ENOSPC),
                                         pytest.param("COMMITTED", errno.ENOSPC, marks=pytest.mark.slow),
                                         pytest.param("fsync", errno.EIO, marks=pytest.mark.slow)])
def test_a_failed_checkpoint_write_stops_the_run_and_the_same_command_resumes_exactly(tmp_path, monkeypatch, whole,
                                                                                      where, code):
    monkeypatch.chdir(tmp_path)
    config = files.run_yaml(str(tmp_path / "full.yaml"), run_dir="full", **TINY)
    checkpoints = tmp_path / "full" / "checkpoints"
    hits = _fail_in_step_4(monkeypatch, where, code)
    with pytest.raises(CheckpointError) as stopped:
        run(load(config, []))
    said = str(stopped.value)
    assert hits
    assert f"cannot write the checkpoint {checkpoints / 'step-000004'}: " in said
    if code == errno.ENOSPC:
        needed = _tensor_bytes(checkpoints / "step-000002")      # step 4's holds the same tensors
        assert re.search(rf"the disk is full \(No space left on device\): the checkpoint needs about \S+ \S+ "
                         rf"\({needed:,} bytes\) and {re.escape(str(checkpoints))} has \S+ \S+ \([\d,]+ bytes\) free",
                         said), said
    else:
        assert "Input/output error" in said
    assert said.endswith(f"the run stopped after step 4; the same command goes on from its last checkpoint, "
                         f"{checkpoints / 'step-000002'} (step 2), training steps 3 to 4 again"), said
    assert os.listdir(checkpoints) == ["step-000002"]           # nothing half-written beside it
    checkpoint.verified_manifest(str(checkpoints / "step-000002"))
    assert [r["step"] for r in files.log_rows("full")] == ["1", "2", "3", "4"]

    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    assert run(load(config, []))["steps"] == 5
    assert files.log_rows("full") == whole
    assert os.listdir(checkpoints) == ["step-000005"]



def _tensor_bytes(folder) -> int:
    """The bytes of the tensors a checkpoint folder holds, its files' headers aside."""
    return sum(t.nbytes for f in os.listdir(folder) if f.endswith(".safetensors")
               for t in safetensors.torch.load_file(os.path.join(folder, f)).values())


def test_a_log_row_the_disk_refuses_is_cut_off_and_the_same_command_resumes_exactly(tmp_path, monkeypatch, whole):
    """Step 5's row half written when the disk fills: the run stops naming the log, the half row is
    cut off again (a resumed run would read it as a step), and the same command goes on from step 4's
    checkpoint to the log of a run whose disk never filled."""
    from megacompile.train import log
    monkeypatch.chdir(tmp_path)
    config = files.run_yaml(str(tmp_path / "full.yaml"), run_dir="full", **{**TINY, "save_every": 4})
    real = log.RunLog._append

    def failing_file(self, step, fields):       # a file that takes half of step 5's row, then is full
        if step != 5:
            return real(self, step, fields)
        file = self._file

        class Half:
            def tell(self):
                return file.tell()

            def write(self, data):
                return file.write(data[:len(data) // 2])

            def truncate(self, at):
                return file.truncate(at)
        self._file = Half()
        try:
            return real(self, step, fields)
        finally:
            self._file = file

    monkeypatch.setattr(log.RunLog, "_append", failing_file)
    with pytest.raises(CheckpointError) as stopped:
        run(load(config, []))
    said = str(stopped.value)
    path = tmp_path / "full" / "log.csv"
    assert said.startswith(f"cannot write the run's log {path}: the disk is full (No space left on device); the log "
                           "keeps every step before step 5; the run stopped after step 5"), said
    assert path.read_text().endswith("\n") and [r["step"] for r in files.log_rows("full")] == ["1", "2", "3", "4"]
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    assert run(load(config, []))["steps"] == 5
    assert files.log_rows("full") == whole
