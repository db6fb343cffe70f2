"""eval_fraction: hold out that fraction of the training data's tokens (not of its documents: a
.txt file is one document, and documents differ in length by orders of magnitude).

The documents are taken in an order shuffled by seed and held out until the fraction is reached;
the document that crosses it is cut in two there, its head held out and its tail trained on. The
cut is one more offset in the token file's document table: both halves stay contiguous runs of
its tokens, so rows are read from them as from any document. Only plain text is cut: a
supervised record (a conversation, an instruction and its answer) or a document with images is
held out whole.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ...errors import ArgumentError
from .tokens import TokenFile


@dataclass
class Split:
    tokens: TokenFile        # the token file, its document table with the cut (if any)
    train: np.ndarray        # document indices into tokens.docs
    held: np.ndarray
    cut: bool                # a document was cut in two

    def tokens_in(self, docs: np.ndarray) -> int:
        return int((self.tokens.docs[docs + 1] - self.tokens.docs[docs]).sum())


def hold_out(tokens: TokenFile, fraction: float, seed: int) -> Split:
    """`fraction` of the tokens held out (at least one token, and one left to train on)."""
    total = int(tokens.docs[-1])
    if total < 2:
        raise ArgumentError(f"eval_fraction holds out a fraction of the tokens, and the data has {total}; "
                            "give more data or an eval file")
    want = min(total - 1, max(1, round(fraction * total)))
    order = np.random.default_rng([seed, 1 << 20]).permutation(tokens.n_docs)
    lengths = tokens.docs[1:] - tokens.docs[:-1]
    reached = np.cumsum(lengths[order])
    k = int(np.searchsorted(reached, want))            # order[k] holds the want-th token
    whole = int(order[k]) in tokens.images or (tokens.records is not None and tokens.records[order[k]])
    if whole and k + 1 == len(order):
        raise ArgumentError(f"eval_fraction {fraction:g} reaches into the last document left to train on, a record "
                            "held out whole (records are never cut), leaving none to train on; give a smaller "
                            "eval_fraction, or eval files")
    if reached[k] == want or whole:      # it ends there, or it is not cut: whole documents
        return Split(tokens, np.sort(order[k + 1:]), np.sort(order[:k + 1]), cut=False)
    doc = int(order[k])
    at = int(tokens.docs[doc + 1] - (reached[k] - want))
    table = np.insert(np.asarray(tokens.docs), doc + 1, at)      # doc -> [start, at), doc + 1 -> [at, end)
    renumber = order + (order > doc)
    held = np.concatenate([renumber[:k], [doc]])
    train = np.concatenate([[doc + 1], renumber[k + 1:]])
    pictures = {d + (d > doc): found for d, found in tokens.images.items()}
    records = None if tokens.records is None else np.insert(tokens.records, doc + 1, False)
    return Split(replace(tokens, docs=table, images=pictures, records=records), np.sort(train), np.sort(held),
                 cut=True)
