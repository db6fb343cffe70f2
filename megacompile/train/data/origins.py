"""Which records of the data files rows of a token file hold, each named as the run names a record
it refuses: `file:line` (a .jsonl file), `file line N` (lines of text), `file row N` (a table the
datasets library reads), the file itself (a .txt document).

The token file keeps where a document came from only for the documents with images. The others
are found from their order: the documents follow the data entries in order (the entry of one is
told by where its tokens start: mixture.source_of), and an entry's documents follow its records
as reading.records() yields them, one each, but for a record that gave no token (an empty text,
under a tokenizer without an EOS), which gave no document. So the k-th document of an entry is
its k-th record or a later one: the records are read again in order and, from the k-th on,
tokenised until one gives the document's tokens. Reading is sequential (a document late in a
large file reads the file up to it): it is done when a run stops on a step, never per step.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np

from .encoding import loss_keys
from .reading import records
from .tokens import TokenFile
from .workers import Work, made

TRIES = 256     # records tokenised past the k-th before a document is named by its number alone


class Origins:
    """`made`: the token file as tokenised (its own document table; the rows' may hold one more
    cut: split.py); `entries`: the data entries it was made from; `tokenizer`, `train_on_prompt`,
    `cutoff`: what its records were tokenised with (token_file()'s), or tokenizer None: the k-th
    document is taken as the k-th record unchecked (a vision-language run's, whose text tokenizer
    writes through its processor)."""

    def __init__(self, made: TokenFile, entries: list[dict], tokenizer, train_on_prompt: bool, cutoff: int | None):
        self.made, self.entries = made, entries
        self.tokenizer, self.train_on_prompt, self.cutoff = tokenizer, train_on_prompt, cutoff

    def of_rows(self, rows, indices: Iterable[int]) -> list[str]:
        """Where each record the rows `indices` (packing.Rows) hold tokens of came from, in row
        order, each once."""
        starts = [int(rows.tokens.docs[d]) for i in indices for d in rows.documents(i)]
        docs = dict.fromkeys(int(np.searchsorted(self.made.docs, s, side="right")) - 1 for s in starts)
        return list(dict.fromkeys(self.of_documents(list(docs))))

    def of_documents(self, docs: list[int]) -> list[str]:
        """Where each of the token file's documents `docs` came from, in the order given."""
        found: dict[int, str] = {}
        by_entry: dict[int, list[int]] = {}
        for d in docs:
            if d in self.made.images:
                found[d] = self.made.images[d][0]
            else:
                by_entry.setdefault(self._entry(d), []).append(d)
        for i, wanted in by_entry.items():
            found.update(self._in_entry(i, sorted(set(wanted))))
        return [found[d] for d in docs]

    def _entry(self, doc: int) -> int:
        sources = self.made.sources
        if sources is None or len(sources) < 2:
            return 0
        return int(np.searchsorted(sources, self.made.docs[doc], side="right")) - 1

    def _in_entry(self, i: int, wanted: list[int]) -> dict[int, str]:
        """The records of entry `i` that gave its documents `wanted` (ascending)."""
        entry, docs, sources = self.entries[i], self.made.docs, self.made.sources
        first = 0 if sources is None or len(sources) < 2 else int(np.searchsorted(docs, sources[i], side="left"))
        work = None if self.tokenizer is None else Work(self.tokenizer, self.train_on_prompt, self.cutoff,
                                                        entry.get("mask_history", False), loss=loss_keys(entry))
        out: dict[int, str] = {}
        pending = iter(wanted)
        doc = next(pending, None)
        behind = tried = 0      # records met that gave no document; records tokenised for `doc`
        for n, (where, record) in enumerate(records(entry)):
            if doc is None:
                break
            if n < doc - first + behind:
                continue
            if _gives(where, record, work, self.made.ids[docs[doc]:docs[doc + 1]]):
                out[doc], doc, tried = where, next(pending, None), 0
                continue
            behind, tried = behind + 1, tried + 1
            if tried > TRIES:       # not found near its place: named by its number, the next ones as before it
                out[doc], doc, behind, tried = _numbered(entry, doc - first), next(pending, None), behind - tried, 0
        while doc is not None:
            out[doc], doc = _numbered(entry, doc - first), next(pending, None)
        return out


def _numbered(entry: dict, k: int) -> str:
    return f"{entry['path']} (its document {k + 1})"


def _gives(where: str, record: dict, work: Work | None, ids: np.ndarray) -> bool:
    """Whether the record, tokenised again, gives these tokens (unchecked without a tokenizer; a
    record the tokenizer refuses now gave a document before: it is taken as that one)."""
    if work is None:
        return True
    try:
        again = made(where, record, work).ids
    except (ValueError, KeyError, TypeError):
        return True
    return len(again) == len(ids) and bool(np.array_equal(again, ids))
