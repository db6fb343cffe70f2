"""`streaming: true`: rows cut from documents tokenised as training reads them, for data larger
than memory or disk can hold as a token file.

A background thread reads the data entries in file order (mixed as mixture.py says), tokenises
each record and hands (source, tokens, targets) to the training loop through a bounded queue
(QUEUE documents), so tokenising overlaps the steps and memory holds a window of documents, not
the data. One pass over the entries is an epoch: its documents are laid out a window at a time as
placement.py lays out a token file's (records truncated to the row, never split; packed whole
with packing on) and cut into rows in order; the last row of a pass is padded and the next pass
starts a new row, with the same documents in the same order.

What streaming gives up, against a token file:
    order      no shuffle: documents come in file order, rows in stream order (shuffle the files
               beforehand); the first pass's rows equal a token-file run's with shuffling off
    epochs     the size of the data is not known ahead: give steps
    eval       eval_fraction is refused (it needs the whole data); eval files are tokenised once
               into a token file as before
    resume     the data position is still rows consumed: a resumed run reads and tokenises the
               stream from its start up to that row (exact, and as slow as tokenising that far);
               data changed past it is taken when the rows before it are the same (stream_digest.py)
"""
from __future__ import annotations

import queue
import threading
from collections import deque

import numpy as np

from ...errors import ArgumentError
from . import placement, stream_digest
from .mixture import interleave
from .packing import fill
from .reading import records
from .tokens import document, loss_keys

QUEUE = 1024        # documents tokenised ahead
KEEP = 16           # rows kept behind the furthest one read (a few batches asked for again cost nothing)
_END_OF_PASS = object()


class _Producer:
    """The thread that tokenises the stream: passes over the entries, one after another."""

    def __init__(self, entries: list[dict], weights, strategy: str, tokenizer, train_on_prompt: bool,
                 cutoff: int | None = None):
        self.queue: queue.Queue = queue.Queue(QUEUE)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run,
                                       args=(entries, weights, strategy, tokenizer, train_on_prompt, cutoff),
                                       daemon=True, name="megacompile-tokenise")
        self.thread.start()

    def _put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, entries, weights, strategy, tokenizer, train_on_prompt, cutoff) -> None:
        readers: dict = {}

        def passes(entry):
            return lambda k: records(entry, readers)
        try:
            while not self.stop.is_set():
                for i, (where, record) in interleave(weights, strategy, [passes(e) for e in entries]):
                    made = document(tokenizer, record, train_on_prompt, where, cutoff=cutoff,
                                    mask_history=entries[i].get("mask_history", False), **loss_keys(entries[i]))
                    kind = placement.RECORD if made.record else placement.TEXT
                    if made.ids and not self._put((np.asarray(made.ids, dtype=np.int64),
                                                   np.asarray(made.targets, dtype=bool), kind)):
                        return
                if not self._put(_END_OF_PASS):
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the training loop, which raises it
            self._put(e)

    def next(self):
        item = self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


class StreamRows:
    """packing.Rows' interface over a stream: row(index), for indices read mostly in order."""
    rows_per_epoch = None       # unknown until a pass ends
    epoch_tokens = None
    shuffle = False

    def __init__(self, entries: list[dict], weights, strategy: str, tokenizer, train_on_prompt: bool, row_len: int,
                 packing: bool | str, pad_id: int = 0):
        self.args = (entries, weights, strategy, tokenizer, train_on_prompt, row_len)
        self.row_len, self.packing, self.pad_id = row_len, packing, pad_id
        self.producer: _Producer | None = None      # started by the first row asked for
        self._restart(start=False)

    def _restart(self, start: bool = True) -> None:
        if self.producer is not None:
            self.producer.close()
        self.producer = _Producer(*self.args) if start else None
        self.pass_row = 0          # the run's row where the current pass begins
        self.end = 0               # stream length of the pass read so far (placement.py)
        self.docs: deque = deque()  # (start in the pass's stream, ids, targets), in order
        self.pass_ended = False
        self.floor = 0             # the lowest row still readable without starting again
        self.counted = False       # a token the loss counts was seen in this pass
        self.windows = stream_digest.Windows()     # the first pass's windows, as a checkpoint's digest
        self.read_to = 0           # the rows of the first pass read so far
        self.past_first = False    # a row of a later pass was read

    def _read(self) -> None:
        """One more window of documents of the pass (placement.WINDOW, as a token file's epoch is
        laid out), and the pass's end when it comes."""
        window = []
        while len(window) < placement.WINDOW:
            item = self.producer.next()
            if item is _END_OF_PASS:
                if not self.counted and not any(targets.any() for _, targets, _ in window):
                    # every batch would be skipped as all padding or prompt, forever
                    raise ArgumentError("the streamed data " + ("holds no tokens" if self.end == 0 and not window
                                        else "has no token the loss counts: add assistant turns or completions, or "
                                        "train_on_prompt: true"))
                self.pass_ended = True
                break
            window.append(item)
        self.counted = self.counted or any(targets.any() for _, targets, _ in window)
        begin = self.end
        order, starts, self.end = placement.place(self.end, np.asarray([len(ids) for ids, _, _ in window]),
                                                  np.asarray([kind for _, _, kind in window]), self.row_len,
                                                  self.packing)
        placed = [(start, window[k][0], window[k][1]) for k, start in zip(order.tolist(), starts.tolist())]
        self.docs.extend(placed)
        if self.pass_row == 0 and placed:
            self.windows.add(begin, placed)

    def row(self, index: int) -> tuple[np.ndarray, ...]:
        if index < self.floor or self.producer is None:
            self._restart()
        while True:
            lo = (index - self.pass_row) * self.row_len
            while not self.pass_ended and self.end < lo + self.row_len:
                self._read()
            if not self.pass_ended or lo < self.end:
                break
            self.pass_row += -(-self.end // self.row_len)      # the next pass starts a new row
            self.end, self.docs, self.pass_ended, self.counted = 0, deque(), False, False
        keep = lo - KEEP * self.row_len
        while self.docs and self.docs[0][0] + len(self.docs[0][1]) <= keep:
            self.docs.popleft()
        self.floor = max(self.floor, index - KEEP, self.pass_row)
        if self.pass_row == 0:
            self.read_to = max(self.read_to, index + 1)
        else:
            self.past_first = True
        hi = lo + self.row_len
        return fill(self.row_len, self.packing, self.pad_id, lo, (d for d in self.docs if d[0] < hi))

    def first(self, count: int):
        """The first `count` records of each data entry as the stream tokenises them: ((ids,
        targets), where) each, read for this alone (what a checkpoint keeps of how the data
        tokenizes: train/tokenized.py). An entry's records end at a bad one: the stream stops the
        run at the step that reads it, with the checkpoints before it."""
        entries, _, _, tokenizer, train_on_prompt, cutoff = self.args
        for entry in entries:
            read = records(entry)
            try:
                for k, (where, record) in enumerate(read):
                    if k == count:
                        break
                    made = document(tokenizer, record, train_on_prompt, where, cutoff=cutoff,
                                    mask_history=entry.get("mask_history", False), **loss_keys(entry))
                    yield (made.ids, made.targets), where
            except ArgumentError:
                continue
            finally:
                read.close()

    def digest(self) -> dict | None:
        """What a checkpoint keeps of the rows read so far (stream_digest.py); None past the first pass."""
        return None if self.past_first else self.windows.through(self.read_to, self.row_len)

    def same_rows(self, saved: dict) -> bool:
        """Whether the stream, read again up to a checkpoint's position, gives the rows it read
        before (`saved`: its digest()): its data may then have changed further on."""
        rows = saved.get("rows") if isinstance(saved, dict) else None
        if not isinstance(rows, int) or rows <= 0:
            return False
        self.row(rows - 1)
        return self.pass_row == 0 and self.windows.through(rows, self.row_len) == saved

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
