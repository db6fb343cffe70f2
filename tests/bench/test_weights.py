"""The bench model's weights folder (bench/weights.py): written once from the seed, read back the
same, and written again when a run was cut short before its index."""
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megacompile.bench import weights
from megacompile.bench.workload import Workload
from megacompile.errors import ArgumentError

TINY = Workload(shape="tiny", device="cpu", batch=2, seq=32)


def test_the_folder_holds_the_seeded_models_fp32_weights_and_is_written_once(tmp_path):
    folder = weights.write(TINY, tmp_path)
    assert folder == tmp_path / "tiny-seed0"
    expected = TINY.model().state_dict()
    read = dict(weights.read(folder, list(expected)))
    assert all(read[n].dtype == torch.float32 and torch.equal(read[n], t) for n, t in expected.items())
    stamp = {p: p.stat().st_mtime_ns for p in folder.iterdir()}
    assert weights.write(TINY, tmp_path) == folder
    assert {p: p.stat().st_mtime_ns for p in folder.iterdir()} == stamp


def test_a_folder_without_its_index_is_written_again(tmp_path):
    folder = weights.write(TINY, tmp_path)
    (folder / "model.safetensors.index.json").unlink()
    (folder / "rest.safetensors").write_bytes(b"cut short")
    weights.write(TINY, tmp_path)
    assert torch.equal(dict(weights.read(folder, ["lm_head.weight"]))["lm_head.weight"],
                       TINY.model().lm_head.weight.detach())
    other = Workload(shape="tiny", seed=3)
    assert weights.write(other, tmp_path).name == "tiny-seed3"



def test_what_a_call_cut_short_left_is_not_counted_against_the_room(tmp_path, monkeypatch):
    """A disk with room for one copy of the weights: the leftovers of a killed call (a partial
    folder, a folder without its index) are removed before the room is counted, not refused."""
    need = 4 * TINY.parameters
    leftover = tmp_path / "tiny-seed0.partial"
    leftover.mkdir()
    (leftover / "block-000.safetensors").write_bytes(b"0" * need)
    (tmp_path / "tiny-seed0").mkdir()
    (tmp_path / "tiny-seed0" / "rest.safetensors").write_bytes(b"0" * (need // 2))

    def disk_usage(path):      # a disk of room for the weights and 1 KiB, less what lies in tmp_path
        held = sum(f.stat().st_size for f in Path(tmp_path).rglob("*") if f.is_file())
        return SimpleNamespace(free=need + 1024 - held)
    monkeypatch.setattr(weights.shutil, "disk_usage", disk_usage)
    folder = weights.write(TINY, tmp_path)
    assert not leftover.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["tiny-seed0"]
    assert (folder / "model.safetensors.index.json").is_file()

MOUNTS = """/dev/vda / ext4 rw,relatime 0 0
tmpfs /tmp tmpfs rw,nosuid 0 0
/dev/vdb /tmp/on\\040disk xfs rw 0 0
"""


def test_the_file_system_is_the_nearest_mount_points(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text(MOUNTS)
    assert weights.file_system(Path("/tmp/megacompile-bench-weights"), str(mounts)) == "tmpfs"
    assert weights.file_system(Path("/tmp/on disk/weights"), str(mounts)) == "xfs"
    assert weights.file_system(Path("/tmpfoo/weights"), str(mounts)) == "ext4"
    assert weights.file_system(Path("/var/tmp"), str(tmp_path / "no such file")) == "unknown"


def test_a_folder_in_ram_is_refused_before_anything_is_built_or_written(tmp_path, monkeypatch):
    monkeypatch.setattr(weights, "file_system", lambda path, mounts="": "tmpfs")
    monkeypatch.setattr(Workload, "model", lambda self: pytest.fail("built the model"))
    with pytest.raises(ArgumentError, match=r"on tmpfs, a file system in RAM.*give --weights \(lease.sh: WEIGHTS\)"):
        weights.write(TINY, tmp_path / "weights")
    assert not (tmp_path / "weights").exists()


def test_a_folder_without_room_for_the_weights_is_refused_naming_both_sizes(tmp_path, monkeypatch):
    monkeypatch.setattr(weights.shutil, "disk_usage", lambda path: SimpleNamespace(free=1000))
    with pytest.raises(ArgumentError, match=r"has 0.0 GiB free, the model's fp32 weights need 0.0 GiB"):
        weights.write(TINY, tmp_path / "weights" / "not yet made")
    big = Workload(shape="llama-7b", device="cpu", batch=1, seq=8)
    monkeypatch.setattr(weights.shutil, "disk_usage", lambda path: SimpleNamespace(free=20 * 2 ** 30))
    with pytest.raises(ArgumentError, match=r"has 20.0 GiB free, the model's fp32 weights need 25.1 GiB"):
        weights.check_room(big, tmp_path)
