"""`tokenize_workers` (LlamaFactory's `preprocessing_num_workers`, TRL's `dataset_num_proc`): a
token file's records tokenised by that many processes. Records go out in chunks and their
documents come back in the records' order, so the token file is the one a single process makes,
byte for byte, and a bad record is met where a single process would meet it (the first in file
order, named by its line).

The workers are forked from the run when a token file is made, as `datasets`' `map(num_proc=)`
forks them, and inherit the tokenizer rather than receive it; at most a few chunks per worker are
in flight, so memory holds a window of the data, not the data. Records with images or videos are
tokenised in the run's own process (their processor reads and writes image files as it goes).
"""
from __future__ import annotations

import multiprocessing
import os
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np

from . import sharegpt
from .encoding import document

CHUNK = 64          # records a task carries: large enough that a task's pickling costs little
IN_FLIGHT = 3       # tasks per worker queued at once


@dataclass
class Work:
    """What every record is tokenised with (a worker's copy comes with the fork)."""
    tokenizer: object
    train_on_prompt: bool
    cutoff: int | None
    mask_history: bool
    media: object = None


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
    doc = document(work.tokenizer, record, work.train_on_prompt, where, work.media, work.cutoff, work.mask_history)
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
    global _WORK
    _WORK = work
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")    # the tokenizer's own threads, not across forks
    pool = multiprocessing.get_context("fork").Pool(workers)
    try:
        pending: deque = deque()
        for chunk in _chunks(records):
            pending.append(pool.apply_async(_tokenise, (chunk,)))
            if len(pending) >= IN_FLIGHT * workers:
                yield from pending.popleft().get()
        while pending:
            yield from pending.popleft().get()
    finally:
        pool.terminate()
        pool.join()
        _WORK = None


_WORK: Work | None = None       # set in the run's process before the fork: the workers' copy


def _tokenise(chunk: list[tuple[str, dict]]) -> list[Made]:
    return [made(where, record, _WORK) for where, record in chunk]


def _chunks(records: Iterable[tuple[str, dict]]) -> Iterator[list]:
    chunk = []
    for item in records:
        chunk.append(item)
        if len(chunk) == CHUNK:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
