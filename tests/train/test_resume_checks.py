"""A resume is checked against the run that saved its checkpoint before any file of the run folder
is written: a refused one leaves the folder as it was; changed settings are named with what they
do; a finished run says so and does nothing."""
from __future__ import annotations

import os
import warnings

import pytest
import torch

from megacompile.errors import ArgumentError, WeightsFileError
from megacompile.train import load, log, run
from megacompile.train.schedule import learning_rate

TINY = ["bundled_model.dim=32", "bundled_model.layers=1", "bundled_model.heads=2", "bundled_model.kv_heads=1",
        "bundled_model.ffn=64", "device=cpu", "batch=1", "seq=16", "resume=auto", "warmup=0", "schedule=cosine"]


def _run(tmp_path, *overrides: str) -> dict:
    return run(load(None, [*TINY, f"run_dir={tmp_path / 'run'}", *overrides]))


def _folder(tmp_path) -> dict:
    """Every file of the run folder but the checkpoints, with its bytes and time."""
    out = {}
    for root, _, names in os.walk(tmp_path / "run"):
        for name in names:
            path = os.path.join(root, name)
            if f"{os.sep}checkpoints{os.sep}" not in path:
                with open(path, "rb") as f:
                    out[path] = (f.read(), os.stat(path).st_mtime_ns)
    return out


def test_a_changed_schedule_is_named_with_the_jump_of_the_learning_rate(tmp_path, capsys):
    _run(tmp_path, "steps=2", "lr=3e-3")
    capsys.readouterr()
    _run(tmp_path, "steps=4", "lr=5e-3")
    out = capsys.readouterr().out
    old, new = learning_rate(3e-3, "cosine", 0, 0.0, 2)(3), learning_rate(5e-3, "cosine", 0, 0.0, 4)(3)
    assert (f"steps 2 -> 4, lr 0.003 -> 0.005: the learning rate of step 3 jumps from {old:.3g} to {new:.3g}"
            in out)
    assert [float(r["lr"]) for r in log.read(str(tmp_path / "run" / "log.csv"))][2] == pytest.approx(new)


def test_a_changed_grad_accum_is_one_line_of_its_own(tmp_path, capsys):
    _run(tmp_path, "steps=1", "grad_accum=1")
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run(tmp_path, "steps=2", "grad_accum=2")
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]
    out = capsys.readouterr().out
    assert out.count("grad_accum 1 -> 2") == 1 and "grad_accum: the checkpoint has" not in out
    assert "grad_accum 1 -> 2: rows per optimizer step 1 -> 2: each step from step 2 averages 2 rows" in out


def test_a_finished_run_run_again_says_it_is_complete_and_does_nothing(tmp_path, capsys):
    _run(tmp_path, "steps=2")
    before = _folder(tmp_path)
    capsys.readouterr()
    result = _run(tmp_path, "steps=2")
    out = capsys.readouterr().out
    assert "is already complete (step 2 of 2, checkpoint" in out and "nothing to do" in out
    assert "resumed" not in out and "plan dump" not in out
    assert result["complete"] and _folder(tmp_path) == before


@pytest.mark.parametrize("change, message", [
    ("seed=1", r"cut its rows otherwise \(seed 0 -> 1\)"),
    ("eval_fraction=0.1", r"cut its rows otherwise \(eval_fraction 0.0 -> 0.1\)"),
    ("data=OTHER", r"was saved by a run on other data: .*other.txt is new"),
])
def test_a_refused_resume_leaves_the_run_folder_as_it_was(tmp_path, change, message):
    _run(tmp_path, "steps=1")
    before = _folder(tmp_path)
    assert any(p.endswith(os.path.join("tokens", "train.ids")) for p in before)
    assert any(p.endswith(os.path.join("plan", "plan.txt")) for p in before)
    if change == "data=OTHER":
        (tmp_path / "other.txt").write_text("the dog sat on the cat " * 20)
        change = f"data={tmp_path / 'other.txt'}"
    with pytest.raises(ArgumentError, match=message):
        _run(tmp_path, "steps=2", change)
    assert _folder(tmp_path) == before
    assert not os.path.exists(tmp_path / "run" / "tokens.new")


def test_a_checkpoint_that_held_out_documents_is_not_resumed_holding_out_tokens(tmp_path):
    """Checkpoints written before eval_fraction counted tokens carry no eval_fraction in their
    rows layout; their held-out documents are not the rows a resume would now hold out."""
    import json
    _run(tmp_path, "steps=1", "eval_fraction=0.2")
    manifest = tmp_path / "run" / "checkpoints" / "step-000001" / "manifest.json"
    saved = json.loads(manifest.read_text())
    del saved["extra"]["rows_layout"]["eval_fraction"]
    manifest.write_text(json.dumps(saved))
    with pytest.raises(ArgumentError, match=r"cut its rows otherwise \(eval_fraction of the documents -> of the "
                                            r"tokens\)"):
        _run(tmp_path, "steps=2", "eval_fraction=0.2")


def test_a_finished_run_with_an_export_names_it(tmp_path, capsys):
    from tests.train import files
    work = files.workspace(tmp_path)
    settings = ["device=cpu", "seq=16", "batch=2", "steps=1", "resume=auto", f"model={work['model']}",
                f"data={work['chats']}", f"run_dir={tmp_path / 'run'}", f"export={tmp_path / 'export'}"]
    run(load(None, settings))
    capsys.readouterr()
    assert run(load(None, settings))["complete"]
    out = capsys.readouterr().out
    assert "already complete (step 1 of 1, checkpoint" in out and f"its export is in {tmp_path / 'export'}" in out
    # weights cut short: config.json alone is no export; it is written again from the checkpoint
    weights = tmp_path / "export" / "model.safetensors"
    whole = weights.read_bytes()
    os.truncate(weights, 1000)
    run(load(None, settings))
    out = capsys.readouterr().out
    assert (f"its export in {tmp_path / 'export'} is not whole: {weights} is truncated" in out
            and "writing it from the checkpoint" in out)
    assert weights.read_bytes() == whole


def test_an_export_is_whole_when_its_config_and_every_weights_file_are_there_and_whole(tmp_path):
    import json

    from safetensors.torch import save_file

    from megacompile.train.trained_model import missing
    folder = tmp_path / "export"
    folder.mkdir()
    assert missing(str(folder)) == f"is not in {folder}"
    (folder / "config.json").write_text("{}")
    assert missing(str(folder)) == f"in {folder} is not whole: model.safetensors is missing"
    save_file({"a": torch.ones(4), "b": torch.zeros(2, 3)}, str(folder / "model.safetensors"))
    assert missing(str(folder)) is None
    whole = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(whole + b"\0" * 8)       # bytes past the last tensor
    assert "model.safetensors has %d bytes, its header and tensors %d" % (len(whole) + 8, len(whole)) in \
        missing(str(folder))
    (folder / "model.safetensors").write_bytes(whole[:-4])
    assert "is truncated: b needs bytes up to" in missing(str(folder))
    # sharded: every file the index names
    (folder / "model.safetensors").unlink()
    save_file({"a": torch.ones(4)}, str(folder / "model-00001-of-00002.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    assert missing(str(folder)) == f"in {folder} is not whole: model-00002-of-00002.safetensors is missing"
    save_file({"b": torch.zeros(2, 3)}, str(folder / "model-00002-of-00002.safetensors"))
    assert missing(str(folder)) is None


def test_a_committed_checkpoint_without_a_step_count_is_refused_by_name(tmp_path):
    import json

    from megacompile.io import checkpoint, durable
    folder = tmp_path / "odd"
    folder.mkdir()
    (folder / checkpoint.MANIFEST).write_text(json.dumps({"format": checkpoint.FORMAT, "files": {}}))
    (folder / checkpoint.MARKER).write_text(durable.sha256_of(str(folder / checkpoint.MANIFEST)))
    with pytest.raises(WeightsFileError, match="does not hold what a save writes: steps_done: missing"):
        run(load(None, [*TINY, "steps=1", f"resume={folder}", f"run_dir={tmp_path / 'run'}"]))
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_whose_step_count_is_a_string_is_refused_before_the_run_folder_is_made(tmp_path):
    # The manifest re-signed, so only the schema can tell: int("1") would pass it as a step count.
    import json

    from megacompile.io import checkpoint, durable
    _run(tmp_path, "steps=1")
    (saved,) = [p for p in (tmp_path / "run" / "checkpoints").iterdir() if not p.name.startswith(".")]
    manifest = json.loads((saved / checkpoint.MANIFEST).read_text())
    manifest["steps_done"] = str(manifest["steps_done"])
    (saved / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    (saved / checkpoint.MARKER).write_text(durable.sha256_of(str(saved / checkpoint.MANIFEST)))
    with pytest.raises(WeightsFileError, match="steps_done: expected an int >= 0, found str"):
        run(load(None, [*TINY, "steps=2", f"resume={saved}", f"run_dir={tmp_path / 'other'}"]))
    assert not (tmp_path / "other").exists()
