"""The disk tier: per-owner AdamW state (and optionally fp32 masters) on disk, streamed past the
host AdamW in the order its updates run.

Each owner's flat buffers are cut into pieces of `piece_numel` parameters; AdamW is elementwise,
so an owner's update runs piece by piece and host RAM holds only the pieces in flight, never an
owner. `schedule(owners)` queues the pieces of a step's updates in update order; a dispatcher
thread takes a buffer from the bounded pool for each (in that order, so the next piece the
update wants is never starved by later ones), waits for the same piece's write of the last
step, and has the I/O threads read it. The update takes pieces with `next_piece`, and hands each
back with `write_behind`: the I/O threads write it in place and return its buffer to the pool.

                 pool (depth buffers)
   dispatcher --read ahead--> ready queue --> AdamW (host stream) --write behind--> I/O threads

An error on any thread puts the tier in a failed state: every later call raises it (the state
on disk may be half a step ahead, and must not be trained from). With `verify` (or the
environment variable MEGACOMPILE_TIER_VERIFY=1) each piece's crc32 is kept when it is written
and checked when it is read back.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import StorageError
from .aligned import BufferPool, aligned_empty, round_up
from .state_files import StateFile, checksum, probe_direct, warn_buffered

MOMENTS = ("exp_avg", "exp_avg_sq")
KINDS = MOMENTS + ("master",)


@dataclass
class Piece:
    """Parameters [start, stop) of one owner: one float32 view per kind into one pool buffer."""
    owner: int
    index: int
    start: int
    stop: int
    buf: torch.Tensor
    views: dict[str, torch.Tensor] = field(default_factory=dict)
    read: Future | None = None


class DiskTier:
    def __init__(self, folder: str, owners: dict[int, int], kinds: tuple[str, ...] = MOMENTS, *,
                 piece_numel: int = 1 << 22, depth: int = 4, threads: int = 4, verify: bool | None = None):
        if piece_numel % 1024:
            raise ValueError(f"piece_numel must be a multiple of 1024 (4 KiB of float32), got {piece_numel}")
        self.folder, self.kinds, self.piece_numel = folder, kinds, piece_numel
        self.owners = dict(owners)
        self.verify = os.environ.get("MEGACOMPILE_TIER_VERIFY") == "1" if verify is None else verify
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise StorageError(f"cannot use nvme_dir {folder}: {e.strerror or e}") from e
        self.direct = probe_direct(folder)
        if not self.direct:
            warn_buffered(folder)
        self.files: dict[tuple[int, str], StateFile] = {}
        try:
            for owner, numel in self.owners.items():
                for kind in kinds:
                    path = os.path.join(folder, f"owner{owner:04d}.{kind}")
                    self.files[owner, kind] = StateFile(path, numel, self.direct)
        except StorageError:
            self.close(remove=True)    # no half-made tier left on disk
            raise
        largest = min(max(self.owners.values(), default=0), piece_numel)
        self.piece_bytes = round_up(max(largest, 1) * 4)
        self.pool = BufferPool(depth, self.piece_bytes * len(kinds))
        self._io = ThreadPoolExecutor(threads, thread_name_prefix="megacompile-disk")
        self._todo: queue.Queue = queue.Queue()
        self._ready: queue.Queue = queue.Queue()
        self._writes: dict[tuple[int, int], Future] = {}
        self._crc: dict[tuple[int, int], int] = {}
        self._error: BaseException | None = None
        self._idle = threading.Condition()
        self._outstanding = 0            # pieces scheduled whose write has not finished
        self._closing = False
        self.bytes_read = self.bytes_written = 0
        # on_io(what, start, end): told of each piece read or written (perf_counter seconds), for
        # the runtime's timeline; called from the I/O threads.
        self.on_io: Callable[[str, float, float], None] | None = None
        self._dispatcher = threading.Thread(target=self._dispatch, name="megacompile-disk-dispatch", daemon=True)
        self._dispatcher.start()

    # -- sizes ---------------------------------------------------------------------------
    def pieces_of(self, owner: int) -> list[tuple[int, int]]:
        numel = self.owners[owner]
        return [(a, min(a + self.piece_numel, numel)) for a in range(0, numel, self.piece_numel)] or [(0, 0)]

    @property
    def disk_bytes(self) -> int:
        return sum(f.nbytes for f in self.files.values())

    # -- the streaming path --------------------------------------------------------------
    def schedule(self, owners: list[int]) -> None:
        """Queue the pieces of these owners' updates, in this order (the order they will run)."""
        self._raise_if_failed()
        for owner in owners:
            for index in range(len(self.pieces_of(owner))):
                with self._idle:
                    self._outstanding += 1
                self._todo.put((owner, index))

    def _dispatch(self) -> None:
        while True:
            item = self._todo.get()
            if item is None:
                return
            owner, index = item
            buf = None
            while buf is None:
                try:
                    buf = self.pool.get(timeout=0.05)
                except queue.Empty:
                    if self._closing:     # pieces still out will never come back
                        return
            start, stop = self.pieces_of(owner)[index]
            piece = Piece(owner, index, start, stop, buf, self._views(buf, stop - start))
            previous = self._writes.pop((owner, index), None)
            try:
                piece.read = self._io.submit(self._read, piece, previous)
            except RuntimeError as e:     # the interpreter is exiting: its I/O threads are gone
                self._error = self._error or e
                piece.read = Future()
                piece.read.set_exception(e)
            self._ready.put(piece)

    def _views(self, buf: torch.Tensor, numel: int) -> dict[str, torch.Tensor]:
        return {kind: buf[k * self.piece_bytes:(k + 1) * self.piece_bytes].view(torch.float32)[:numel]
                for k, kind in enumerate(self.kinds)}

    def _extent(self, piece: Piece) -> tuple[int, int]:
        """Byte offset and aligned length of the piece in each of its owner's files."""
        return piece.start * 4, round_up((piece.stop - piece.start) * 4)

    def _regions(self, piece: Piece) -> list[torch.Tensor]:
        _, length = self._extent(piece)
        return [piece.buf[k * self.piece_bytes:k * self.piece_bytes + length] for k in range(len(self.kinds))]

    def _read(self, piece: Piece, previous: Future | None) -> None:
        if previous is not None:
            previous.result()          # this piece's last write is on disk before it is read back
        offset, _ = self._extent(piece)
        regions = self._regions(piece)
        start = time.perf_counter()
        for kind, region in zip(self.kinds, regions):
            self.files[piece.owner, kind].read(region, offset)
        self._tell("read", piece, start, regions)
        with self._idle:
            self.bytes_read += sum(r.numel() for r in regions)
        if self.verify:
            for kind, region in zip(self.kinds, regions):
                self._check(piece.owner, piece.index, kind, region)

    def _check(self, owner: int, index: int, kind: str, region: torch.Tensor) -> None:
        expected = self._crc.get((owner, index, kind))
        if expected is None and not bool(region.any()):
            return                   # never written: a fresh file reads as zeros
        if checksum([region]) != expected:
            a, b = self.pieces_of(owner)[index]
            raise StorageError(f"the state read back from {self.files[owner, kind].path} (parameters {a:,}..{b:,}) "
                               "does not match the checksum it was written with: the disk returned other bytes")

    def _tell(self, what: str, piece: Piece, start: float, regions: list[torch.Tensor]) -> None:
        if self.on_io is not None:
            nbytes = sum(r.numel() for r in regions)
            self.on_io(f"{what} owner {piece.owner} piece {piece.index} ({nbytes / 2**20:.1f} MiB, "
                       f"{'+'.join(self.kinds)})", start, time.perf_counter())

    def next_piece(self, owner: int) -> Piece:
        """The next piece of `owner`'s update, its state read in; blocks until it is."""
        self._raise_if_failed()
        piece = self._ready.get()
        if piece.owner != owner:
            self._fail(StorageError(f"the disk tier read ahead for owner {piece.owner} but the update of owner "
                                    f"{owner} came first: updates must run in the order they were scheduled"))
        try:
            piece.read.result()
        except BaseException as e:
            self._fail(e)
        return piece

    def write_behind(self, piece: Piece) -> None:
        """The update is done with the piece: write it in place, then return its buffer."""
        future = self._io.submit(self._write, piece)
        self._writes[piece.owner, piece.index] = future

    def _write(self, piece: Piece) -> None:
        try:
            offset, _ = self._extent(piece)
            regions = self._regions(piece)
            if self.verify:
                for kind, region in zip(self.kinds, regions):
                    self._crc[piece.owner, piece.index, kind] = checksum([region])
            start = time.perf_counter()
            for kind, region in zip(self.kinds, regions):
                self.files[piece.owner, kind].write(region, offset)
            self._tell("write", piece, start, regions)
            with self._idle:
                self.bytes_written += sum(r.numel() for r in regions)
        except BaseException as e:
            self._error = self._error or e
            raise
        finally:
            self.pool.put(piece.buf)
            with self._idle:
                self._outstanding -= 1
                self._idle.notify_all()

    def abandon(self, piece: Piece, error: BaseException) -> None:
        """The update failed before it finished the piece: give the buffer back unwritten. The
        owner's later pieces were read ahead for an update that will not take them, so the tier
        stops here."""
        self._error = self._error or error
        self.pool.put(piece.buf)
        with self._idle:
            self._outstanding -= 1
            self._idle.notify_all()

    def flush(self) -> None:
        """Wait until every scheduled piece is written; raises the tier's error if any."""
        with self._idle:
            while self._outstanding and self._error is None:
                self._idle.wait(0.1)
        self._raise_if_failed()

    def _fail(self, error: BaseException) -> None:
        self._error = self._error or error
        raise self._error

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise StorageError(f"the disk tier in {self.folder} failed earlier and its state cannot be trusted: "
                               f"{self._error}") from self._error

    # -- whole owners, off the streaming path (load, state_dict, checkpoints) -------------
    def read(self, owner: int, kind: str) -> torch.Tensor:
        """A fresh float32 copy of one owner's `kind`; waits for the streaming path first."""
        self.flush()
        numel = self.owners[owner]
        whole = aligned_empty(round_up(numel * 4))
        self.files[owner, kind].read(whole, 0)
        if self.verify:
            for index, region in enumerate(self._piece_regions(owner, whole)):
                self._check(owner, index, kind, region)
        return whole.view(torch.float32)[:numel]

    def write(self, owner: int, kind: str, values: torch.Tensor) -> None:
        """Overwrite one owner's `kind` with `values` (its flat float32 numel)."""
        self.flush()
        numel = self.owners[owner]
        whole = aligned_empty(round_up(numel * 4))
        whole.zero_()
        whole.view(torch.float32)[:numel].copy_(values.reshape(-1))
        self.files[owner, kind].write(whole, 0)
        self.bytes_written += whole.numel()
        if self.verify:
            for index, region in enumerate(self._piece_regions(owner, whole)):
                self._crc[owner, index, kind] = checksum([region])

    def _piece_regions(self, owner: int, whole: torch.Tensor) -> list[torch.Tensor]:
        return [whole[a * 4:a * 4 + round_up((b - a) * 4)] for a, b in self.pieces_of(owner)]

    def close(self, remove: bool = True) -> None:
        """Stop the threads and close (by default remove) the state files."""
        if getattr(self, "_dispatcher", None) is not None:
            self._closing = True
            self._todo.put(None)
            self._dispatcher.join(timeout=5)
            self._io.shutdown(wait=True)
            self._dispatcher = None
        for f in self.files.values():
            f.close(remove)
