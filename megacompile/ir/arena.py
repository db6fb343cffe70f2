"""The device arena: every device tensor of a step at an offset in one allocation.

A step's device tensors are known before it runs, each with its size and the steps of the
timeline it is live over (passes/arena.py takes them from the schedule, by the ledger's rule).
Two tensors live at the same step must not overlap; tensors that never are live together may
share bytes. The arena's size is the highest end offset; what it holds above the predicted peak
(the most bytes live at once, a lower bound for any layout) is the packing's own cost,
`fragmentation`.

Offsets come from greedy placement over known lifetimes (Pisarchyk and Lee 2020, "Efficient
Memory Management for Deep Neural Net Inference", the offset planners of TFLite's arena): the
tensors one by one in a fixed order, each into a gap among the tensors already placed whose
lifetimes meet its own (the tightest gap that holds it, or the lowest), else above the highest of
them. The paper gives two orders:
  by size      largest first: large tensors are the hardest to fit into what is left, small ones
               fill the holes between them (TFLite's default);
  by breadth   the tensors of the busiest step first, then those of the next busiest, and so on:
               the steps that set the arena's size are packed before anything else can split them.
No order wins everywhere, and on training schedules (weights streamed in turn, saved values kept
forward to backward or sent out and back, a block's working set repeated block after block) how
ties are broken moves the result by several percent. Measured on Llama-2-7B-shaped plans at 6, 20
and 40 GiB and on small Llamas at their smallest budget: greedy by size alone wastes 0.4-11% of
the peak; the best of the orders below, each with both gap rules, 0-4.5%. So all of them run
(each a few milliseconds per thousand tensors) and the smallest arena is kept, as XLA's heap
simulator keeps the best of its orders; a layout that reaches the bound (the busiest step's
aligned bytes) ends the search.

Sizes are rounded up to ALIGNMENT, so every offset is aligned too: 512 B, what CUDA's caching
allocator rounds a block to, enough for any dtype and for vectorized loads.

The solver takes plain lists (bytes, first step, last step) and knows nothing of schedules.

A step of a 48-layer hybrid at 4096 tokens has ~10^5 device tensors, and a tensor meets a few
thousand placed before it: placing them one by one in NumPy took ~8 s an order, 14 orders a layout.
The same placement in C++ (csrc/arena_place.cpp, built at first use by megacompile/native.py)
finds what a tensor meets through buckets of the timeline and takes 0.1-3 s; the orders run on
threads side by side (from 2,000 tensors on). Both give the same offsets (tests/unit/test_arena.py); NumPy's `place` is
kept for a machine without a C++ compiler (or MEGACOMPILE_ARENA_PLACE=numpy).
"""
from __future__ import annotations

import ctypes
import os
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from .. import native

ALIGNMENT = 512
_NO_GAP = np.iinfo(np.int64).max
_SOURCE = Path(__file__).parent / "csrc" / "arena_place.cpp"
_CXXFLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c++17"]
# Fewer tensors than this are placed in well under a millisecond a run: one run after another,
# stopping at the first that reaches the bound.
_THREADED_FROM = 2000


def aligned(nbytes: int, alignment: int = ALIGNMENT) -> int:
    return -(-nbytes // alignment) * alignment


def plan_offsets(sizes: Sequence[int], firsts: Sequence[int], lasts: Sequence[int],
                 alignment: int = ALIGNMENT) -> list[int]:
    """An offset per tensor, the smallest arena of the orders and gap rules tried; tensor i is live
    from step firsts[i] to lasts[i], both included. Tensors of 0 bytes take offset 0 and no room."""
    rounded = [aligned(s, alignment) for s in sizes]
    live = [i for i in range(len(sizes)) if rounded[i]]
    if not live:
        return [0] * len(sizes)
    busiest, step_of = _breadths(rounded, firsts, lasts, live)
    bound = max(busiest)
    # Equal keys end in the given order, so the result is deterministic.
    orders = [
        lambda i: (-rounded[i], firsts[i], -lasts[i], i),                    # by size
        lambda i: (-rounded[i], firsts[i] - lasts[i], firsts[i], i),         # by size, longest lived first
        lambda i: (-busiest[i], step_of[i], -rounded[i], firsts[i], i),      # by breadth, earliest step first
        lambda i: (-busiest[i], -step_of[i], -rounded[i], firsts[i], i),     # latest step first
        lambda i: (-busiest[i], step_of[i], firsts[i] - lasts[i], -rounded[i], i),   # longest lived first
        lambda i: (-busiest[i], step_of[i], firsts[i], -rounded[i], i),      # first made first
        lambda i: (-busiest[i], step_of[i], -lasts[i], -rounded[i], i),      # last freed first
    ]
    runs = [(key, tightest) for key in orders for tightest in (True, False)]
    placer = _Placer(rounded, firsts, lasts)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if placer.native and cores > 1 and len(live) >= _THREADED_FROM:
        # Every run at once, on threads (the C++ placement runs without the GIL); the one kept is
        # the one the loop below would keep.
        with ThreadPoolExecutor(min(len(runs), cores)) as pool:
            layouts = list(pool.map(lambda run: placer(sorted(live, key=run[0]), run[1]), runs))
    else:
        layouts = (placer(sorted(live, key=key), tightest) for key, tightest in runs)
    best, best_size = None, None
    for offsets in layouts:
        size = max(offsets[i] + rounded[i] for i in live)
        if best_size is None or size < best_size:
            best, best_size = offsets, size
        if best_size == bound:
            break
    return best


def greedy_by_size(sizes: Sequence[int], firsts: Sequence[int], lasts: Sequence[int],
                   alignment: int = ALIGNMENT) -> list[int]:
    """TFLite's greedy by size alone: largest first, each into the tightest gap."""
    rounded = [aligned(s, alignment) for s in sizes]
    order = sorted((i for i in range(len(sizes)) if rounded[i]), key=lambda i: (-rounded[i], firsts[i], -lasts[i], i))
    return place(order, rounded, firsts, lasts, tightest=True)


def place(order: Sequence[int], sizes: Sequence[int], firsts: Sequence[int], lasts: Sequence[int],
          tightest: bool) -> list[int]:
    """Offsets for the tensors in `order` (sizes already aligned), placed one by one: into the
    tightest gap that holds it (`tightest`) or the lowest, among the tensors placed before it whose
    lifetimes meet its own; above the highest of them when no gap holds it."""
    return _Placer(sizes, firsts, lasts)(order, tightest)


class _Placer:
    """place() over one set of tensors, for several orders: in C++ where it builds, else NumPy."""

    def __init__(self, sizes: Sequence[int], firsts: Sequence[int], lasts: Sequence[int]):
        self.sizes, self.firsts, self.lasts = sizes, firsts, lasts
        self.library = _native()
        self.native = self.library is not None
        if self.native:
            self.arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in (sizes, firsts, lasts)]

    def __call__(self, order: Sequence[int], tightest: bool) -> list[int]:
        if not self.native:
            return place_numpy(order, self.sizes, self.firsts, self.lasts, tightest)
        order = np.ascontiguousarray(order, dtype=np.int64)
        offsets = np.zeros(len(self.sizes), np.int64)
        sizes, firsts, lasts = self.arrays
        self.library.megacompile_arena_place(len(order), order.ctypes.data, sizes.ctypes.data, firsts.ctypes.data,
                                             lasts.ctypes.data, int(tightest), offsets.ctypes.data)
        return offsets.tolist()


_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_library_tried = False


def _native() -> ctypes.CDLL | None:
    """The C++ placement, or None for NumPy's (warned about once per process)."""
    global _library, _library_tried
    if os.environ.get("MEGACOMPILE_ARENA_PLACE", "").lower() == "numpy":
        return None
    with _lock:
        if not _library_tried:
            _library_tried = True
            try:
                compiler = native.compiler()
                if compiler is None:
                    raise RuntimeError("no C++ compiler found (looked for $CXX, g++, c++, clang++)")
                library = ctypes.CDLL(str(native.build(_SOURCE, compiler, _CXXFLAGS)))
                p = ctypes.c_void_p
                library.megacompile_arena_place.argtypes = [ctypes.c_int64, p, p, p, p, ctypes.c_int, p]
                library.megacompile_arena_place.restype = None
                _library = library
            except Exception as error:  # noqa: BLE001 -- any failure means: place in NumPy
                warnings.warn(f"megacompile: the C++ arena placement is unavailable, placing in NumPy "
                              f"(slower on large schedules): {error}", RuntimeWarning, stacklevel=4)
    return _library


def place_numpy(order: Sequence[int], sizes: Sequence[int], firsts: Sequence[int], lasts: Sequence[int],
                tightest: bool) -> list[int]:
    """place() in NumPy: for each tensor, every tensor placed before it is looked at."""
    n = len(sizes)
    offsets = [0] * n
    # The tensors placed so far, in placing order.
    first = np.empty(n, np.int64)
    last = np.empty(n, np.int64)
    low = np.empty(n, np.int64)
    high = np.empty(n, np.int64)
    k = 0
    for i in order:
        size, f, l = sizes[i], firsts[i], lasts[i]
        meet = (first[:k] <= l) & (last[:k] >= f)
        offset = 0
        if meet.any():
            starts, ends = low[:k][meet], high[:k][meet]
            by_offset = np.argsort(starts, kind="stable")
            starts, ends = starts[by_offset], ends[by_offset]
            reach = np.maximum.accumulate(ends)        # the highest end among those below each
            below = np.concatenate(([0], reach[:-1]))
            gaps = starts - below                       # free bytes under each placed tensor
            holds = gaps >= size
            if not holds.any():
                offset = int(reach[-1])
            elif tightest:
                offset = int(below[np.argmin(np.where(holds, gaps, _NO_GAP))])   # the lowest of equals
            else:
                offset = int(below[np.argmax(holds)])
        offsets[i] = offset
        first[k], last[k], low[k], high[k] = f, l, offset, offset + size
        k += 1
    return offsets


def _breadths(sizes: Sequence[int], firsts: Sequence[int], lasts: Sequence[int],
              live: Sequence[int]) -> tuple[list[int], list[int]]:
    """Per tensor, the bytes live at the busiest step of its lifetime, and that step (the
    earliest of equals): a range-maximum query over the bytes-live curve (a sparse table)."""
    steps = max(lasts[i] for i in live) + 1
    change = np.zeros(steps + 1, np.int64)
    np.add.at(change, [firsts[i] for i in live], [sizes[i] for i in live])
    np.add.at(change, [lasts[i] + 1 for i in live], [-sizes[i] for i in live])
    # Each level j holds, per step t, the maximum over steps t .. t + 2**j - 1 and where it is;
    # comparing (bytes, -step) keeps the earliest step of equal maxima.
    level = np.cumsum(change)[:steps] * (steps + 1) - np.arange(steps)
    levels = [level]
    while 2 ** len(levels) <= steps:
        h = 2 ** (len(levels) - 1)
        levels.append(np.maximum(levels[-1][:-h], levels[-1][h:]))
    busiest, step_of = [0] * len(sizes), [0] * len(sizes)
    for i in live:
        j = (lasts[i] - firsts[i] + 1).bit_length() - 1
        top = int(max(levels[j][firsts[i]], levels[j][lasts[i] - 2 ** j + 1]))
        busiest[i], step_of[i] = -(-top // (steps + 1)), -top % (steps + 1)
    return busiest, step_of


@dataclass(frozen=True)
class ArenaTensor:
    """One device tensor of the step: a storage of a schedule value, or an op's output inside a
    stage graph. The runtime finds it by the schedule node that makes it (`node`) and, where an op
    of that node's stage graph makes it, the op (`op`, its graph node's name); `name` is the
    value's storage key, or the op's name for an output no value keeps."""
    name: str
    node: int          # index of the schedule node that makes it
    nbytes: int
    first: int         # first and last step it is live (DeviceArena.node_steps maps steps to nodes)
    last: int
    offset: int
    op: str = ""       # the graph op that makes it; "" for a transfer's or an input's storage
    part: int = 0      # which of the storages that op makes (an op with several results makes several)


@dataclass(frozen=True)
class DeviceArena:
    tensors: tuple[ArenaTensor, ...]
    size: int                    # bytes: the highest end of any tensor
    peak: int                    # the simulator's predicted peak of the same schedule
    node_steps: tuple[int, ...]  # the first step of each schedule node (a compute node has one per op)
    steps: int                   # steps of the timeline
    alignment: int = ALIGNMENT

    @property
    def fragmentation(self) -> int:
        """Bytes the arena holds above the predicted peak: alignment and the packing's holes."""
        return self.size - self.peak

    @property
    def fragmentation_share(self) -> float:
        """The share of the arena that is packing, not peak."""
        return self.fragmentation / self.size if self.size else 0.0

    def to_json(self) -> dict:
        return {"device_arena_bytes": self.size, "arena_fragmentation_bytes": self.fragmentation,
                "arena_fragmentation_share": self.fragmentation_share,
                "arena_alignment": self.alignment, "arena_tensor_count": len(self.tensors),
                "arena_tensors": [{"name": t.name, "node": t.node, "op": t.op, "part": t.part, "offset": t.offset,
                                   "bytes": t.nbytes,
                                   "first_step": t.first, "last_step": t.last} for t in self.tensors]}


def lay_out(names: Sequence[tuple[str, int, str, int]], sizes: Sequence[int], firsts: Sequence[int],
            lasts: Sequence[int], peak: int, node_steps: Sequence[int], steps: int,
            alignment: int = ALIGNMENT) -> DeviceArena:
    """The arena of these tensors ((name, node, op, part) each), their offsets from plan_offsets."""
    offsets = plan_offsets(sizes, firsts, lasts, alignment)
    tensors = tuple(ArenaTensor(name, node, nbytes, f, l, o, op, part)
                    for (name, node, op, part), nbytes, f, l, o in zip(names, sizes, firsts, lasts, offsets))
    size = max((t.offset + aligned(t.nbytes, alignment) for t in tensors), default=0)
    return DeviceArena(tensors, size, peak, tuple(node_steps), steps, alignment)
