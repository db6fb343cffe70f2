"""The bench model's weights folder (bench/weights.py): written once from the seed, read back the
same, and written again when a run was cut short before its index."""
import torch

from megacompile.bench import weights
from megacompile.bench.workload import Workload

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
