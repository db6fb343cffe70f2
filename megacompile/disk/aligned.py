"""Host buffers that direct I/O can read into and write from, and a bounded pool of them.

O_DIRECT moves bytes between the disk and user memory without the page cache, so the buffer's
address, the file offset and the length must all be multiples of the device's logical block size
(512 B or 4 KiB). Everything here is aligned to 4 KiB, which satisfies both.
"""
from __future__ import annotations

import queue

import torch

ALIGN = 4096


def round_up(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def aligned_empty(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of nbytes whose data starts on a 4 KiB boundary. The view keeps the larger
    allocation it was cut from alive."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip:skip + nbytes]


class BufferPool:
    """`count` aligned buffers of `nbytes` each, made once. get() blocks while all are out: the
    pool is what bounds the tier's read-ahead and write-behind."""

    def __init__(self, count: int, nbytes: int):
        self.nbytes = round_up(nbytes)
        self.count = count
        self._free: queue.Queue = queue.Queue()
        for _ in range(count):
            self._free.put(aligned_empty(self.nbytes))

    def get(self, timeout: float | None = None) -> torch.Tensor:
        """A free buffer; queue.Empty after `timeout` seconds without one."""
        return self._free.get(timeout=timeout)

    def put(self, buf: torch.Tensor) -> None:
        self._free.put(buf)

    @property
    def total_bytes(self) -> int:
        return self.count * self.nbytes
