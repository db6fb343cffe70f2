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


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux's madvise and /proc/self/smaps")
def test_a_views_pages_go_back_and_the_tensor_reads_the_same(tmp_path):
    """drop_view gives back the pages under a piece of a mapped tensor: a gather that copies a large
    tensor out a chunk at a time holds a chunk's pages, not the tensor's. (The kernel may drop more
    around it, a large folio of the page cache at a time: they read back from the file.)"""
    path = str(tmp_path / "flat.pt")
    torch.manual_seed(0)
    saved = torch.randn(1 << 20)        # 4 MiB
    torch.save(saved, path)
    mapped = torch.load(path, mmap=True, weights_only=True)
    mapped.sum()            # every page touched
    whole = _resident(path)
    assert whole >= 4 << 20
    assert pages.drop_view(mapped.narrow(0, 0, 1 << 19))     # the first half
    assert whole - _resident(path) >= (2 << 20) - 8192
    assert torch.equal(mapped, saved)
    assert not pages.drop_view(torch.empty(0)) and not pages.drop_view(torch.empty(4, 4).t())
