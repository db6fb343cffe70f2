"""Rows of training tokens from a token file, and micro-batches of model inputs from rows.

Each epoch lays the documents (in an order shuffled by seed and epoch) into one stream as
placement.py says and cuts it into rows of `row_len` tokens; the rows are then visited in a
shuffled order. Plain text follows the previous document and may continue in the next row (with
packing off it starts a row of its own and takes ceil(len / row_len) rows, the last one padded).
A supervised record is at most a row long (truncated when tokenised: cutoff.py) and never crosses
a row's end: with packing on, records share rows whole (LlamaFactory's greedy knapsack), else each
fills a row of its own, the rest padded. Documents that share a row are separated by the EOS each
ends with. `isolated` packing also restarts the position ids at every document and at every row
start, and never makes a document's first token the target of the previous document's last one;
a decoder that builds its causal mask from position ids (transformers' packed-sequence masks) then
keeps packed documents from attending to each other.

A document with images (images.py) is never packed: it starts a row of its own and fills it, the
rest padded, so a row holds all of an image's tokens or none, and a micro-batch's pixel_values
are the images of its rows' documents, in row order. Such a document longer than a row is
refused: its image tokens would be cut from their pixels.

A row's padding is kept out of the attention where the model counts its tokens beyond the loss
(a mixture-of-experts router's load-balancing statistics, train/router_loss.py): its micro-batches
then carry an attention_mask, 1 on every document's tokens and 0 on the padding, as LlamaFactory's
collator pads. Elsewhere none is passed: right padding changes no real token's output, and the
loss skips it. Nor under isolated packing, whose position ids keep documents apart only where
transformers is given no attention_mask: there a row's padding (a packed row's tail) is counted.

Row r of the run is a pure function of (seed, r): the data position saved with a checkpoint is
one number, the rows consumed.
"""
from __future__ import annotations

import numpy as np
import torch

from ...errors import ArgumentError
from . import placement
from .tokens import TokenFile

IGNORE = -100   # the label the loss skips (torch cross_entropy's ignore_index)


class Rows:
    """`mix(epoch)`, when given, is the epoch's document order (mixture.py): a mixture's epochs
    differ in length, so where each begins is counted as the rows reach it. `packing`: false,
    true, isolated, or None (unset: text packed, records one a row; placement.py)."""

    def __init__(self, tokens: TokenFile, row_len: int, packing: bool | str, seed: int, *,
                 docs: np.ndarray | None = None, shuffle: bool = True, pad_id: int = 0, mix=None, pixels=None):
        self.tokens, self.row_len, self.packing, self.seed = tokens, row_len, packing, seed
        self.shuffle, self.pad_id, self.mix = shuffle, pad_id, mix
        self.pixels = pixels        # (each row's image files, input_ids) -> image inputs (images.Media.inputs)
        for doc, (where, _) in tokens.images.items():
            n = int(tokens.docs[doc + 1] - tokens.docs[doc])
            if n > row_len:
                raise ArgumentError(f"{where}: the record has images and is {n:,} tokens, longer than a row "
                                    f"({row_len:,}): its image tokens would be cut from their pixels; give seq >= "
                                    f"{n:,}, or shorten the record")
        self.kinds = np.full(tokens.n_docs, placement.TEXT, dtype=np.uint8)
        if tokens.records is not None:
            self.kinds[tokens.records] = placement.RECORD
        self.kinds[list(tokens.images)] = placement.PICTURED
        self.docs = np.arange(tokens.n_docs) if docs is None else np.asarray(docs)
        self._epoch: tuple | None = None
        self._ends: list[int] = []       # rows before the end of each epoch counted so far
        order = self._layout(0)[0]
        self.rows_per_epoch = self._ends[0]
        self.epoch_tokens = int((tokens.docs[order + 1] - tokens.docs[order]).sum())

    @property
    def one_a_row(self) -> bool:
        """Every document fills a row of its own (records unpacked, or documents with images)."""
        return self.packing in (None, False) and not (self.kinds == placement.TEXT).any()

    def _layout(self, epoch: int) -> tuple:
        """The epoch's document order, where each starts in the stream, and its row order."""
        if self._epoch is None or self._epoch[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            if self.mix is not None:
                order = self.mix(epoch)
            else:
                order = rng.permutation(self.docs) if self.shuffle else self.docs
            lengths = self.tokens.docs[order + 1] - self.tokens.docs[order]
            placed, starts = placement.layout(lengths, self.kinds[order], self.row_len, self.packing)
            order = order[placed]
            n_rows = max(1, int(-(-starts[-1] // self.row_len)))
            rows = rng.permutation(n_rows) if self.shuffle else np.arange(n_rows)
            if len(self._ends) == epoch:
                self._ends.append((self._ends[-1] if epoch else 0) + n_rows)
            self._epoch = (epoch, order, starts, rows)
        return self._epoch[1:]

    def _place(self, index: int) -> tuple[int, int]:
        """The epoch of row `index` of the run and its place in the epoch."""
        if self.mix is None:
            return divmod(index, self.rows_per_epoch)
        while self._ends[-1] <= index:
            self._layout(len(self._ends))
        epoch = int(np.searchsorted(self._ends, index, side="right"))
        return epoch, index - (self._ends[epoch - 1] if epoch else 0)

    def _span(self, index: int) -> tuple:
        epoch, at = self._place(index)
        order, starts, rows = self._layout(epoch)
        lo = int(rows[at]) * self.row_len
        return order, starts, lo, lo + self.row_len

    def documents(self, index: int) -> list[int]:
        """The documents row `index` holds tokens of (indices into the token file)."""
        order, starts, lo, hi = self._span(index)
        first = int(np.searchsorted(starts, lo, side="right")) - 1
        last = int(np.searchsorted(starts, hi, side="left"))
        return [int(d) for k, d in enumerate(order[first:last], first) if min(hi, starts[k + 1]) > max(lo, starts[k])]

    def images(self, index: int) -> list[str]:
        """The image files of row `index`'s documents (a document with images fills a row alone)."""
        if not self.tokens.images:
            return []
        return [p for d in self.documents(index) for p in self.tokens.images.get(d, ("", []))[1]]

    def row(self, index: int) -> tuple[np.ndarray, ...]:
        """Row `index` of the run (epochs follow each other): tokens, targets, positions, and
        which tokens are a document's (False on padding)."""
        order, starts, lo, hi = self._span(index)
        first = int(np.searchsorted(starts, lo, side="right")) - 1
        last = int(np.searchsorted(starts, hi, side="left"))
        docs = self.tokens.docs
        pieces = ((int(starts[k]), self.tokens.ids[docs[d]:docs[d + 1]], self.tokens.targets[docs[d]:docs[d + 1]])
                  for k, d in enumerate(order[first:last], first))
        return fill(self.row_len, self.packing, self.pad_id, lo, pieces)


def fill(row_len: int, packing: bool | str, pad_id: int, lo: int, pieces) -> tuple[np.ndarray, ...]:
    """The row that starts at `lo` in an epoch's stream, from the documents that overlap it:
    (where the document starts in the stream, its tokens, its targets)."""
    hi = lo + row_len
    ids = np.full(row_len, pad_id, dtype=np.int64)
    targets = np.zeros(row_len, dtype=bool)
    positions = np.arange(row_len, dtype=np.int64)
    kept = np.zeros(row_len, dtype=bool)
    for s, doc_ids, doc_targets in pieces:
        a, b = max(lo, s), min(hi, s + len(doc_ids))        # stream span of this document in the row
        if a >= b:
            continue
        ids[a - lo:b - lo] = doc_ids[a - s:b - s]
        targets[a - lo:b - lo] = doc_targets[a - s:b - s]
        kept[a - lo:b - lo] = True
        if packing == "isolated":
            positions[a - lo:b - lo] = np.arange(b - a)
            if a == s and a > lo:
                targets[a - lo] = False    # no document is asked to predict the next one's start
    return ids, targets, positions, kept


def batch(rows: Rows, start: int, size: int, *, shifted: bool, padding_mask: bool = False) -> dict[str, torch.Tensor]:
    """The model inputs for rows start .. start+size-1.

    Hugging Face decoders take labels aligned with input_ids and shift them inside (the token at
    i is the target of position i-1): rows are `seq` long. The bundled model takes labels already
    shifted: rows are seq + 1 long and the last token is only a target. `padding_mask`: with an
    attention_mask, 0 on the rows' padding (for a Hugging Face decoder).
    """
    return batch_of(rows, range(start, start + size), shifted=shifted, padding_mask=padding_mask)


def batch_of(rows: Rows, indices, *, shifted: bool, padding_mask: bool = False) -> dict[str, torch.Tensor]:
    """batch() for these rows, in this order."""
    got = [rows.row(i) for i in indices]
    # streamed rows (streaming.py) hold no images
    pictures = [rows.images(i) for i in indices] if hasattr(rows, "images") else []
    ids = torch.from_numpy(np.stack([g[0] for g in got]))
    targets = torch.from_numpy(np.stack([g[1] for g in got]))
    labels = ids.masked_fill(~targets, IGNORE)
    if shifted:
        return {"input_ids": ids[:, :-1].contiguous(), "labels": labels[:, 1:].contiguous()}
    inputs = {"input_ids": ids, "labels": labels}
    if padding_mask:
        inputs["attention_mask"] = torch.from_numpy(np.stack([g[3] for g in got])).long()
    if any(pictures):
        inputs.update(rows.pixels(pictures, ids))
    if rows.packing == "isolated":
        inputs["position_ids"] = torch.from_numpy(np.stack([g[2] for g in got]))
    return inputs


def target_count(inputs: dict[str, torch.Tensor], *, shifted: bool) -> int:
    """Tokens the loss of these inputs averages over."""
    labels = inputs["labels"] if shifted else inputs["labels"][:, 1:]
    return int((labels != IGNORE).sum())


