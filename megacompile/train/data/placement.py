"""Where each document of an epoch lies in the stream that rows are cut from: the one rule for
token files (packing.Rows) and streams (streaming.StreamRows). Plain lists and arrays in, an
order and start offsets out.

    text       plain text (a pre-training document): follows the previous document in the stream
               and may continue across rows (packing: true, isolated, or unset); with
               packing: false it starts a row of its own and fills whole rows, the last padded
    record     a supervised record (chat, Alpaca, prompt/completion), at most a row long (cutoff.py):
               never split across rows. packing: true or isolated packs records whole, several to a
               row, by LlamaFactory's greedy knapsack; packing unset or false: one record a row
    pictured   a record with images or videos: a row of its own, whatever packing says (images.py)

The order is taken WINDOW documents at a time, as LlamaFactory packs each preprocessing batch of
1000 examples on its own: a window's packed records first, one row per knapsack, then its other
documents in their order (a text document may fill the rest of the last knapsack's row). Without
packed records the order is kept as it is.
"""
from __future__ import annotations

import bisect

import numpy as np

TEXT, RECORD, PICTURED = 0, 1, 2
WINDOW = 1000       # LlamaFactory's preprocessing_batch_size: the examples one knapsack pass sees


def greedy_knapsack(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices into `lengths`, in bins of at most `capacity` tokens, as LlamaFactory's
    greedy_knapsack: each bin takes the longest length that still fits, until none does (of equal
    lengths the last given goes first, as its length2indexes pops them)."""
    by_length = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    sizes = [lengths[i] for i in by_length]
    bins = []
    while by_length:
        room, current = capacity, []
        while (k := bisect.bisect(sizes, room) - 1) >= 0:
            room -= sizes.pop(k)
            current.append(by_length.pop(k))
        if not current:
            raise ValueError(f"a length of {sizes[0]} is above the capacity {capacity}")
        bins.append(current)
    return bins


def packs_records(packing: bool | str | None) -> bool:
    return packing not in (None, False)


def place(at: int, lengths: np.ndarray, kinds: np.ndarray, row_len: int,
          packing: bool | str | None) -> tuple[np.ndarray, np.ndarray, int]:
    """The documents of one window, laid from stream offset `at`: (their order, as positions in
    `lengths`; where each starts, in that order; the stream offset after the last)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    kinds = np.asarray(kinds, dtype=np.uint8)
    if len(lengths) and int(lengths[kinds != TEXT].max(initial=0)) > row_len:
        raise ValueError(f"a record of {int(lengths[kinds != TEXT].max())} tokens is longer than a row ({row_len}): "
                         "records are truncated to the row when tokenised (token_file's cutoff)")
    whole_rows = -(-lengths // row_len) * row_len
    own_row = (kinds != TEXT) if packing is not False else np.ones(len(lengths), dtype=bool)
    packed = (kinds == RECORD) & packs_records(packing)
    if not packed.any() and (own_row.all() or not own_row.any()):     # no row to align: offsets add up
        sizes = whole_rows if own_row.all() else lengths
        first = -(-at // row_len) * row_len if own_row.any() else at
        starts = first + np.concatenate([[0], np.cumsum(sizes)])
        return np.arange(len(lengths)), starts[:-1], int(starts[-1])
    order, starts = [], []
    records = np.flatnonzero(packed)
    for knapsack in greedy_knapsack(lengths[records].tolist(), row_len):
        at = -(-at // row_len) * row_len
        for k in knapsack:
            order.append(int(records[k]))
            starts.append(at)
            at += int(lengths[records[k]])
    for i in np.flatnonzero(~packed).tolist():
        if own_row[i]:
            at = -(-at // row_len) * row_len
            starts.append(at)
            at += int(whole_rows[i])
        else:
            starts.append(at)
            at += int(lengths[i])
        order.append(i)
    return np.asarray(order, dtype=np.int64), np.asarray(starts, dtype=np.int64), at


def layout(lengths: np.ndarray, kinds: np.ndarray, row_len: int, packing: bool | str | None,
           window: int = WINDOW) -> tuple[np.ndarray, np.ndarray]:
    """A whole epoch, window by window from offset 0: (the order, as positions in `lengths`; the
    starts in that order and the stream's end, len + 1 offsets)."""
    if not len(lengths):
        return np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64)
    kinds = np.asarray(kinds)
    if not packs_records(packing) or not (kinds == RECORD).any():
        order, starts, end = place(0, lengths, kinds, row_len, packing)     # the order stays: one window
        return order, np.append(starts, end)
    orders, starts, at = [], [], 0
    for lo in range(0, len(lengths), window):
        order, where, at = place(at, lengths[lo:lo + window], kinds[lo:lo + window], row_len, packing)
        orders.append(order + lo)
        starts.append(where)
    return np.concatenate(orders), np.append(np.concatenate(starts), at)
