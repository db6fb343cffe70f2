"""io/pages.py: the pages under a file-mapped tensor go back to the system, and the tensor (and its
neighbours in the file) read the same afterwards."""
import os

import pytest
import torch

from megacompile.io import pages


def _resident(path: str) -> int:
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and not head[0].endswith(":"):
                inside = head[-1] == path
            elif inside and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux's madvise and /proc/self/smaps")
def test_a_mapped_tensors_pages_go_back_and_it_reads_the_same(tmp_path):
    path = str(tmp_path / "state.pt")
    torch.manual_seed(0)
    saved = {"a": torch.randn(1 << 18), "b": torch.randn(1 << 18), "step": torch.tensor(3.0)}
    torch.save(saved, path)
    mapped = torch.load(path, mmap=True, weights_only=True)
    before = {k: t.clone() for k, t in mapped.items()}      # every page touched
    assert _resident(path) >= 2 * (1 << 20)
    assert pages.drop(mapped["a"]) and pages.drop(mapped["b"])
    assert _resident(path) < 1 << 18
    for k, t in mapped.items():
        assert torch.equal(t, saved[k]) and torch.equal(t, before[k])


def test_nothing_is_dropped_under_an_empty_tensor():
    assert not pages.drop(torch.empty(0))
