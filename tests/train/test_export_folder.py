"""The run's export: a new run never replaces an export it did not write (refused before it
trains), a resumed run replaces its own, and the folder's other files are kept either way."""
from __future__ import annotations

import os

import pytest

from megacompile.errors import ArgumentError
from megacompile.train import load, run
from tests.train import files


def _settings(work: dict, run_dir: str, export: str, steps: int) -> dict:
    return dict(model=work["model"], data=[work["notes"]], seq=16, batch=1, steps=steps, lr=3e-3, device="cpu",
                resume="auto", run_dir=run_dir, export=export, log_every=1)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.mark.slow   # four short runs: ~30 s on 2 cores
def test_a_new_run_is_refused_an_export_a_resumed_run_replaces_its_own(tmp_path):
    work = files.workspace(tmp_path)
    export = str(tmp_path / "export")
    os.makedirs(export)
    with open(os.path.join(export, "README.md"), "w") as f:
        f.write("# my model card\n")
    first = files.run_yaml(str(tmp_path / "a.yaml"), **_settings(work, str(tmp_path / "a"), export, 1))
    assert run(load(first, []))["steps"] == 1
    exported = _read(os.path.join(export, "model.safetensors"))

    other = files.run_yaml(str(tmp_path / "b.yaml"), **_settings(work, str(tmp_path / "b"), export, 1))
    with pytest.raises(ArgumentError, match=r"export .* already holds a model export \(.*config.json, .*"
                                            r"model.safetensors.*\), which this new run would replace"):
        run(load(other, []))
    assert not os.path.exists(tmp_path / "b")                       # refused before it trained
    assert _read(os.path.join(export, "model.safetensors")) == exported

    longer = files.run_yaml(str(tmp_path / "a2.yaml"), **_settings(work, str(tmp_path / "a"), export, 2))
    assert run(load(longer, []))["steps"] == 2                      # resumed at step 1: its own export replaced
    assert _read(os.path.join(export, "model.safetensors")) != exported
    assert _read(os.path.join(export, "README.md")) == b"# my model card\n"
    assert run(load(longer, []))["steps"] == 2                      # done already: exported again
