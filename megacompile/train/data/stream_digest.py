"""What a streamed run has read, as a digest its checkpoints keep: a resume on data changed since
(a bad record that stopped the run fixed, records appended) goes on when the rows before its
position, read again, are the same, and is refused when they are not.

The digest runs over the first pass's windows of documents, in order (streaming.py reads the
stream a window at a time, and the documents of a window are placed together: a record changed
in a window can move the rows of every other document in it), each document's place in the
stream, its tokens and its loss mask. A checkpoint's digest covers every window that holds a
token of a row read before it. Past the first pass every document has been read: there is no
digest, and any change is refused as before.
"""
from __future__ import annotations

import hashlib

import numpy as np


class Windows:
    """The digest chain of one pass's windows: after each, the digest of all up to it."""

    def __init__(self):
        self.starts: list[int] = []      # where each window begins in the pass's stream
        self.digests: list[str] = []     # the digest through each window

    def add(self, start: int, docs: list[tuple[int, np.ndarray, np.ndarray]]) -> None:
        """A window beginning at `start`, its documents as (stream start, ids, targets), placed."""
        h = hashlib.sha256((self.digests[-1] if self.digests else "").encode())
        for at, ids, targets in docs:
            h.update(np.int64(at).tobytes())
            h.update(np.int64(len(ids)).tobytes())
            h.update(np.ascontiguousarray(ids, dtype=np.int64).tobytes())
            h.update(np.packbits(np.asarray(targets, dtype=bool)).tobytes())
        self.starts.append(start)
        self.digests.append(h.hexdigest())

    def through(self, rows: int, row_len: int) -> dict | None:
        """The digest of the windows the first `rows` rows are cut from; None for no rows."""
        end = rows * row_len
        held = sum(1 for s in self.starts if s < end)
        if rows <= 0 or held == 0:
            return None
        return {"rows": rows, "windows": held, "digest": self.digests[held - 1]}
