"""The disk tier on its own: pieces stream in update order and persist across steps; whole-owner
reads and writes; and every failure names the file (disk full, a file truncated or deleted under
the run, a failing write, bytes that do not match their checksum)."""
from __future__ import annotations

import errno
import os

import pytest
import torch

from megacompile.errors import StorageError
from megacompile.disk import DiskTier, KINDS
from megacompile.disk import state_files
from megacompile.disk import tier as tier_module

SIZES = {0: 5000, 1: 3000, 2: 1}     # owners of odd sizes: a last piece shorter than the others


def _tier(folder, **kw) -> DiskTier:
    kw = {"piece_numel": 2048, "depth": 3, "verify": True, **kw}
    return DiskTier(str(folder), SIZES, KINDS, **kw)


def _step(tier: DiskTier, step: int) -> None:
    """One round of updates in owner order: each value becomes value + step."""
    tier.schedule(list(SIZES))
    for owner in SIZES:
        for a, b in tier.pieces_of(owner):
            piece = tier.next_piece(owner)
            assert (piece.owner, piece.start, piece.stop) == (owner, a, b)
            for kind, view in piece.views.items():
                view.add_(step * (1 + KINDS.index(kind)))
            tier.write_behind(piece)


def test_pieces_stream_in_order_and_persist_across_steps(tmp_path):
    tier = _tier(tmp_path)
    start = {o: torch.arange(n, dtype=torch.float32) for o, n in SIZES.items()}
    for owner, values in start.items():
        tier.write(owner, "master", values)
    for step in (1, 2, 3):
        _step(tier, step)
    tier.flush()
    for owner, values in start.items():
        torch.testing.assert_close(tier.read(owner, "master"), values + 3 * 6, rtol=0, atol=0)
        assert torch.equal(tier.read(owner, "exp_avg"), torch.full((SIZES[owner],), 6.0))
        assert torch.equal(tier.read(owner, "exp_avg_sq"), torch.full((SIZES[owner],), 12.0))
    assert tier.bytes_read > 0 and tier.bytes_written > 0
    tier.close()
    assert os.listdir(tmp_path) == []


def test_updates_out_of_schedule_order_are_refused(tmp_path):
    tier = _tier(tmp_path)
    tier.schedule([0, 1])
    with pytest.raises(StorageError, match="order they were scheduled"):
        tier.next_piece(1)
    tier.close()


def test_disk_full_at_creation_names_the_file_and_leaves_nothing(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(StorageError, match=r"owner0000\.exp_avg .*the disk is full"):
        _tier(tmp_path)
    assert os.listdir(tmp_path) == []


def test_a_truncated_file_is_named(tmp_path):
    tier = _tier(tmp_path)
    _step(tier, 1)
    tier.flush()
    os.truncate(tier.files[1, "exp_avg_sq"].path, 100)
    with pytest.raises(StorageError, match=r"owner0001\.exp_avg_sq was truncated"):
        _step(tier, 2)
    with pytest.raises(StorageError, match="failed earlier"):     # and the tier stays failed
        tier.schedule([0])
    tier.close()


def test_a_deleted_file_is_named(tmp_path):
    tier = _tier(tmp_path)
    _step(tier, 1)
    tier.flush()
    os.unlink(tier.files[0, "master"].path)
    with pytest.raises(StorageError, match=r"owner0000\.master was deleted"):
        _step(tier, 2)
    tier.close()


def test_a_failing_write_is_named_and_raised_at_the_next_call(tmp_path, monkeypatch):
    tier = _tier(tmp_path)
    _step(tier, 1)
    tier.flush()

    def failing(fd, bufs, offset):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(state_files, "pwrite", failing)
    with pytest.raises(StorageError, match=r"writing the state file .*owner0000\.\w+ .*I/O error"):
        tier.schedule([0])        # the error surfaces at the tier's next call, wherever that is
        for _ in tier.pieces_of(0):
            tier.write_behind(tier.next_piece(0))
        tier.flush()
    tier.close()


def test_bytes_changed_behind_the_tier_fail_the_checksum(tmp_path):
    tier = _tier(tmp_path)
    _step(tier, 1)
    tier.flush()
    path = tier.files[0, "exp_avg"].path
    with open(path, "r+b") as f:      # one float of the first piece, rewritten behind the tier's back
        f.seek(8)
        f.write(torch.tensor([123.0]).numpy().tobytes())
    with pytest.raises(StorageError, match=r"owner0000\.exp_avg .*does not match the checksum"):
        tier.read(0, "exp_avg")
    tier.close()


def test_a_filesystem_without_o_direct_falls_back_to_buffered_io_with_a_warning(tmp_path, monkeypatch):
    """tmpfs before Linux 6.6 and some network filesystems refuse O_DIRECT: the tier warns and
    goes through the page cache, with the same results."""
    monkeypatch.setattr(tier_module, "probe_direct", lambda folder: False)
    with pytest.warns(RuntimeWarning, match="does not take O_DIRECT"):
        tier = _tier(tmp_path)
    assert not tier.direct
    _step(tier, 1)
    assert torch.equal(tier.read(2, "master"), torch.full((1,), 3.0))
    tier.close()


def test_the_raw_disk_probe_measures_and_leaves_nothing(tmp_path):
    from megacompile.disk.bandwidth import measure_disk
    figures = measure_disk(str(tmp_path), nbytes=8 << 20, chunk=1 << 20, threads=2)
    assert figures["read_bw"] > 0 and figures["write_bw"] > 0 and figures["bytes"] == 8 << 20
    assert os.listdir(tmp_path) == []
