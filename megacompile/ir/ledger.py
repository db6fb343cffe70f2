"""The one rule for counting device bytes, shared by the memory simulator and the runtime.

A storage counts once, from the first value that holds it until the last holder lets go:
views and in-place results cost nothing, and a saved view keeps its whole base alive.
The simulator feeds it fake tensors from the traced graphs; the runtime feeds it the real
tensors it creates. Keeping one rule is what makes predicted and measured peaks comparable.
"""
from __future__ import annotations

from typing import Hashable


class StorageLedger:
    def __init__(self) -> None:
        self._holders: dict[Hashable, set[Hashable]] = {}
        self._bytes: dict[Hashable, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0

    def hold(self, holder: Hashable, storage: Hashable, nbytes: int) -> int:
        """Record that `holder` keeps `storage` alive; returns the bytes newly counted."""
        holders = self._holders.get(storage)
        if holders is not None:
            holders.add(holder)
            return 0
        self._holders[storage] = {holder}
        self._bytes[storage] = nbytes
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return nbytes

    def drop(self, holder: Hashable, storage: Hashable) -> int:
        """`holder` lets go of `storage`; returns the bytes released (0 while others hold it)."""
        holders = self._holders.get(storage)
        if holders is None or holder not in holders:
            return 0
        holders.discard(holder)
        if holders:
            return 0
        del self._holders[storage]
        nbytes = self._bytes.pop(storage)
        self.live_bytes -= nbytes
        return nbytes

    def holds(self, storage: Hashable) -> bool:
        return storage in self._holders

    def snapshot(self) -> dict[Hashable, frozenset]:
        """Who holds what now, for restore()."""
        return {storage: frozenset(holders) for storage, holders in self._holders.items()}

    def restore(self, snapshot: dict[Hashable, frozenset]) -> None:
        """Drop every hold taken since `snapshot` (a step that failed gives back what it took)."""
        for storage, holders in list(self._holders.items()):
            for holder in holders - snapshot.get(storage, frozenset()):
                self.drop(holder, storage)

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes
