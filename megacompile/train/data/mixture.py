"""Several data sources mixed by weight into one order of documents, the same on every run.

    concat             every document of every source once an epoch (then shuffled together, as
                       with one source); weights are refused
    interleave_under   sources take turns in proportion to their weights; the epoch ends when a
                       source it turns to has no document left (the smaller sources are not
                       repeated, the larger ones are not read to their end: their documents left
                       over differ from epoch to epoch, since each epoch draws its own order)
    interleave_over    as under, and a source that runs out starts again (in a new order); the
                       epoch ends once every source of nonzero weight has been read to its end

Whose turn it is follows smooth weighted round robin: each turn every source gains its weight in
credit, the source with the most credit (the first on a tie) gives the next document and pays 1.
Every prefix of the order then holds each source's share to within one document, with no
randomness in the shares; which documents a source gives comes from its own order, shuffled by
(seed, epoch, source, pass) like a single source's. A run's order is a pure function of the
seed, so the data position saved with a checkpoint (rows consumed) still names one row.
"""
from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from ...errors import ArgumentError


def interleave(weights: list[float] | None, strategy: str, passes: list[Callable[[int], Iterator]]) -> Iterator:
    """(source, item) in mixed order; passes[i](k) iterates source i's k-th pass over its items."""
    if weights is None or strategy == "concat":
        for i, open_pass in enumerate(passes):
            for item in open_pass(0):
                yield i, item
        return
    live = [i for i, w in enumerate(weights) if w > 0]
    credit = [0.0] * len(weights)
    its = {i: passes[i](0) for i in live}
    cycle = {i: 0 for i in live}
    unfinished = set(live)
    while True:
        for i in live:
            credit[i] += weights[i]
        i = max(live, key=lambda j: (credit[j], -j))
        credit[i] -= 1.0
        item = next(its[i], _END)
        if item is _END:
            if strategy == "interleave_under" or cycle[i] == 0 and not _any_items(passes[i]):
                return
            cycle[i] += 1
            its[i] = passes[i](cycle[i])
            item = next(its[i])
        yield i, item
        if strategy == "interleave_over" and cycle[i] == 0 and _last(its, i):
            unfinished.discard(i)
            if not unfinished:
                return


_END = object()


def _any_items(open_pass) -> bool:
    return next(open_pass(0), _END) is not _END


def _last(its: dict, i: int) -> bool:
    """Whether source i's pass has just given its last item (peeks, keeping the item)."""
    it = its[i]
    head = next(it, _END)
    if head is _END:
        its[i] = iter(())
        return True
    its[i] = _chain(head, it)
    return False


def _chain(head, rest) -> Iterator:
    yield head
    yield from rest


def epoch_order(sources: list[np.ndarray], weights: list[float] | None, strategy: str, seed: int, epoch: int,
                shuffle: bool = True) -> np.ndarray:
    """One epoch's documents (indices into the token file) from each source's documents, mixed by
    weight (concat with one source is packing.Rows' own shuffle, and does not come here)."""
    for i, docs in enumerate(sources):
        if len(docs) == 0 and (weights is None or weights[i] > 0):
            raise ArgumentError(f"data entry {i + 1} holds no training documents (after eval_fraction, if any); "
                                "remove it or give it weight 0")

    def passes(i: int) -> Callable[[int], Iterator]:
        def open_pass(k: int) -> Iterator:
            docs = sources[i]
            if shuffle:
                docs = np.random.default_rng([seed, epoch, i, k, 7]).permutation(docs)
            return iter(docs.tolist())
        return open_pass

    order = [doc for _, doc in interleave(weights, strategy, [passes(i) for i in range(len(sources))])]
    return np.asarray(order, dtype=np.int64)


def source_of(tokens, docs: np.ndarray) -> np.ndarray:
    """The data entry each document came from (by where its tokens start)."""
    return np.searchsorted(tokens.sources, tokens.docs[docs], side="right") - 1
