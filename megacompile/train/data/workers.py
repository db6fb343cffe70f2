"""`tokenize_workers` (LlamaFactory's `preprocessing_num_workers`, TRL's `dataset_num_proc`): a
token file's records tokenised by that many processes. Records go out in chunks and their
documents come back in the records' order, so the token file is the one a single process makes,
byte for byte, and a bad record is met where a single process would meet it (the first in file
order, named by its line).

The workers are forked from the run when a token file is made, as `datasets`' `map(num_proc=)`
forks them, and inherit the tokenizer rather than receive it; one chunk per worker is in flight,
so memory holds a window of the data, not the data. Records with images or videos are tokenised
in the run's own process (their processor reads and writes image files as it goes).

Each worker has a pipe of its own and the run hands worker w its next chunk only once it has read
w's last result, so neither side ever waits on a full pipe the other is not reading. No helper
thread is involved: multiprocessing.Pool's teardown joins threads of its own, and a join that
was never woken has been seen to hold a run (and its test) for minutes.
"""
from __future__ import annotations

import multiprocessing
import os
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import numpy as np

from . import sharegpt
from .encoding import document

CHUNK = 64          # records a task carries: large enough that a task's pickling costs little


@dataclass
class Work:
    """What every record is tokenised with (a worker's copy comes with the fork)."""
    tokenizer: object
    train_on_prompt: bool
    cutoff: int | None
    mask_history: bool
    media: object = None
    loss: dict = field(default_factory=dict)   # TRL's assistant_only_loss, completion_only_loss where given


@dataclass
class Made:
    """One record's document, as the token file takes it."""
    where: str
    ids: np.ndarray         # uint32
    targets: np.ndarray     # uint8
    record: bool            # a supervised record (kept whole in a row), not plain text
    cut: int                # tokens its truncation dropped
    roles: list             # the roles of its chat turns, as the file writes them
    images: list | None     # the image and video files it shows (a vision-language model's records)


def made(where: str, record: dict, work: Work) -> Made:
    doc = document(work.tokenizer, record, work.train_on_prompt, where, work.media, work.cutoff, work.mask_history,
                   **work.loss)
    shown = None
    if work.media is not None:
        from .images import held
        shown = work.media.paths(record, where) if held(record) else None
    return Made(where, np.asarray(doc.ids, dtype=np.uint32), np.asarray(doc.targets, dtype=np.uint8), doc.record,
                doc.cut, sharegpt.roles(record), shown)


def documents(records: Iterable[tuple[str, dict]], work: Work, workers: int) -> Iterator[Made]:
    """Each record's Made, in order; by `workers` processes when more than one (and no media)."""
    if workers <= 1 or work.media is not None:
        for where, record in records:
            yield made(where, record, work)
        return
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")    # the tokenizer's own threads, not across forks
    context = multiprocessing.get_context("fork")
    links, processes, finished = [], [], False
    try:
        for _ in range(workers):
            here, there = context.Pipe()
            process = context.Process(target=_serve, args=(there, work), daemon=True, name="megacompile-tokenise")
            process.start()
            there.close()
            links.append(here)
            processes.append(process)
        chunks = _chunks(records)
        turns: deque = deque()      # the worker of each chunk in flight, in the records' order
        for w in range(workers):
            chunk = next(chunks, None)
            if chunk is None:
                break
            links[w].send(chunk)
            turns.append(w)
        while turns:
            w = turns.popleft()
            done = _result(links[w], processes[w])
            chunk = next(chunks, None)
            if chunk is not None:       # w waits for it: it sent its result
                links[w].send(chunk)
                turns.append(w)
            yield from done
        for link in links:
            link.send(None)
        finished = True
    finally:
        for link in links:
            link.close()
        for process in processes:
            if finished:
                process.join(timeout=10)
            if process.exitcode is None:        # the run stopped early (an error, or closed): not waited for
                process.kill()
                process.join()


def _serve(link, work: Work) -> None:
    """A worker: chunks in, their Made out (or the first record's error, raised by the run)."""
    while (chunk := link.recv()) is not None:
        try:
            out = ("made", [made(where, record, work) for where, record in chunk])
        except Exception as e:  # noqa: BLE001 - the record's error travels to the run, which raises it
            out = ("error", e)
        try:
            link.send(out)
        except Exception as e:  # noqa: BLE001 - an error that does not pickle goes as its text
            link.send(("error", RuntimeError(f"{type(e).__name__}: {e}")))


def _result(link, process) -> list[Made]:
    try:
        kind, value = link.recv()
    except EOFError:
        process.join(timeout=5)     # its exit code, once it is reaped
        raise RuntimeError(f"a tokenize worker (pid {process.pid}) ended without its result (exit code "
                           f"{process.exitcode}); run again with tokenize_workers: 1 to tokenise in the run's "
                           "own process") from None
    if kind == "error":
        raise value
    return value


def _chunks(records: Iterable[tuple[str, dict]]) -> Iterator[list]:
    chunk = []
    for item in records:
        chunk.append(item)
        if len(chunk) == CHUNK:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
