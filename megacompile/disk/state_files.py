"""One preallocated state file: an owner's flat float32 exp_avg, exp_avg_sq or master on disk.

The file is made at its full size once (posix_fallocate, so a full disk is found before the first
step, not in the middle of one) and then only overwritten in place. It is opened with O_DIRECT
where the filesystem allows it; tmpfs and some network filesystems refuse O_DIRECT, and the file
then goes through the page cache (warned about once). Every failure becomes a StorageError that
names the file.
"""
from __future__ import annotations

import errno
import os
import warnings
import zlib

import torch

from ..errors import StorageError
from .aligned import ALIGN, aligned_empty, round_up

_O_DIRECT = getattr(os, "O_DIRECT", 0)
# Indirection so a test can make the disk fail.
pread = os.preadv
pwrite = os.pwritev


def _bytes_of(buf: torch.Tensor) -> memoryview:
    """The tensor's memory as a writable byte view (no copy)."""
    return memoryview(buf.view(torch.uint8).numpy()).cast("B")


def _cause(e: OSError) -> str:
    if e.errno == errno.ENOSPC:
        return "the disk is full (ENOSPC); free space or point nvme_dir at a larger disk"
    if e.errno == errno.EIO:
        return "an I/O error (EIO): the disk failed this request"
    return e.strerror or str(e)


def probe_direct(folder: str) -> bool:
    """Whether files in `folder` take O_DIRECT: some filesystems refuse the open (tmpfs), others
    only the first aligned read or write."""
    if not _O_DIRECT:
        return False
    path = os.path.join(folder, f".direct-probe-{os.getpid()}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | _O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        buf = aligned_empty(ALIGN)
        buf.zero_()
        os.pwritev(fd, [_bytes_of(buf)], 0)
        os.preadv(fd, [_bytes_of(buf)], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(path)


class StateFile:
    """`numel` float32 values at `path`, read and written in aligned ranges."""

    def __init__(self, path: str, numel: int, direct: bool):
        self.path, self.numel, self.direct = path, numel, direct
        self.nbytes = round_up(numel * 4)
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | (_O_DIRECT if direct else 0)
        try:
            self.fd = os.open(path, flags, 0o600)
        except OSError as e:
            raise StorageError(f"cannot create the state file {path}: {_cause(e)}") from e
        try:
            if self.nbytes:
                os.posix_fallocate(self.fd, 0, self.nbytes)
        except OSError as e:
            os.close(self.fd)
            os.unlink(path)
            raise StorageError(f"cannot make the state file {path} {self.nbytes:,} bytes long: {_cause(e)}") from e

    def _check_present(self) -> None:
        """A file deleted or truncated under the run: its descriptor still reads, but what it reads
        is no longer the state (an unlinked file vanishes at close; a truncated one reads zeros)."""
        st = os.fstat(self.fd)
        if st.st_nlink == 0:
            raise StorageError(f"the state file {self.path} was deleted while the run used it; its AdamW "
                               "state is lost: resume from a checkpoint")
        if st.st_size < self.nbytes:
            raise StorageError(f"the state file {self.path} was truncated to {st.st_size:,} bytes while the run "
                               f"used it (it holds {self.nbytes:,}); resume from a checkpoint")

    def read(self, buf: torch.Tensor, offset: int) -> None:
        """Fill `buf` (aligned, length a multiple of 4 KiB) from byte `offset`."""
        self._check_present()
        view, done = _bytes_of(buf), 0
        try:
            while done < len(view):
                n = pread(self.fd, [view[done:]], offset + done)
                if n == 0:
                    raise StorageError(f"the state file {self.path} ended at byte {offset + done:,}, before the "
                                       f"{len(view):,} bytes at {offset:,} (truncated under the run?)")
                done += n
        except OSError as e:
            if isinstance(e, StorageError):
                raise
            raise StorageError(f"reading the state file {self.path} at byte {offset:,} failed: {_cause(e)}") from e

    def write(self, buf: torch.Tensor, offset: int) -> None:
        self._check_present()
        view, done = _bytes_of(buf), 0
        try:
            while done < len(view):
                done += pwrite(self.fd, [view[done:]], offset + done)
        except OSError as e:
            raise StorageError(f"writing the state file {self.path} at byte {offset:,} failed: {_cause(e)}") from e

    def close(self, remove: bool) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if remove and os.path.exists(self.path):
            os.unlink(self.path)


def checksum(bufs: list[torch.Tensor]) -> int:
    crc = 0
    for b in bufs:
        crc = zlib.crc32(_bytes_of(b), crc)
    return crc


def warn_buffered(folder: str) -> None:
    warnings.warn(f"megacompile: {folder} does not take O_DIRECT (tmpfs, or a network filesystem); the disk "
                  "tier's state files go through the page cache, which costs host RAM and bandwidth",
                  RuntimeWarning, stacklevel=4)
